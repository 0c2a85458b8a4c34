"""runner.gitops reads through GitPython agree with the git CLI on a real repository, run
two reader processes per repository whatever the number of reads, and ignore what the
host environment or the repository could use to redirect them (real git, no Docker)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner import gitops
from runner.errors import ConfigError

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}


def git(repo: Path, *args: str, data: bytes | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")} | GIT_ENV
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          env=env, input=data).stdout.decode("utf-8", "surrogateescape")


def commit(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--allow-empty", "-m", message)
    return git(repo, "rev-parse", "HEAD").strip()


@pytest.fixture(autouse=True)
def _fresh_readers() -> Iterator[None]:
    gitops.close_readers()
    yield
    gitops.close_readers()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """Three commits covering files, an executable, a symlink, nesting, a submodule
    entry, a deletion, a mode change, a file that becomes a directory, and tags."""
    root = tmp_path / "repo"
    (root / "a" / "b").mkdir(parents=True)
    (root / "README.md").write_text("# r\n")
    (root / "a" / "b" / "deep.txt").write_text("deep\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "gone.txt").write_text("to be removed\n")
    (root / "becomes").write_text("a file first\n")
    os.symlink("a/b", root / "link")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "update-index", "--add", "--cacheinfo",
        f"160000,{'1' * 40},vendor/sub")  # a submodule (gitlink) entry
    git(root, "commit", "-q", "-m", "one")
    git(root, "tag", "-a", "-m", "annotated", "v1")
    (root / "README.md").write_text("# r, edited\n")
    os.chmod(root / "run.sh", 0o755)
    (root / "gone.txt").unlink()
    (root / "becomes").unlink()
    (root / "becomes").mkdir()
    (root / "becomes" / "inner.txt").write_text("now a directory\n")
    commit(root, "two")
    (root / "a" / "b" / "new.txt").write_text("new\n")
    commit(root, "three")
    return root


def _cli_modes(repo: Path, rev: str) -> dict[str, str]:
    out = git(repo, "ls-tree", "-r", "-t", "-z", rev)
    return {e.split("\t", 1)[1]: e.split()[0] for e in out.split("\0") if e}


REVS = ["main", "HEAD", "HEAD~1", "HEAD~2", "v1", "main^", "v1^{commit}"]


@pytest.mark.parametrize("rev", REVS)
def test_trees_and_modes_agree_with_git(repo: Path, rev: str) -> None:
    want = git(repo, "rev-parse", f"{rev}^{{tree}}").strip()
    assert gitops.resolve_tree(repo, rev) == want
    assert gitops.head_tree(repo, rev) == want
    assert gitops.tree_modes(repo, rev) == _cli_modes(repo, rev)
    assert gitops.rev(repo, rev) == git(repo, "rev-parse", rev).strip()


def test_short_ids_subdirectories_and_their_errors(repo: Path) -> None:
    short = git(repo, "rev-parse", "--short", "HEAD").strip()
    assert gitops.resolve_tree(repo, short) == git(repo, "rev-parse", "HEAD^{tree}").strip()
    assert gitops.resolve_tree(repo, "main", "a/b/") == git(repo, "rev-parse",
                                                             "main:a/b").strip()
    assert gitops.resolve_tree(repo, "main", ".") == gitops.resolve_tree(repo, "main")
    with pytest.raises(ConfigError, match=r"project\.subdir: main:README\.md is a blob"):
        gitops.resolve_tree(repo, "main", "README.md")
    with pytest.raises(ConfigError, match=r"project\.subdir: v1:vendor/sub is a commit"):
        gitops.resolve_tree(repo, "v1", "vendor/sub")
    for bad in ("nope", "main:README.md", "HEAD~9", "main\nHEAD", "-h", ""):
        with pytest.raises(ConfigError, match=r"project\.base_ref: .*does not resolve"):
            gitops.resolve_tree(repo, bad)
    # the reader is still in step after every refusal
    assert gitops.rev(repo, "HEAD") == git(repo, "rev-parse", "HEAD").strip()


def test_blobs_agree_with_git(repo: Path) -> None:
    tree = gitops.resolve_tree(repo, "HEAD~2")
    for path, mode in _cli_modes(repo, tree).items():
        got = gitops.read_blob(repo, tree, path)
        if mode in ("100644", "100755", "120000"):
            raw = subprocess.run(["git", "-C", str(repo), "cat-file", "blob",
                                  f"{tree}:{path}"], check=True, capture_output=True).stdout
            assert got == raw, path
        else:
            assert got is None, path  # trees and submodule commits are not files
    assert gitops.read_blob(repo, tree, "link") == b"a/b"  # the link target, not followed
    assert gitops.read_blob(repo, "HEAD", "gone.txt") is None
    assert gitops.read_blob(repo, "HEAD~2", "gone.txt") == b"to be removed\n"
    assert gitops.read_blob(repo, "v1", "README.md") == b"# r\n"  # a tag peels to its tree
    assert gitops.read_blob(repo, "no-such-ref", "README.md") is None
    assert gitops.read_blob(repo, "HEAD", "README.md/x") is None


@pytest.mark.parametrize(("a", "b"), [("HEAD~2", "HEAD~1"), ("HEAD~1", "HEAD"),
                                      ("HEAD~2", "HEAD"), ("HEAD", "HEAD~2"),
                                      ("HEAD", "HEAD")])
def test_changed_paths_agree_with_git_without_renames(repo: Path, a: str, b: str) -> None:
    want = sorted(p for p in git(repo, "diff", "--name-only", "--no-renames", "-z",
                                 a, b).split("\0") if p)
    assert gitops.changed_paths(repo, a, b) == want


def test_a_rename_lists_both_paths(repo: Path) -> None:
    git(repo, "mv", "README.md", "a/renamed.md")
    commit(repo, "rename")
    # git's own default (diff.renames) would print only a/renamed.md, hiding a deletion
    assert git(repo, "diff", "--name-only", "HEAD~1", "HEAD").split() == ["a/renamed.md"]
    assert gitops.changed_paths(repo, "HEAD~1", "HEAD") == ["README.md", "a/renamed.md"]


def test_many_reads_share_two_reader_processes(repo: Path) -> None:
    tree = gitops.resolve_tree(repo, "HEAD")
    for _ in range(50):
        assert gitops.read_blob(repo, tree, "a/b/deep.txt") == b"deep\n"
    gitops.tree_modes(repo, tree)
    gitops.changed_paths(repo, "HEAD~2", "HEAD")
    (reader,) = gitops._readers.values()
    procs = [reader.git.cat_file_all, reader.git.cat_file_header]
    assert all(p is not None and p.proc is not None and p.proc.poll() is None for p in procs)
    # started by gitops with --git-dir and the scrubbed environment, not by GitPython
    assert sorted(p.args[-1] for p in procs if p is not None) == ["--batch", "--batch-check"]
    assert all(p.args[1:3] == ["--git-dir", str(repo / ".git")] for p in procs if p)
    pids = [p.proc.pid for p in procs if p and p.proc]
    gitops.read_blob(repo, tree, "README.md")
    assert [p.proc.pid for p in procs if p and p.proc] == pids
    gitops.close_readers()
    assert all(p.proc is None for p in procs if p)


def test_gitpython_may_run_no_other_git_command(repo: Path) -> None:
    gitops.resolve_tree(repo, "HEAD")
    (reader,) = gitops._readers.values()
    with pytest.raises(gitops.IntegrityError, match="GitPython tried to run git"):
        reader.git.status()


def test_host_environment_cannot_redirect_reads(repo: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "README.md").write_text("other\n")
    git(other, "init", "-q", "-b", "main")
    commit(other, "other")
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(other))
    monkeypatch.setenv("GIT_CONFIG_PARAMETERS", "'core.bogus'")  # would break git itself
    assert gitops.read_blob(repo, "HEAD", "README.md") == b"# r, edited\n"
    assert gitops.resolve_tree(repo, "HEAD") == git(repo, "rev-parse", "HEAD^{tree}").strip()
    monkeypatch.setenv("GIT_COMMON_DIR", str(other / ".git"))
    gitops.close_readers()
    with pytest.raises(ConfigError, match="GIT_COMMON_DIR: GIT_COMMON_DIR is set"):
        gitops.resolve_tree(repo, "HEAD")


@pytest.mark.parametrize("where", ["home", "xdg"])
def test_the_operators_own_git_config_runs_no_driver_on_the_host(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """`git lfs install` writes a filter driver to ~/.gitconfig; a committed
    .gitattributes selects it, and git archive (export) and git add (throwaway repo) ran
    it on the host. The operator's global config and attributes are not read."""
    home, marker = tmp_path / "home", tmp_path / "EXECUTED"
    cfg = home / ".gitconfig" if where == "home" else home / "xdg" / "git" / "config"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(f"[filter \"lfs\"]\n\tsmudge = \"sh -c 'echo s >> {marker}; cat'\"\n"
                   f"\tclean = \"sh -c 'echo c >> {marker}; cat'\"\n"
                   "[diff]\n\tnoprefix = true\n")
    (repo / ".gitattributes").write_text("*.md filter=lfs\n")
    commit(repo, "attributes")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "xdg"))
    tree = git(repo, "rev-parse", "HEAD^{tree}").strip()
    gitops.export_tree(repo, tree, tmp_path / "export")
    gitops.throwaway_repo(repo, tree, tmp_path / "throwaway")
    assert not marker.exists()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the repository away")
def test_the_operators_safe_directory_still_reaches_git(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Root on a checkout another uid owns (CI): the operator's ~/.gitconfig grants it with
    safe.directory, and that one setting still reaches git when the rest of the operator's
    config is left out (without it git refused the repository as of dubious ownership)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text("[safe]\n\tdirectory = *\n")
    subprocess.run(["chown", "-R", "1234:1234", str(repo)], check=True)
    monkeypatch.setenv("HOME", str(home))
    gitops._operator_safe_directories.cache_clear()
    try:
        assert gitops.toplevel(repo) == repo.resolve()
        assert gitops.resolve_tree(repo, "HEAD")
    finally:
        gitops._operator_safe_directories.cache_clear()


def test_replace_refs_are_ignored(repo: Path) -> None:
    blob = git(repo, "rev-parse", "HEAD:README.md").strip()
    fake = git(repo, "hash-object", "-w", "--stdin", data=b"replaced\n").strip()
    git(repo, "replace", blob, fake)
    assert git(repo, "cat-file", "blob", blob) == "replaced\n"  # git honours it by default
    assert gitops.read_blob(repo, "HEAD", "README.md") == b"# r, edited\n"
    dest = repo.parent / "export"
    gitops.export_tree(repo, gitops.resolve_tree(repo, "HEAD"), dest)
    assert (dest / "README.md").read_text() == "# r, edited\n"


def test_a_tree_entry_git_metadata_could_alias_is_refused(repo: Path) -> None:
    blob = git(repo, "rev-parse", "HEAD:README.md").strip()
    bad = git(repo, "mktree", data=f"100644 blob {blob}\t.GIT\n".encode()).strip()
    assert gitops.read_blob(repo, bad, ".GIT") is None
    with pytest.raises(ConfigError, match="cannot list tree"):
        gitops.tree_modes(repo, bad)
    with pytest.raises(ConfigError, match="cannot compare"):
        gitops.changed_paths(repo, "HEAD", bad)


def test_a_repository_replaced_at_the_same_path_is_read_afresh(repo: Path) -> None:
    first = gitops.resolve_tree(repo, "HEAD")
    shutil.rmtree(repo)
    repo.mkdir()
    (repo / "only.txt").write_text("new repository\n")
    git(repo, "init", "-q", "-b", "main")
    commit(repo, "fresh")
    second = gitops.resolve_tree(repo, "HEAD")
    assert second != first
    assert gitops.read_blob(repo, "HEAD", "only.txt") == b"new repository\n"


def test_not_a_repository_and_sha256_are_config_errors(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(ConfigError, match="is not a git repository"):
        gitops.git_dir_of(plain)
    with pytest.raises(ConfigError, match=r"project\.repo: repository .* does not exist"):
        gitops.resolve_tree(tmp_path / "missing", "HEAD")
    s256 = tmp_path / "s256"
    s256.mkdir()
    git(s256, "init", "-q", "--object-format=sha256")
    with pytest.raises(ConfigError, match="only sha1 repositories"):
        gitops.resolve_tree(s256, "HEAD")


# -- a tree's own attributes never change the bytes that run or the commit applied -------

SUBMODULE = b"\0submodule"
"""As a file's content in :func:`_raw_repo`: a submodule (gitlink) entry there instead."""


def _raw_repo(root: Path, files: dict[str, bytes]) -> tuple[Path, str]:
    """A repository whose one commit holds ``files`` exactly as given (committed with
    plumbing, no conversion), as a repository can after attributes change under it."""
    root.mkdir(parents=True)
    git(root, "init", "-q", "-b", "main")
    for path, data in files.items():
        if data == SUBMODULE:
            git(root, "update-index", "--add", "--cacheinfo", f"160000,{'1' * 40},{path}")
            continue
        blob = git(root, "hash-object", "-w", "--no-filters", "--stdin", data=data).strip()
        git(root, "update-index", "--add", "--cacheinfo", f"100644,{blob},{path}")
    tree = git(root, "write-tree").strip()
    git(root, "update-ref", "refs/heads/main",
        git(root, "commit-tree", tree, "-m", "base").strip())
    return root, tree


HONEST_REPOS = {
    # a CRLF file committed before `text=auto` was (git add would normalise it)
    "crlf-under-text-auto": ({".gitattributes": b"* text=auto\n", "a.txt": b"x\r\ny\r\n"},
                             "a.txt", "x\r\nz\r\n"),
    # archive would write run.bat with CRLF
    "eol-crlf": ({".gitattributes": b"*.bat text eol=crlf\n", "run.bat": b"echo 1\n",
                  "p.md": b"p\n"}, "run.bat", "echo 2\n"),
    # archive would expand $Id$, git add would collapse an expanded one
    "ident-in-a-subdirectory": ({"d/.gitattributes": b"*.md ident\n",
                                 "d/p.md": b"$Id$\nhello\n"}, "d/p.md", "$Id: x $\nbye\n"),
    # a macro that turns conversions on, set on everything
    "macro": ({".gitattributes": b"[attr]conv text eol=crlf ident\n* conv\n",
               "p.md": b"$Id$\np\n"}, "p.md", "$Id$\nq\n"),
    # export-ignore would leave the file out of what runs
    "export-ignore": ({".gitattributes": b"p.md export-ignore\n", "p.md": b"p\n"},
                      "p.md", "q\n"),
    # a new file its .gitignore matches (git add refuses it without -f)
    "new-ignored-file": ({".gitignore": b"*.md\n", "x.txt": b"x\n"}, "new.md", "new\n"),
    "new-crlf-file-under-text-auto": ({".gitattributes": b"* text=auto\n", "x.txt": b"x\n"},
                                      "n.txt", "a\r\nb\r\n"),
    # a submodule: git archive writes an empty directory for it, git add skips that, and
    # the throwaway repository's tree differed from the base (no such project could apply)
    "submodule": ({".gitmodules": b"[submodule \"vendor/sub\"]\n\tpath = vendor/sub\n"
                                  b"\turl = https://example.invalid/sub\n",
                   "vendor/sub": SUBMODULE, "p.md": b"p\n"}, "p.md", "q\n"),
    # a name git would read as pathspec magic (":x.md" is x.md, ":(glob)*" everything)
    "pathspec-magic-names": ({":x.md": b"a\n", "x.md": b"b\n", ":(glob)y": b"c\n"},
                             ":x.md", "d\n"),
}


@pytest.mark.parametrize("name", list(HONEST_REPOS))
def test_a_trees_attributes_change_no_byte_that_runs(tmp_path: Path, name: str) -> None:
    """export_tree writes the committed blobs as they are (it used to refuse these trees
    as an export mismatch, so such a project could not run at all)."""
    files, _, _ = HONEST_REPOS[name]
    repo, tree = _raw_repo(tmp_path / "op", files)
    gitops.export_tree(repo, tree, tmp_path / "src")
    for path, data in files.items():
        if data == SUBMODULE:
            assert not any((tmp_path / "src" / path).iterdir())
            continue
        assert (tmp_path / "src" / path).read_bytes() == data, path


@pytest.mark.parametrize("name", list(HONEST_REPOS))
def test_an_honest_edit_under_the_trees_attributes_is_applied(tmp_path: Path,
                                                              name: str) -> None:
    """The whole apply, with the apply container's own code (sandbox.apply) run in this
    process on the host-made work repository: the container commits the proposal's bytes
    (no conversion, an ignored new file kept), so its commit is the host's and the
    candidate is applied, byte for byte. Each once refused or crashed."""
    import hashlib
    import json

    import sandbox.apply
    from runner.cycle.apply import apply_proposal
    from runner.isolation.sandbox import RunRecord, StopReason

    files, path, content = HONEST_REPOS[name]
    repo, tree = _raw_repo(tmp_path / "op", files)
    stage = tmp_path / "stage"
    (stage / "in").mkdir(parents=True)
    old = files.get(path)
    (stage / "in" / "proposal.json").write_text(json.dumps(
        {"files": [{"path": path, "content": content}], "rationale": "why"}))
    (stage / "in" / "invocation.json").write_text(json.dumps(
        {"paths": [path], "allowlist": ["*"], "max_file_bytes": 4096,
         "base": {path: None if old is None else hashlib.sha256(old).hexdigest()}}))

    def run(work: Path) -> RunRecord:
        code = sandbox.apply.main(in_dir=stage / "in", repo=work / "repo",
                                  out_dir=work / "out")
        return RunRecord(run_id="x", role="apply", image_id="sha256:" + "0" * 64,
                         container_name="c", exit_code=code, stop_reason=StopReason.OK,
                         wall_s=0.1, stdout_bytes=0, stderr_bytes=0, stdout_tail="",
                         stderr_tail="", cleanup_confirmed=True)

    result = apply_proposal(stage, repo, tree, run=run, uid=os.getuid(),
                            export_to=stage / "candidate-src")
    assert result.status == "applied", result
    assert result.changed == (path,)
    assert (stage / "candidate-src" / path).read_bytes() == content.encode()
    assert gitops.read_blob(stage / "candidate.git", result.tree, path) == content.encode()


def test_the_throwaway_repository_starts_no_background_git(tmp_path: Path) -> None:
    """Its commit of thousands of loose objects once started a detached ``git gc --auto``
    that went on, as the host's uid, after the repository was handed to the apply
    container (whose planted .git/worktrees link had that gc delete host directories).
    No gc, no maintenance: nothing is packed, nothing runs after it returns."""
    import time

    repo = tmp_path / "op"
    for i in range(7000):
        d = repo / f"d{i % 50}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.txt").write_text(f"{i}\n")
    git(repo, "init", "-q", "-b", "main")
    tree = commit(repo, "base") and git(repo, "rev-parse", "HEAD^{tree}").strip()
    dest = tmp_path / "work"
    gitops.throwaway_repo(repo, tree, dest)
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        assert not (dest / ".git" / "gc.pid").exists()
        assert not list((dest / ".git" / "objects" / "pack").glob("*.pack"))
        time.sleep(0.1)
    assert not (dest / ".git" / "hooks").exists()  # no template either
