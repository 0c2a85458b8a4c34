"""Every git invocation of the controller; the only module that runs git on the host.

The operator's repository is only ever *read* (rev-parse, archive, cat-file, and status
with optional locks off); all writing happens in throwaway repositories cyclebox creates
itself. Commits made
here use a fixed identity and fixed dates so that a replayed cycle reproduces the
same commit and patch ids.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import subprocess
import tarfile
from pathlib import Path

from runner.errors import ConfigError, IntegrityError

FIXED_ENV = {
    "GIT_AUTHOR_NAME": "cyclebox", "GIT_AUTHOR_EMAIL": "cyclebox@localhost",
    "GIT_COMMITTER_NAME": "cyclebox", "GIT_COMMITTER_EMAIL": "cyclebox@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
}


def _git(args: list[str], *, cwd: Path | None = None, git_dir: Path | None = None,
         input_bytes: bytes | None = None, check: bool = True,
         extra_env: dict[str, str] | None = None) -> bytes:
    cmd = ["git"]
    if git_dir is not None:
        cmd += ["--git-dir", str(git_dir)]
    cmd += args
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(FIXED_ENV)
    env["HOME"] = env.get("HOME", "/nonexistent")
    env.update(extra_env or {})
    proc = subprocess.run(cmd, cwd=cwd, input=input_bytes, capture_output=True, env=env,
                          check=False)
    if check and proc.returncode != 0:
        raise ConfigError(f"git {' '.join(args[:3])} failed: "
                          f"{proc.stderr.decode(errors='replace').strip()}",
                          path=str(cwd or git_dir or "."))
    return proc.stdout


def git_dir_of(repo: Path) -> Path:
    """The .git directory of a repository (work tree or bare), checked to exist."""
    if not repo.exists():
        raise ConfigError(f"repository {repo} does not exist", field="project.repo",
                          fix="point project.repo at a git repository")
    out = _git(["rev-parse", "--absolute-git-dir"], cwd=repo)
    return Path(out.decode().strip())


def toplevel(repo: Path) -> Path | None:
    """The root of the work tree ``repo`` lies in; None outside any work tree (a bare
    repository or a ``.git`` directory)."""
    if _git(["rev-parse", "--is-inside-work-tree"], cwd=repo).decode().strip() != "true":
        return None
    return Path(_git(["rev-parse", "--show-toplevel"], cwd=repo).decode().strip())


def uncommitted(repo: Path, subdir: str | None = None) -> list[tuple[str, str]]:
    """(status, path) of every uncommitted change under ``subdir`` of a work tree: staged,
    unstaged and untracked (ignored files left out). Empty outside a work tree.

    Read only: ``GIT_OPTIONAL_LOCKS=0`` keeps ``git status`` from refreshing the index."""
    if toplevel(repo) is None:
        return []
    out = _git(["status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames",
                "--", (subdir or ".").strip("/") or "."], cwd=repo,
               extra_env={"GIT_OPTIONAL_LOCKS": "0"})
    rows = []
    for entry in out.split(b"\0"):
        if len(entry) > 3:
            rows.append((entry[:2].decode("ascii", "replace").strip(),
                         entry[3:].decode("utf-8", "backslashreplace")))
    return rows


def resolve_tree(repo: Path, ref: str, subdir: str | None = None) -> str:
    """The git tree id of ``ref`` (or of ``ref:subdir``)."""
    spec = f"{ref}^{{tree}}" if not subdir else f"{ref}:{subdir.strip('/')}"
    try:
        out = _git(["rev-parse", "--verify", "--quiet", spec], cwd=repo)
    except ConfigError:
        raise ConfigError(f"ref {spec!r} does not resolve to a tree in {repo}",
                          field="project.base_ref", fix="use a branch, tag or commit id") from None
    tree = out.decode().strip()
    kind = _git(["cat-file", "-t", tree], cwd=repo).decode().strip()
    if kind != "tree":
        raise ConfigError(f"{spec} is a {kind}, not a directory", field="project.subdir")
    return tree


def export_tree(repo: Path, tree: str, dest: Path) -> None:
    """Write the files of ``tree`` into a new directory ``dest`` (read-only use of repo).

    The export is then compared with the tree's blobs (:func:`check_export`), because
    ``git archive`` applies the tree's own ``.gitattributes`` (export-ignore, export-subst,
    ident, eol): IntegrityError naming the first path that differs."""
    data = _git(["archive", "--format=tar", tree], cwd=repo)
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="tar")
    problems = check_export(repo, tree, dest)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more"
                                           if len(problems) > 5 else "")
        raise IntegrityError(f"export of tree {tree} to {dest} differs from its committed "
                             f"blobs: {shown} (a .gitattributes export-ignore/export-subst/"
                             "ident/eol rule changes what would run)")


def _blob_id(data: bytes, algo: str) -> str:
    h = hashlib.new(algo)
    h.update(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


def check_export(repo: Path, tree: str, dest: Path) -> list[str]:
    """Paths where the files under ``dest`` differ from ``tree``'s blobs (both directions).

    Regular files are hashed as git blobs, symlinks by their target; nothing is followed."""
    out = _git(["ls-tree", "-r", "-z", "--full-tree", tree], cwd=repo)
    want: dict[str, tuple[str, str]] = {}
    for entry in out.split(b"\0"):
        if entry:
            meta, path = entry.split(b"\t", 1)
            mode, kind, oid = meta.decode().split()
            if kind == "blob":
                want[path.decode("utf-8", "surrogateescape")] = (mode, oid)
    algo = "sha256" if any(len(oid) == 64 for _, oid in want.values()) else "sha1"
    got: dict[str, tuple[str, str]] = {}
    for dirpath, dirnames, filenames in os.walk(dest, followlinks=False):
        for name in [*filenames, *[d for d in dirnames if os.path.islink(
                os.path.join(dirpath, d))]]:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, dest).replace(os.sep, "/")
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                got[rel] = ("120000", _blob_id(os.fsencode(os.readlink(p)), algo))
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    got[rel] = ("100755" if st.st_mode & 0o111 else "100644",
                                _blob_id(f.read(), algo))
            else:
                got[rel] = ("other", "")
    problems = [f"{p}: missing from the export" for p in sorted(set(want) - set(got))]
    problems += [f"{p}: in the export but not in the tree" for p in sorted(set(got) - set(want))]
    problems += [f"{p}: exported content differs from the committed blob"
                 for p in sorted(set(want) & set(got)) if want[p][1] != got[p][1]]
    return problems


def read_blob(repo: Path, tree: str, path: str) -> bytes | None:
    """Bytes of ``path`` in ``tree``, or None when absent (or not a file)."""
    try:
        return _git(["cat-file", "blob", f"{tree}:{path}"], cwd=repo)
    except ConfigError:
        return None


def tree_modes(repo: Path, tree: str) -> dict[str, str]:
    """path -> git mode for every entry (recursive), e.g. 120000 for symlinks."""
    out = _git(["ls-tree", "-r", "-t", "-z", tree], cwd=repo)
    modes = {}
    for entry in out.split(b"\0"):
        if not entry:
            continue
        meta, path = entry.split(b"\t", 1)
        modes[path.decode()] = meta.split()[0].decode()
    return modes


def throwaway_repo(source_repo: Path, tree: str, dest: Path) -> str:
    """A new repository at ``dest`` whose first commit has exactly ``tree``; returns it.

    The operator's repository is only read (``git archive``). IntegrityError when the
    re-created tree differs from the frozen one (e.g. export-ignore attributes).
    """
    export_tree(source_repo, tree, dest)
    _git(["init", "-q", "-b", "cyclebox/base"], cwd=dest)
    _git(["add", "-A", "-f"], cwd=dest)
    _git(["commit", "-q", "--no-verify", "--allow-empty", "-m", f"base tree {tree}"], cwd=dest)
    got = head_tree(dest)
    if got != tree:
        raise IntegrityError(f"throwaway repository tree {got} differs from the frozen base "
                             f"tree {tree}; check .gitattributes export-ignore/subst rules")
    return _git(["rev-parse", "HEAD"], cwd=dest).decode().strip()


def head_tree(repo: Path, ref: str = "HEAD") -> str:
    return _git(["rev-parse", f"{ref}^{{tree}}"], cwd=repo).decode().strip()


def rev(repo: Path, ref: str) -> str:
    return _git(["rev-parse", ref], cwd=repo).decode().strip()


def changed_paths(repo: Path, a: str, b: str) -> list[str]:
    out = _git(["diff", "--name-only", "-z", a, b], cwd=repo)
    return sorted(p.decode() for p in out.split(b"\0") if p)


def diff(repo: Path, a: str, b: str) -> bytes:
    return _git(["diff", "--binary", "--no-color", "--no-ext-diff", a, b], cwd=repo)


def init_fixed(repo: Path, message: str) -> str:
    """git init + commit everything in ``repo`` with the fixed identity; returns the commit."""
    _git(["init", "-q", "-b", "main"], cwd=repo)
    _git(["add", "-A"], cwd=repo)
    _git(["commit", "-q", "--no-verify", "-m", message], cwd=repo)
    return rev(repo, "HEAD")


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


def commit_tree(git_dir: Path, commit: str) -> str:
    """The tree id of ``commit`` in the bare repository ``git_dir``, read from the commit
    object itself and checked: the object's bytes must hash to ``commit`` (sha1 or sha256
    by its length), so an edited commit object cannot name another tree. IntegrityError
    when it does not; ConfigError when git cannot read it."""
    if len(commit) not in (40, 64) or any(c not in "0123456789abcdef" for c in commit):
        raise IntegrityError(f"{commit[:80]!r} is not a git object id")
    body = _git(["cat-file", "commit", commit], git_dir=git_dir)
    algo = hashlib.sha1 if len(commit) == 40 else hashlib.sha256
    if algo(b"commit %d\0" % len(body) + body).hexdigest() != commit:
        raise IntegrityError(f"commit {commit} does not hash to its id (edited object)")
    first = body.split(b"\n", 1)[0]
    if not first.startswith(b"tree "):
        raise IntegrityError(f"commit {commit} names no tree")
    return first[5:].decode("ascii", "replace").strip()
