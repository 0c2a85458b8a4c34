"""`cyclebox apply` end to end on the real apply container (SPEC §5).

A small operator repository is built in a temp directory; the CLI applies proposals to a
throwaway repository made from its tree. The success path must produce the patch and
leave the operator's refs, objects and work tree untouched; every refusal must exit 2
with its named reason and leave the throwaway worktree exactly equal to the base export,
with no candidate branch and no patch.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.docker

CLI = [str(Path(sys.executable).with_name("cyclebox"))]
if not Path(CLI[0]).exists():  # pragma: no cover - fallback when not installed as a script
    CLI = [sys.executable, "-m", "runner.cli"]

REF = "main"
SYSTEM = b"You are a careful analyst.\n"
FILES: dict[str, bytes] = {
    "README.md": b"# demo project\n",
    "prompts/system.md": SYSTEM,
    "prompts/user.md": b"Question: {question}\n",
    ".gitignore": b"*.tmp\n",
    ".github/notes.md": b"a .git-adjacent directory name, not .git\n",
}
MAX = 256 * 1024
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _git(repo: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")} | GIT_ENV
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env=env).stdout


def _snapshot(root: Path, *, skip_git: bool = True) -> dict[str, tuple[str, bytes]]:
    """relpath -> (kind, payload) for every entry under root, without following links."""
    snap: dict[str, tuple[str, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        if skip_git and Path(dirpath) == root and ".git" in dirnames:
            dirnames.remove(".git")
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                snap[rel] = ("link", os.readlink(p).encode())
            elif stat.S_ISDIR(st.st_mode):
                snap[rel] = ("dir", b"")
            else:
                snap[rel] = ("file" + ("+x" if st.st_mode & 0o111 else ""), p.read_bytes())
    return snap


def _base_export(repo: Path, dest: Path) -> dict[str, tuple[str, bytes]]:
    """The files of REF, exported independently of cyclebox (git archive)."""
    data = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", REF],
                          check=True, capture_output=True).stdout
    dest.mkdir()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="tar")
    return _snapshot(dest)


def _operator_state(repo: Path) -> dict[str, Any]:
    """Everything the operator owns: refs, object counts, the work tree and .git bytes."""
    return {"refs": _git(repo, "for-each-ref", "--format=%(refname) %(objectname)"),
            "head": (repo / ".git" / "HEAD").read_bytes(),
            "objects": _git(repo, "count-objects", "-v"),
            "worktree": _snapshot(repo),
            "gitdir": {k: v for k, v in _snapshot(repo / ".git", skip_git=False).items()}}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("operator") / "repo"
    for rel, data in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    os.symlink("prompts", root / "link")  # committed as a symlink (mode 120000)
    _git(root, "init", "-q", "-b", REF)
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "base")
    assert "120000" in _git(root, "ls-files", "-s", "link")
    return root


@pytest.fixture(scope="module")
def base_files(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    snap = _base_export(repo, tmp_path_factory.mktemp("export") / "tree")
    assert snap["link"] == ("link", b"prompts")
    assert snap["prompts/system.md"] == ("file", SYSTEM)
    return snap


def _apply(tmp_path: Path, repo: Path, proposal: dict[str, Any] | bytes
           ) -> tuple[subprocess.CompletedProcess[str], Path]:
    # The path set and allowlist are the operator's flags; the proposal file keeps only
    # files, rationale and base hashes.
    flags: list[str] = []
    if isinstance(proposal, dict):
        proposal = dict(proposal)
        # argv cannot carry NUL: such a path stays out of the operator's set (the NUL
        # check comes first in the apply container either way).
        flags += [f"--paths={p}" for p in proposal.pop("paths") if "\0" not in p] or [
            "--paths=prompts/system.md"]
        flags += [f"--allowlist={g}" for g in proposal.pop("allowlist")]
    else:
        flags += ["--paths=prompts/system.md", "--allowlist=*"]
    pfile = tmp_path / "proposal.json"
    pfile.write_bytes(proposal if isinstance(proposal, bytes) else json.dumps(proposal).encode())
    out = tmp_path / "OUT"
    res = subprocess.run([*CLI, "apply", "--proposal", str(pfile), "--repo", str(repo),
                          "--ref", REF, "--out", str(out), *flags],
                         capture_output=True, text=True, timeout=180, check=False)
    return res, out


def _proposal(files: list[tuple[str, str]], *, paths: list[str] | None = None,
              allowlist: list[str] | None = None,
              base: dict[str, str | None] | None = None) -> dict[str, Any]:
    return {"files": [{"path": p, "content": c} for p, c in files],
            "rationale": "test proposal",
            "paths": paths if paths is not None else [p for p, _ in files],
            "allowlist": allowlist if allowlist is not None else ["*"],
            "base": base if base is not None else {
                p: (_sha(FILES[p]) if p in FILES else None) for p, _ in files}}


# -- success --------------------------------------------------------------------------

def test_apply_success_writes_patch_and_leaves_operator_repo_alone(
        repo: Path, base_files: dict[str, Any], tmp_path: Path) -> None:
    before = _operator_state(repo)
    new_system = "You are a careful, concise analyst.\nCite sources.\n"
    proposal = _proposal(
        [("prompts/system.md", new_system),
         (".gitignore", "*.tmp\n*.bak\n"),                 # .git-adjacent name: allowed
         (".github/new.md", "brand new file\n")],          # new file, base null
        allowlist=["prompts/*", ".gitignore", ".github/*"])
    res, out = _apply(tmp_path, repo, proposal)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "applied" in res.stdout

    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "applied"
    assert result["changed"] == [".github/new.md", ".gitignore", "prompts/system.md"]

    patch = (out / "candidate.patch").read_text()
    assert "diff --git a/prompts/system.md b/prompts/system.md" in patch
    assert "-You are a careful analyst." in patch
    assert "+You are a careful, concise analyst." in patch
    assert "+Cite sources." in patch
    assert "+*.bak" in patch
    assert "new file mode" in patch and "+brand new file" in patch
    assert patch.encode() == (out / "work" / "out" / "candidate.patch").read_bytes()

    # the patch applies cleanly to an independent export of the base and gives the proposal
    check = tmp_path / "check"
    _base_export(repo, check)
    subprocess.run(["git", "apply", "--unsafe-paths", "-p1", str(out / "candidate.patch")],
                   cwd=check, check=True, capture_output=True)
    assert (check / "prompts" / "system.md").read_text() == new_system
    assert (check / ".github" / "new.md").read_text() == "brand new file\n"

    # the candidate lives in the host's own repository (positive control for the refusal
    # checks); the container's work repository was its scratch: its files came back, its
    # .git never reaches the host (a live repository would obey its own config there)
    assert _git(out / "candidate.git", "rev-parse", "cyclebox/candidate").strip() == \
        result["commit"]
    assert (out / "work" / "repo" / "prompts" / "system.md").read_text() == new_system
    assert not (out / "work" / "repo" / ".git").exists()

    # the operator's repository: refs, objects, work tree and .git bytes unchanged
    after = _operator_state(repo)
    assert after["refs"] == before["refs"]
    assert after["objects"] == before["objects"]
    assert after["head"] == before["head"]
    assert after["worktree"] == before["worktree"]
    assert after["worktree"] == base_files
    assert after["gitdir"] == before["gitdir"]
    assert _git(repo, "status", "--porcelain", "--ignored") == ""
    assert result["commit"] not in _git(repo, "rev-list", "--all")


# -- refusals -------------------------------------------------------------------------

SYS_BASE: dict[str, str | None] = {"prompts/system.md": _sha(SYSTEM)}

REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "traversal": (_proposal([("../x", "escape\n")], base={"../x": None}),
                  "path_traversal"),
    "traversal-nested": (_proposal([("prompts/../../x", "escape\n")],
                                   base={"prompts/../../x": None}), "path_traversal"),
    "absolute": (_proposal([("/etc/passwd", "root::0:0::/:/bin/sh\n")],
                           base={"/etc/passwd": None}), "absolute_path"),
    "outside-invocation-set": (_proposal([("README.md", "rewritten\n")],
                                         paths=["prompts/system.md"]),
                               "outside_invocation_set"),
    "outside-allowlist": (_proposal([("README.md", "rewritten\n")], allowlist=["prompts/*"]),
                          "outside_allowlist"),
    "git-config": (_proposal([(".git/config", "[core]\n\tinjected-by-proposal = true\n")],
                             base={".git/config": None}), "git_path"),
    "through-symlink": (_proposal([("link/system.md", "via the link\n")],
                                  paths=["link/system.md"], allowlist=["link/*"],
                                  base={"link/system.md": _sha(SYSTEM)}), "symlink_in_path"),
    "symlink-itself": (_proposal([("link", "replace the link\n")], base={"link": None}),
                       "symlink_in_path"),
    "base-hash-mismatch": (_proposal([("prompts/system.md", "edit\n")],
                                     base={"prompts/system.md": _sha(b"stale base\n")}),
                           "base_hash_mismatch"),
    "base-null-but-exists": (_proposal([("prompts/system.md", "edit\n")],
                                       base={"prompts/system.md": None}),
                             "base_hash_mismatch"),
    "duplicate": (_proposal([("prompts/system.md", "one\n"), ("prompts/system.md", "two\n")],
                            paths=["prompts/system.md"], base=SYS_BASE), "duplicate_path"),
    "oversize": (_proposal([("prompts/system.md", "a" * (MAX + 1))], base=SYS_BASE),
                 "oversize_file"),
    "nul": (_proposal([("prompts/sys\0tem.md", "x\n")], base={"prompts/sys\0tem.md": None}),
            "nul_in_path"),
}


@pytest.mark.parametrize(("proposal", "reason"), list(REFUSALS.values()), ids=list(REFUSALS))
def test_apply_refusal(repo: Path, base_files: dict[str, Any], tmp_path: Path,
                       proposal: dict[str, Any], reason: str) -> None:
    before = _operator_state(repo)
    res, out = _apply(tmp_path, repo, proposal)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"refused: {reason}" in res.stdout + res.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "refused"
    assert result["reason"] == reason

    # the throwaway work tree is exactly the base export, with no patch; its .git was the
    # container's scratch and never reaches the host (whatever a proposal put there)
    work_repo = out / "work" / "repo"
    assert _snapshot(work_repo) == base_files
    assert not (work_repo / ".git").exists()
    assert not (out / "candidate.patch").exists()
    assert not (out / "work" / "out" / "candidate.patch").exists()
    assert not (out / "candidate.git").exists()
    if reason in ("path_traversal", "absolute_path"):
        assert not (out / "work" / "x").exists()
        assert not (out / "x").exists()

    assert _operator_state(repo) == before
