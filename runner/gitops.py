"""Every git access of the controller; the only module that imports GitPython or runs git.

Two ways in, chosen by who controls the repository being touched:

- **Reads of repositories whose configuration we trust** (the operator's repository, and
  the bare ``candidate.git`` that :func:`clone_bare_untrusted` makes: its objects are the
  container's data, but its config, hooks and refs are ours) go through GitPython:
  refs and revision syntax are resolved in Python, and objects come from one persistent
  ``git cat-file --batch`` (and ``--batch-check``) process per repository, kept in a small
  cache, instead of one git process per blob, tree listing or rev-parse. Those two
  processes are started here, never by GitPython, with the same scrubbed environment as
  every other git call (:data:`FIXED_ENV`, no inherited ``GIT_*``), and GitPython may
  run no other git command (:class:`_ReadOnlyGit`). Tree entries are parsed by
  GitPython's checked parser, which refuses ``.git`` aliases, ``..`` and ``/`` in names;
  walks are iterative and capped (:data:`MAX_TREE_ENTRIES`). Changed paths are computed
  from the trees themselves, without rename detection, so a rename lists both paths.
  Replace refs are ignored (``GIT_NO_REPLACE_OBJECTS``): an id always means its object.
- **Everything else stays an explicit git invocation** (:func:`_git`): writing the
  throwaway repositories, ``git archive`` (whose ``.gitattributes`` handling
  :func:`check_export` then audits), the binary diff whose bytes must equal the
  container's, and above all :func:`clone_bare_untrusted`, which must read a repository
  a container wrote without honouring any of its config: only git's pack protocol
  (``--no-local``) gives that, so it is never opened by a reader here.

The operator's repository is only ever *read* (GitPython reads, archive, and status
with optional locks off); all writing happens in throwaway repositories cyclebox
creates itself. Commits made here use a fixed identity and fixed dates so that a
replayed cycle reproduces the same commit and patch ids. Only sha1 repositories are
read (GitPython's object model is sha1): a sha256 one is a ConfigError.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import git
from git.objects.fun import tree_entries_from_data

from runner import fswalk, interrupts, untar
from runner.errors import ConfigError, EnvironmentFailure, IntegrityError
from runner.failures import environment_reason, one_line

FIXED_ENV = {
    "GIT_AUTHOR_NAME": "cyclebox", "GIT_AUTHOR_EMAIL": "cyclebox@localhost",
    "GIT_COMMITTER_NAME": "cyclebox", "GIT_COMMITTER_EMAIL": "cyclebox@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
    "GIT_NO_REPLACE_OBJECTS": "1",
    # Neither the system's nor the operator's own git config or attributes: a filter
    # driver defined there (git lfs install writes one to ~/.gitconfig) and selected by
    # a committed .gitattributes would run on the host in archive, add or status, and
    # diff.* settings would change the host's patch.
    "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_ATTR_NOSYSTEM": "1", "HOME": "/nonexistent",
    # A path is a path: ":x" or ":(glob)x" in a proposal is not pathspec magic.
    "GIT_LITERAL_PATHSPECS": "1",
}
COMMAND_CONFIG = (("gc.auto", "0"), ("gc.autoDetach", "false"), ("maintenance.auto", "false"),
                  ("core.hooksPath", "/dev/null"))
"""Config every host git call runs with (command scope): no automatic maintenance and no
hook. A ``git commit`` in the apply stage's throwaway repository (thousands of loose
objects) started a detached ``git gc --auto`` that went on, as the host's uid, after the
repository was handed to the apply container, whose planted ``.git/worktrees`` link then
had that gc's ``worktree prune`` delete host directories."""
READER_CACHE = 4
"""Repositories whose two reader processes stay open (least recently used closed first)."""
MAX_TREE_ENTRIES = 1_000_000
"""Entries one recursive tree walk visits before it refuses (a tree bomb shares subtrees)."""
MAX_BLOB_BYTES = 32 * 1024 * 1024
"""Largest object read whole into host memory (a blob of zeros is tiny in git)."""
MAX_EXPORT_BYTES = 2 * 1024 * 1024 * 1024
"""Largest tree (sum of its blobs) exported to disk; zeros compress to nothing in git."""
ENV_REFUSED = ("GIT_COMMON_DIR", "GIT_OBJECT_DIRECTORY")
"""Variables that would make GitPython read another repository's refs or objects."""


def _env(extra_env: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GIT_") and k != "XDG_CONFIG_HOME"}
    env.update(FIXED_ENV)
    # The operator's own safe.directory entries are kept (command scope, which git honours
    # for that setting): CI runs as root on a checkout another uid owns, and its global
    # config says so. Nothing else of that config is read.
    pairs = [*COMMAND_CONFIG, *(("safe.directory", v) for v in _operator_safe_directories())]
    env["GIT_CONFIG_COUNT"] = str(len(pairs))
    for i, (key, value) in enumerate(pairs):
        env[f"GIT_CONFIG_KEY_{i}"] = key
        env[f"GIT_CONFIG_VALUE_{i}"] = value
    env.update(extra_env or {})
    return env


@functools.cache
def _operator_safe_directories() -> tuple[str, ...]:
    """``safe.directory`` values of the operator's global git config, read once."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_CONFIG_NOSYSTEM"] = "1"
    try:
        proc = subprocess.run(["git", "config", "--global", "--get-all", "safe.directory"],
                              env=env, capture_output=True, timeout=10, check=False,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    if proc.returncode != 0:
        return ()
    return tuple(v for v in os.fsdecode(proc.stdout).split("\n")[:256] if v and "\0" not in v)


EXPORT_LIMITS = untar.Limits(max_entries=MAX_TREE_ENTRIES, max_bytes=MAX_EXPORT_BYTES,
                             max_depth=4096, symlinks=True)
"""What an export writes at most: the tree walk's entries (git archive writes one per tree
entry), the export size bound (export-subst may grow a file past its blob), the depth
:func:`check_export` walks; committed symlinks are written as links."""


MAX_GIT_STDERR = 2000
"""Characters of git's stderr a failure message quotes (the rest is cut, marked)."""
MAX_ARCHIVE_TRAILER = 1024 * 1024
"""Bytes read after the tar end-of-archive marker (git pads to a 10 KiB record)."""


def git_failure(what: str, returncode: int, stderr: bytes) -> str:
    """``git WHAT failed (exit N | killed by SIGNAME): <stderr>`` with git's stderr
    escaped (one printable line, bounded) and a note when it printed nothing."""
    from runner.failures import one_line

    if returncode < 0:
        try:
            status = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            status = f"killed by signal {-returncode}"
    else:
        status = f"exit {returncode}"
    text = stderr.decode("utf-8", "replace").strip()
    shown = one_line(" / ".join(ln.strip() for ln in text.splitlines() if ln.strip()),
                     MAX_GIT_STDERR) if text else "(git printed nothing on stderr)"
    return f"git {what} failed ({status}): {shown}"


def _git(args: list[str], *, cwd: Path | None = None, git_dir: Path | None = None,
         input_bytes: bytes | None = None, check: bool = True,
         extra_env: dict[str, str] | None = None) -> bytes:
    cmd = ["git"]
    if git_dir is not None:
        cmd += ["--git-dir", str(git_dir)]
    cmd += args
    proc = subprocess.run(cmd, cwd=cwd, input=input_bytes, capture_output=True,
                          env=_env(extra_env), check=False)
    if check and proc.returncode != 0:
        _raise_if_environment(args, proc.stderr, cwd or git_dir)
        raise ConfigError(git_failure(" ".join(args[:3]), proc.returncode, proc.stderr),
                          path=str(cwd or git_dir or "."))
    return proc.stdout


def _raise_if_environment(args: list[str], stderr: bytes, where: Path | None) -> None:
    """EnvironmentFailure (exit 9) when git failed because the machine did (disk full,
    quota, I/O error, out of descriptors or memory), named with git's own line: that is
    not the operator's input, and no fix to the cycle file would help."""
    text = stderr.decode(errors="replace")
    reason = environment_reason(text)
    if reason is None:
        return
    line = next((ln.strip() for ln in text.splitlines() if reason in ln), reason)
    raise EnvironmentFailure(f"git {' '.join(args[:3])} failed in {where or '.'}: "
                             f"{one_line(line, 300)} (an environment failure: free disk "
                             "space or fix the device, then run again)")


# -- readers: GitPython over two batch processes per repository ------------------------------
class _ReadOnlyGit(git.Git):
    """GitPython's command runner reduced to the two ``cat-file`` batch readers, which it
    starts lazily through :meth:`_get_persistent_cmd`; here they run with :func:`_env`
    and ``--git-dir``, and any other git command GitPython might try is refused."""

    def __init__(self, working_dir: str | os.PathLike[str] | None = None) -> None:
        super().__init__(working_dir)
        self.reader_git_dir: str | None = None

    def _get_persistent_cmd(self, attr_name: str, cmd_name: str, *args: Any,
                            **kwargs: Any) -> git.Git.AutoInterrupt:
        current: git.Git.AutoInterrupt | None = getattr(self, attr_name)
        if current is not None:
            return current
        modes = {k for k, v in kwargs.items() if v}
        if (cmd_name != "cat_file" or args or self.reader_git_dir is None
                or modes not in ({"batch"}, {"batch_check"})):
            raise IntegrityError(f"gitops: unexpected git reader {cmd_name} {args} {kwargs}")
        argv = ["git", "--git-dir", self.reader_git_dir, "cat-file",
                "--batch-check" if modes == {"batch_check"} else "--batch"]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=_env(),
                                cwd=self.reader_git_dir)
        cmd = git.Git.AutoInterrupt(proc, argv)
        setattr(self, attr_name, cmd)
        return cmd

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        argv = args[0] if args and isinstance(args[0], list | tuple) else []
        if list(argv[:2]) == ["git", "rev-parse"]:  # a revision GitPython cannot parse
            raise _NeedsGit("this revision syntax (e.g. :/text, ^{/text}) is not read; "
                            "name a branch, tag or commit")
        raise IntegrityError(f"gitops: GitPython tried to run git itself ({args[:1]}); "
                             "reads go through the batch readers only")


class _NeedsGit(git.exc.GitError):
    """A revision only ``git rev-parse`` itself resolves: an unresolved ref, bad input."""


def _why(exc: BaseException) -> str:
    """``str(exc)``, which for some gitdb errors raises itself (a str where bytes were
    expected); then the exception's type name."""
    try:
        return str(exc)
    except Exception:  # any failure to describe is described by type
        return type(exc).__name__


class _Repo(git.Repo):
    GitCommandWrapperType = _ReadOnlyGit


_LOOKUP_ERRORS = (ValueError, KeyError, IndexError, TypeError, git.exc.ODBError,
                  git.exc.GitError)
"""What GitPython raises for a name that does not resolve or an object it cannot parse."""
_readers: OrderedDict[tuple[str, int, int], _Repo] = OrderedDict()
_readers_lock = threading.RLock()


def close_readers() -> None:
    """Stop every cached reader's git processes (at exit, and for tests)."""
    with _readers_lock:
        while _readers:
            _readers.popitem()[1].close()


atexit.register(close_readers)


def close_readers_under(root: Path) -> None:
    """Stop the cached readers of the repositories inside ``root`` (a run's own
    repositories, read by the stage that made them and then never again by this process);
    readers of other repositories stay cached."""
    base = os.path.abspath(root)
    with _readers_lock:
        for key in [k for k in _readers if k[0] == base or k[0].startswith(base + os.sep)]:
            _readers.pop(key).close()


def _open_reader(repo: Path) -> tuple[tuple[str, int, int], _Repo]:
    for name in ENV_REFUSED:
        if name in os.environ:
            raise ConfigError(f"{name} is set in the environment; it would redirect reads of "
                              f"{repo} to another repository", field=name,
                              fix=f"unset {name} (cyclebox names repositories by path)")
    try:
        st = os.stat(repo)
    except (OSError, ValueError):
        raise ConfigError(f"repository {repo} does not exist", field="project.repo",
                          fix="point project.repo at a git repository") from None
    key = (os.path.abspath(repo), st.st_dev, st.st_ino)
    found = _readers.get(key)
    if found is not None:
        _readers.move_to_end(key)
        return key, found
    # Opening is a few local file reads, held whole: GitPython's objects are not safe
    # against a KeyboardInterrupt halfway through their __init__ (a GitConfigParser cut
    # there fails again in its __del__, a traceback on the operator's terminal). A
    # first signal that came meanwhile unwinds right after.
    with interrupts.deferred():
        return _open_new_reader(repo, key)


def _open_new_reader(repo: Path, key: tuple[str, int, int]
                     ) -> tuple[tuple[str, int, int], _Repo]:
    try:
        r = _Repo(key[0], search_parent_directories=True)
    except (git.exc.InvalidGitRepositoryError, git.exc.NoSuchPathError, OSError,
            ValueError) as exc:
        raise ConfigError(f"{repo} is not a git repository ({type(exc).__name__})",
                          path=str(repo), fix="git init && git add -A && git commit -m base"
                          ) from None
    fmt = str(r.config_reader("repository").get_value("extensions", "objectformat", "sha1"))
    if fmt.lower() != "sha1":
        r.close()
        raise ConfigError(f"object format {fmt}: only sha1 repositories are read",
                          path=str(repo), fix="use a sha1 repository (git's default)")
    if not isinstance(r.git, _ReadOnlyGit):  # GitPython would start its own readers
        r.close()
        raise IntegrityError("gitops: GitPython ignored the read-only command wrapper")
    r.git.reader_git_dir = os.path.abspath(r.git_dir)
    _readers[key] = r
    while len(_readers) > READER_CACHE:
        _readers.popitem(last=False)[1].close()
    return key, r


@contextmanager
def _reading(repo: Path) -> Iterator[_Repo]:
    """The cached reader of ``repo``, held alone (the batch protocol is one request at a
    time). An exception escaping the block discards the reader: a read cut short could
    leave its process in the middle of an object."""
    with _readers_lock:
        key, r = _open_reader(repo)
        try:
            yield r
        except BaseException:
            _readers.pop(key, None)
            r.close()
            raise


def _check_rev(rev: str) -> str:
    if not rev or rev.startswith("-") or not rev.isprintable() or any(
            c.isspace() for c in rev):
        raise ValueError(f"{rev[:80]!r} is not a revision")
    return rev


class _TooBig(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"{size} bytes; at most {limit}")
        self.size, self.limit = size, limit


def _object(r: _Repo, binsha: bytes, kind: bytes, max_bytes: int = MAX_BLOB_BYTES) -> bytes:
    """An object's bytes, read whole (the batch stream stays in step), of type ``kind``;
    :class:`_TooBig` when it has more than ``max_bytes``, asked of ``--batch-check``
    first, so nothing of it is read (GitPython drains an abandoned stream in one read)."""
    size = r.odb.info(binsha).size
    if size > max_bytes:
        raise _TooBig(size, max_bytes)
    stream = r.odb.stream(binsha)
    data: bytes = stream.read()
    if stream.type != kind:
        raise ValueError(f"object {binsha.hex()} is a {stream.type!r}, not a {kind!r}")
    return data


def _tree_of(r: _Repo, rev: str) -> bytes:
    """Binary id of the tree that ``rev`` (a tree, commit or tag, any revision syntax
    GitPython resolves) names."""
    obj = r.rev_parse(_check_rev(rev))
    while isinstance(obj, git.TagObject):
        obj = obj.object
    if isinstance(obj, git.Commit):
        return bytes(obj.tree.binsha)
    if isinstance(obj, git.Tree):
        return bytes(obj.binsha)
    raise ValueError(f"{rev[:80]!r} names a {obj.type}, not a tree or commit")


def _entries(r: _Repo, tree: bytes) -> list[tuple[bytes, int, str]]:
    """(binary id, mode, name) of one tree's entries, names checked by GitPython's parser
    (no ``/``, ``..``, ``.git`` or its aliases)."""
    return [(bytes(sha), mode, name)
            for sha, mode, name in tree_entries_from_data(_object(r, tree, b"tree"))]


def _lookup(r: _Repo, tree: bytes, path: str) -> tuple[int, bytes] | None:
    """(mode, binary id) of ``path`` under ``tree``; None when absent."""
    mode, sha = stat.S_IFDIR, tree
    for part in path.split("/"):
        if not stat.S_ISDIR(mode):
            return None
        hit = [(m, s) for s, m, n in _entries(r, sha) if n == part]
        if not hit:
            return None
        mode, sha = hit[0]
    return mode, sha


def _walk(r: _Repo, tree: bytes, prefix: str = "") -> Iterator[tuple[str, int, bytes]]:
    """(path, mode, binary id) of every entry under ``tree``, trees included; iterative
    and capped at :data:`MAX_TREE_ENTRIES`."""
    stack, seen = [(prefix, tree)], 0
    while stack:
        base, sha = stack.pop()
        for child, mode, name in _entries(r, sha):
            seen += 1
            if seen > MAX_TREE_ENTRIES:
                raise IntegrityError(f"tree {tree.hex()} has more than {MAX_TREE_ENTRIES} "
                                     "entries (nested); refused")
            path = base + name
            yield path, mode, child
            if stat.S_ISDIR(mode):
                stack.append((path + "/", child))


def _is_file(mode: int) -> bool:
    """A blob entry: regular file or symlink (not a tree, not a submodule commit)."""
    return stat.S_ISREG(mode) or stat.S_ISLNK(mode)


def git_dir_of(repo: Path) -> Path:
    """The .git directory of a repository (work tree or bare), checked to exist."""
    if not repo.exists():
        raise ConfigError(f"repository {repo} does not exist", field="project.repo",
                          fix="point project.repo at a git repository")
    with _reading(repo) as r:
        return Path(os.path.abspath(r.git_dir))


def toplevel(repo: Path) -> Path | None:
    """The root of the work tree ``repo`` lies in; None outside any work tree (a bare
    repository or a ``.git`` directory)."""
    if _git(["rev-parse", "--is-inside-work-tree"], cwd=repo).decode().strip() != "true":
        return None
    return Path(_git(["rev-parse", "--show-toplevel"], cwd=repo).decode().strip())


_SHADOW_CONFIG = ("[core]\n\tbare = false\n\tfsmonitor = false\n"
                  "\tuntrackedCache = false\n\thooksPath = /dev/null\n")


RAW_ATTRIBUTES = ("* -text -eol -crlf -ident -filter -working-tree-encoding "
                  "-export-ignore -export-subst\n")
"""A repository's ``info/attributes`` (which outranks every ``.gitattributes``) that makes
git move the committed bytes as they are: no end-of-line conversion, ``$Id$`` expansion,
filter driver, re-encoding, or export rule. What runs, and what the apply container
commits, is then the tree's blobs exactly, whatever the tree's own attributes say."""


SHADOW_PREFIX = "cyclebox-git-"
"""Temporary git directories of :func:`_shadow`, named ``<prefix><pid>-<start>-*``."""


@contextmanager
def _shadow(repo: Path, *, head: bool = False) -> Iterator[tuple[Path, dict[str, str]]]:
    """A git directory of our own over ``repo``'s objects (and, with ``head``, its HEAD
    commit, index and info/exclude): (its path, the environment that points git at it).
    Without ``head`` (an export) its ``info/attributes`` is :data:`RAW_ATTRIBUTES`; with
    it (``git status``) the tree's own conversions stay, so a checkout reads as git does.

    The repository's own config, hooks and info/attributes are never read: they can name
    commands (``core.fsmonitor``, a filter's ``clean``/``smudge``/``process``, a diff
    driver) that ``git status`` and ``git archive`` would run on the host, selected by a
    committed ``.gitattributes``. Drivers named there are undefined here, so inert."""
    with _reading(repo) as r:
        common = Path(os.path.abspath(r.common_dir))
        own = Path(os.path.abspath(r.git_dir))
        try:
            commit = r.head.commit.hexsha if head and r.head.is_valid() else None
        except _LOOKUP_ERRORS:
            commit = None
    from runner.isolation.owner import current_owner

    me = current_owner()  # in the name, so `cyclebox gc` can remove it after a SIGKILL
    with tempfile.TemporaryDirectory(prefix=f"{SHADOW_PREFIX}{me.pid}-{me.start}-") as tmp:
        shadow = Path(tmp)
        for sub in ("refs", "objects", "info"):
            (shadow / sub).mkdir()
        (shadow / "config").write_text(_SHADOW_CONFIG)
        (shadow / "HEAD").write_text(f"{commit}\n" if commit else "ref: refs/heads/none\n")
        env = {"GIT_DIR": str(shadow), "GIT_OBJECT_DIRECTORY": str(common / "objects")}
        if not head:
            (shadow / "info" / "attributes").write_text(RAW_ATTRIBUTES)
        if head:
            exclude = common / "info" / "exclude"
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(exclude).st_mode):
                    shutil.copyfile(exclude, shadow / "info" / "exclude")
            if (own / "index").is_file():
                env["GIT_INDEX_FILE"] = str(own / "index")
        yield shadow, env


def uncommitted(repo: Path, subdir: str | None = None) -> list[tuple[str, str]]:
    """(status, path) of every uncommitted change under ``subdir`` of a work tree: staged,
    unstaged and untracked (ignored files left out). Empty outside a work tree.

    Read only: ``GIT_OPTIONAL_LOCKS=0`` keeps ``git status`` from refreshing the index,
    and it runs over :func:`_shadow` (none of the repository's configured commands)."""
    top = toplevel(repo)
    if top is None:
        return []
    with _shadow(repo, head=True) as (_, env):
        out = _git(["status", "--porcelain=v1", "-z", "--untracked-files=all",
                    "--no-renames", "--ignore-submodules=all", "--",
                    (subdir or ".").strip("/") or "."], cwd=repo,
                   extra_env={**env, "GIT_WORK_TREE": str(top), "GIT_OPTIONAL_LOCKS": "0"})
    rows = []
    for entry in out.split(b"\0"):
        if len(entry) > 3:
            rows.append((entry[:2].decode("ascii", "replace").strip(),
                         entry[3:].decode("utf-8", "backslashreplace")))
    return rows


def resolve_tree(repo: Path, ref: str, subdir: str | None = None) -> str:
    """The git tree id of ``ref`` (or of ``ref:subdir``)."""
    spec = f"{ref}^{{tree}}" if not subdir else f"{ref}:{subdir.strip('/')}"
    unresolved = ConfigError(f"ref {spec!r} does not resolve to a tree in {repo}",
                             field="project.base_ref", fix="use a branch, tag or commit id")
    with _reading(repo) as r:
        try:
            tree = _tree_of(r, ref)
            parts = [p for p in (subdir or "").split("/") if p not in ("", ".")]
            entry = _lookup(r, tree, "/".join(parts)) if parts else (stat.S_IFDIR, tree)
        except _LOOKUP_ERRORS:
            raise unresolved from None
    if entry is None:
        raise unresolved
    mode, sha = entry
    if not stat.S_ISDIR(mode):
        kind = "blob" if _is_file(mode) else "commit"
        raise ConfigError(f"{spec} is a {kind}, not a directory", field="project.subdir")
    return sha.hex()


def export_tree(repo: Path, tree: str, dest: Path) -> None:
    """Write the files of ``tree`` into a new directory ``dest`` (read-only use of repo).

    The files are the tree's blobs as committed: ``git archive`` runs under
    :data:`RAW_ATTRIBUTES`, so the tree's own ``.gitattributes`` (eol, ident, a filter,
    export-ignore, export-subst) change nothing. The export is then compared with the
    blobs all the same (:func:`check_export`): IntegrityError naming the first path that
    differs."""
    total = _tree_bytes(repo, tree)
    if total > MAX_EXPORT_BYTES:
        raise ConfigError(f"tree {tree[:12]} holds more than {MAX_EXPORT_BYTES} bytes of "
                          f"files ({total}); refused before export", path=str(repo),
                          fix="keep large data out of the agent's source tree (a store)")
    dest.mkdir(parents=True)
    # Streamed (the archive never sits in host memory whole) and written by directory
    # descriptor (runner.untar): a path that fits under /src but not under the longer
    # host directory is written like any other; nothing is written through a link.
    tree_id = head_tree(repo, tree)  # the shadow below has no refs
    refused: untar.UntarError | None = None
    dfd = os.open(dest, fswalk.DIR_FLAGS)
    try:
        with tempfile.TemporaryFile() as errf, _shadow(repo) as (shadow, env):
            proc = subprocess.Popen(["git", "archive", "--format=tar", tree_id], cwd=shadow,
                                    env=_env(env), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=errf)
            assert proc.stdout is not None  # noqa: S101 - stdout=PIPE above
            trailer = 0
            try:
                untar.extract(proc.stdout, dfd, EXPORT_LIMITS)
                # The extractor stops at the end-of-archive marker; git may still be
                # writing the padding of its last 10 KiB record. Closing the pipe before
                # it has would kill git with SIGPIPE, an archive that was whole reported
                # as a failure with an empty message. Read to the end (bounded) instead.
                while trailer <= MAX_ARCHIVE_TRAILER and (chunk := proc.stdout.read(65536)):
                    trailer += len(chunk)
            except untar.UntarError as exc:
                refused = exc  # git is cut off (SIGPIPE): the refusal is the news
            finally:
                proc.stdout.close()
                proc.wait()
            errf.seek(0)
            err = errf.read(64 * 1024)
    finally:
        os.close(dfd)
    if trailer > MAX_ARCHIVE_TRAILER:
        raise IntegrityError(f"git archive {tree[:12]} wrote more than "
                             f"{MAX_ARCHIVE_TRAILER} bytes after the end of the archive")
    if proc.returncode != 0 and (refused is None or proc.returncode != -signal.SIGPIPE):
        _raise_if_environment(["archive", tree[:12]], err, repo)
        raise ConfigError(git_failure(f"archive {tree[:12]}", proc.returncode, err),
                          path=str(repo))
    if refused is not None:
        raise IntegrityError(f"export of tree {tree} to {dest} refused: {refused} (an entry "
                             "git archive wrote that the export does not write)")
    problems = check_export(repo, tree, dest)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more"
                                           if len(problems) > 5 else "")
        raise IntegrityError(f"export of tree {tree} to {dest} differs from its committed "
                             f"blobs: {shown} (a .gitattributes export-ignore/export-subst/"
                             "ident/eol rule changes what would run)")


def _tree_bytes(repo: Path, tree: str) -> int:
    """Sum of the sizes of ``tree``'s blobs (``--batch-check``: nothing is read)."""
    entries = [sha for _, mode, sha in _walked(repo, tree) if _is_file(mode)]
    with _reading(repo) as r:
        try:
            return sum(int(r.odb.info(sha).size) for sha in entries)
        except _LOOKUP_ERRORS as exc:
            raise ConfigError(f"cannot size tree {tree[:80]!r}: {_why(exc)}", path=str(repo)
                              ) from None


def _blob_id(data: bytes, algo: str) -> str:
    h = hashlib.new(algo)
    h.update(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


def _entry_blob_id(e: fswalk.Entry, algo: str) -> str:
    """:func:`_blob_id` of a walked regular file, opened relative to its directory."""
    with os.fdopen(e.open(), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h = hashlib.new(algo)
        h.update(b"blob %d\0" % size)
        got = 0
        while chunk := f.read(1 << 20):
            got += len(chunk)
            h.update(chunk)
    return h.hexdigest() if got == size else ""


def check_export(repo: Path, tree: str, dest: Path) -> list[str]:
    """Paths where the files under ``dest`` differ from ``tree``'s blobs (both directions),
    or are exported with another mode (executable or not, a symlink or a file).

    Regular files are hashed as git blobs, symlinks by their target; nothing is followed."""
    want = {path: (f"{mode:06o}", sha.hex()) for path, mode, sha in _walked(repo, tree)
            if _is_file(mode)}
    algo = "sha256" if any(len(oid) == 64 for _, oid in want.values()) else "sha1"
    got: dict[str, tuple[str, str]] = {}
    walk_problems: list[str] = []
    try:  # by directory descriptor: no path is too long, no directory skipped silently
        for e in fswalk.walk(dest, max_depth=4096):
            if e.is_link:
                got[e.rel] = ("120000", _blob_id(os.fsencode(e.readlink()), algo))
            elif e.is_file:
                got[e.rel] = ("100755" if e.st.st_mode & 0o111 else "100644",
                              _entry_blob_id(e, algo))
            elif not e.is_dir:
                got[e.rel] = ("other", "")
    except fswalk.WalkError as exc:
        walk_problems.append(f"{exc} (the export could not be checked in full)")
    problems = [f"{p}: missing from the export" for p in sorted(set(want) - set(got))]
    problems += [f"{p}: in the export but not in the tree" for p in sorted(set(got) - set(want))]
    problems += [f"{p}: exported content differs from the committed blob"
                 for p in sorted(set(want) & set(got)) if want[p][1] != got[p][1]]
    problems += [f"{p}: exported as mode {got[p][0]}, committed as {want[p][0]}"
                 for p in sorted(set(want) & set(got))
                 if want[p][1] == got[p][1] and want[p][0] != got[p][0]]
    return walk_problems + problems


def read_blob(repo: Path, tree: str, path: str, *,
              max_bytes: int = MAX_BLOB_BYTES) -> bytes | None:
    """Bytes of ``path`` in ``tree`` (any tree-ish), or None when absent (or not a file);
    ConfigError naming it when it has more than ``max_bytes`` (nothing of it is read)."""
    try:
        with _reading(repo) as r:
            try:
                entry = _lookup(r, _tree_of(r, tree), path)
                if entry is None or not _is_file(entry[0]):
                    return None
                return _object(r, entry[1], b"blob", max_bytes)
            except _LOOKUP_ERRORS:
                return None
    except _TooBig as exc:
        raise ConfigError(f"{path!r} in tree {tree[:12]} has {exc.size} bytes; at most "
                          f"{exc.limit} are read", path=str(repo),
                          fix="keep the file small, or out of the files cyclebox reads"
                          ) from None


def _walked(repo: Path, tree: str) -> list[tuple[str, int, bytes]]:
    with _reading(repo) as r:
        try:
            return list(_walk(r, _tree_of(r, tree)))
        except _LOOKUP_ERRORS as exc:
            raise ConfigError(f"cannot list tree {tree[:80]!r}: {_why(exc)}", path=str(repo)
                              ) from None


def find_blob(repo: Path, tree: str, data: bytes) -> str | None:
    """The first path of ``tree`` whose file holds exactly ``data`` (compared by blob id,
    nothing read); None when no file does."""
    want = {_blob_id(data, "sha1"), _blob_id(data, "sha256")}
    return next((path for path, mode, sha in _walked(repo, tree)
                 if _is_file(mode) and sha.hex() in want), None)


def past_path_max(repo: Path, tree: str, target: str) -> tuple[str, int] | None:
    """The first path of ``tree`` (files and directories, in tree order) that would be
    ``PATH_MAX`` bytes or longer once the tree is mounted at ``target``, with that length;
    None when every path fits (no program in the container could open such a one)."""
    base = len(os.fsencode(target.rstrip("/"))) + 1
    for path, _, _ in _walked(repo, tree):
        inside = base + len(os.fsencode(path))
        if inside >= fswalk.PATH_MAX:
            return path, inside
    return None


def unexportable(repo: Path, tree: str, target: str) -> tuple[str, str] | None:
    """The first path of ``tree`` (in tree order) that could not be used once the tree is
    exported and mounted at ``target``, with why: ``PATH_MAX`` bytes or longer there (no
    program in the container could open it), or a name the export refuses
    (:func:`runner.untar.name_problem`, e.g. a control character); None when all can."""
    base = len(os.fsencode(target.rstrip("/"))) + 1
    for path, _, _ in _walked(repo, tree):
        inside = base + len(os.fsencode(path))
        if inside >= fswalk.PATH_MAX:
            return path, (f"path of {inside} bytes once mounted at {target}, past PATH_MAX "
                          f"({fswalk.PATH_MAX}); no program in the container could open it")
        problem = untar.name_problem(path)
        if problem is not None:
            return path, f"{problem} by the export"
    return None


def tree_modes(repo: Path, tree: str) -> dict[str, str]:
    """path -> git mode for every entry (recursive, trees too), e.g. 120000 for symlinks."""
    return {path: f"{mode:06o}" for path, mode, _ in _walked(repo, tree)}


def throwaway_repo(source_repo: Path, tree: str, dest: Path) -> str:
    """A new repository at ``dest`` whose first commit has exactly ``tree``; returns it.

    The operator's repository is only read (``git archive``). Its ``info/attributes`` is
    :data:`RAW_ATTRIBUTES`, so ``git add`` here (and the apply container's, which works in
    this repository) stores a file's bytes as they are: a CRLF file under ``text=auto`` or
    a ``$Id$`` under ``ident`` is the proposal's, not git's conversion of it.
    IntegrityError when the re-created tree differs from the frozen one.
    """
    export_tree(source_repo, tree, dest)
    _git(["init", "-q", "--template=", "-b", "cyclebox/base"], cwd=dest)
    info = dest / ".git" / "info"
    info.mkdir()
    fd = os.open(info / "attributes", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(RAW_ATTRIBUTES)
    _git(["add", "-A", "-f"], cwd=dest)
    # A submodule is an entry (a commit id), not files: git archive writes an empty
    # directory for it, which git add skips. Put the entries back as the tree has them.
    links = [f"160000 {sha.hex()}\t{path}" for path, mode, sha in _walked(source_repo, tree)
             if mode == 0o160000]
    if links:
        _git(["update-index", "-z", "--index-info"], cwd=dest,
             input_bytes="\0".join(links).encode("utf-8", "surrogateescape") + b"\0")
    _git(["commit", "-q", "--no-verify", "--allow-empty", "-m", f"base tree {tree}"], cwd=dest)
    got = head_tree(dest)
    if got != tree:
        raise IntegrityError(f"throwaway repository tree {got} differs from the frozen base "
                             f"tree {tree}")
    return _git(["rev-parse", "HEAD"], cwd=dest).decode().strip()


def head_tree(repo: Path, ref: str = "HEAD") -> str:
    """The tree id of ``ref``; ConfigError when it names no tree or commit."""
    with _reading(repo) as r:
        try:
            return _tree_of(r, ref).hex()
        except _LOOKUP_ERRORS as exc:
            raise ConfigError(f"{ref[:80]!r} does not resolve to a tree ({_why(exc)})",
                              path=str(repo)) from None


def rev(repo: Path, ref: str) -> str:
    """The object id ``ref`` names (a tag object for an annotated tag, as git does)."""
    with _reading(repo) as r:
        try:
            return str(r.rev_parse(_check_rev(ref)).hexsha)
        except _LOOKUP_ERRORS as exc:
            raise ConfigError(f"{ref[:80]!r} does not resolve ({_why(exc)})", path=str(repo)
                              ) from None


def changed_paths(repo: Path, a: str, b: str) -> list[str]:
    """Every file path whose entry differs between the trees of ``a`` and ``b``: added,
    removed, or changed in content, mode or type. No rename detection: a rename lists
    both paths, so a deletion cannot hide behind an addition of the same content."""
    with _reading(repo) as r:
        try:
            return sorted(_tree_diff(r, _tree_of(r, a), _tree_of(r, b)))
        except _LOOKUP_ERRORS as exc:
            raise ConfigError(f"cannot compare {a[:80]!r} with {b[:80]!r}: {_why(exc)}",
                              path=str(repo)) from None


def _tree_diff(r: _Repo, a: bytes, b: bytes) -> set[str]:
    out: set[str] = set()
    stack = [("", a, b)]
    while stack:
        base, ta, tb = stack.pop()
        ea = {n: (m, s) for s, m, n in _entries(r, ta)}
        eb = {n: (m, s) for s, m, n in _entries(r, tb)}
        for name in ea.keys() | eb.keys():
            x, y = ea.get(name), eb.get(name)
            if x == y:
                continue
            path = base + name
            x_dir = x is not None and stat.S_ISDIR(x[0])
            y_dir = y is not None and stat.S_ISDIR(y[0])
            if x is not None and y is not None and x_dir and y_dir:
                stack.append((path + "/", x[1], y[1]))
                continue
            for side, is_dir in ((x, x_dir), (y, y_dir)):
                if side is None:
                    continue
                if is_dir:
                    out |= {p for p, m, _ in _walk(r, side[1], path + "/")
                            if not stat.S_ISDIR(m)}
                else:
                    out.add(path)
        if len(out) > MAX_TREE_ENTRIES:
            raise IntegrityError(f"more than {MAX_TREE_ENTRIES} changed paths; refused")
    return out


def diff(repo: Path, a: str, b: str) -> bytes:
    return _git(["diff", "--binary", "--no-color", "--no-ext-diff", a, b], cwd=repo)


def init_fixed(repo: Path, message: str) -> str:
    """git init + commit everything in ``repo`` with the fixed identity; returns the commit."""
    _git(["init", "-q", "-b", "main"], cwd=repo)
    _git(["add", "-A"], cwd=repo)
    _git(["commit", "-q", "--no-verify", "-m", message], cwd=repo)
    return rev(repo, "HEAD")


_FILE_MODES = frozenset({b"100644", b"100755"})


def commit_files(git_dir: Path, base: str, files: Sequence[tuple[str, bytes]], message: str,
                 *, branch: str, env: dict[str, str]) -> str:
    """Commit ``files`` (path, exact bytes) on top of ``base`` in the host's own bare
    repository ``git_dir``, with git's plumbing and a private index: blobs as given (no
    filter, no line-ending conversion), a file's mode kept from ``base`` (100644 for a
    new one), the message cleaned as ``git commit -m`` cleans it, and ``env`` (identity
    and dates) for the commit. Points ``branch`` at it and returns its id.

    This is the commit the apply container makes from the same proposal, built without
    reading anything the container wrote. ConfigError (git's stderr named) or
    IntegrityError when a path is not a plain file in ``base`` (a link, a submodule or a
    directory) or cannot be placed."""
    index = git_dir / "cyclebox-candidate.index"
    idx_env = {**env, "GIT_INDEX_FILE": str(index)}
    index.unlink(missing_ok=True)
    try:
        _git(["read-tree", base], git_dir=git_dir, extra_env=idx_env)
        paths = [p for p, _ in files]
        listed = _git(["ls-tree", "-z", "--full-tree", base, "--", *paths], git_dir=git_dir)
        modes: dict[str, bytes] = {}
        for entry in listed.split(b"\0"):
            if entry:
                meta, _, name = entry.partition(b"\t")
                modes[os.fsdecode(name)] = meta.split(b" ", 1)[0]
        for path, data in files:
            mode = modes.get(path, b"100644")
            if mode not in _FILE_MODES:
                raise IntegrityError(f"{path!r} is not a plain file in the base (mode "
                                     f"{mode.decode(errors='replace')}); it is not replaced")
            blob = _git(["hash-object", "-w", "--no-filters", "--stdin"], git_dir=git_dir,
                        input_bytes=data).decode().strip()
            _git(["update-index", "--add", "--cacheinfo", f"{mode.decode()},{blob},{path}"],
                 git_dir=git_dir, extra_env=idx_env)
        tree = _git(["write-tree"], git_dir=git_dir, extra_env=idx_env).decode().strip()
        text = _git(["stripspace"], input_bytes=message.encode("utf-8"))
        commit = _git(["commit-tree", tree, "-p", base, "-F", "-"], git_dir=git_dir,
                      input_bytes=text, extra_env=env).decode().strip()
        _git(["update-ref", f"refs/heads/{branch}", commit], git_dir=git_dir)
        return commit
    finally:
        index.unlink(missing_ok=True)


def clone_bare_untrusted(src: Path, dest: Path, *, branch: str) -> None:
    """Bare-clone a repository written by a container, without trusting its config.

    ``--no-local`` goes through the pack protocol, so the source's config, hooks and
    attributes are data, not instructions, to this process.
    """
    # The source belongs to the role's uid, so git's ownership check needs a
    # safe.directory entry; -c does not reach the spawned upload-pack (git clears
    # it for another repository), a private global config file does. It lives beside
    # ``dest`` (in the run directory, never /tmp), so even a SIGKILL leaves it where
    # the run's evidence is, not as a stray temporary file.
    cfg = dest.parent / f".{dest.name}.gitconfig"
    fd = os.open(cfg, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"[safe]\n\tdirectory = {src}/.git\n\tdirectory = {src}\n")
        _git(["-c", "protocol.file.allow=always", "clone", "-q", "--bare", "--no-local",
              "--no-hardlinks", "--single-branch", "--branch", branch, f"file://{src}",
              str(dest)], extra_env={"GIT_CONFIG_GLOBAL": str(cfg)})
    finally:
        cfg.unlink(missing_ok=True)
