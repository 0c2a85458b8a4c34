"""Apply container: validate a proposal against the throwaway worktree, write it, commit it
on a task branch and export the patch. Standard library and git only.

Mounts: /in/proposal.json and /in/invocation.json (the frozen path set, allowlist and
base hashes, from the host, not from the worker) read-only; /repo the throwaway
repository (the only writable place besides /out). Nothing is written to /repo unless
every change passes every rule. Exit 2 with /out/result.json status "refused".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from sandbox.proposal import Change, Refused, check_changes, check_tree, strict_json

BRANCH = "cyclebox/candidate"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "cyclebox", "GIT_AUTHOR_EMAIL": "cyclebox@localhost",
    "GIT_COMMITTER_NAME": "cyclebox", "GIT_COMMITTER_EMAIL": "cyclebox@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:01+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:01+0000",
    "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/tmp",  # noqa: S108 - the role's tmpfs
    "GIT_LITERAL_PATHSPECS": "1",  # a proposal's ":x.md" is that path, not pathspec magic
}


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env=env).stdout.strip()


def load_changes(proposal: dict[str, Any]) -> list[Change]:
    files = proposal.get("files")
    if not isinstance(files, list):
        raise Refused("malformed_proposal", "files must be a list")
    out = []
    for i, f in enumerate(files):
        if not isinstance(f, dict) or not isinstance(f.get("path"), str) or not isinstance(
                f.get("content"), str):
            raise Refused("malformed_proposal", f"files[{i}] must be {{path, content}} strings")
        out.append(Change(f["path"], f["content"]))
    return out


def apply(proposal: dict[str, Any], inv: dict[str, Any], repo: Path) -> dict[str, object]:
    changes = load_changes(proposal)
    paths = {str(p) for p in inv["paths"]}
    allowlist = [str(g) for g in inv["allowlist"]]
    check_changes(changes, paths=paths, allowlist=allowlist,
                  max_bytes=int(inv.get("max_file_bytes", 256 * 1024)))
    check_tree(changes, repo, dict(inv["base"]))
    base_commit = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-q", "-b", BRANCH)
    for c in changes:
        target = repo / c.path
        target.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: the final component cannot be a symlink (checked above, enforced here)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(c.content)
    # -f: a new file the tree's .gitignore matches is still the proposal's (the host's own
    # commit of it has no ignore rules); the repository's info/attributes, the host's,
    # keeps git from converting what it stores
    git(repo, "add", "-f", "--", *[c.path for c in changes])
    git(repo, "commit", "-q", "--no-verify", "--allow-empty", "-m",
        "cyclebox candidate\n\n" + str(proposal.get("rationale", ""))[:2000])
    commit = git(repo, "rev-parse", "HEAD")
    patch = subprocess.run(["git", "-C", str(repo), "diff", "--binary", "--no-color",
                            "--no-ext-diff", base_commit, commit], check=True,
                           capture_output=True, env={**os.environ, **GIT_ENV}).stdout
    return {"status": "applied", "base_commit": base_commit, "commit": commit,
            "tree": git(repo, "rev-parse", "HEAD^{tree}"), "branch": BRANCH,
            "changed": sorted(c.path for c in changes), "patch": patch}


def _obj(v: object) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise Refused("malformed_proposal", "proposal and invocation must be JSON objects")
    return v


def main(in_dir: Path = Path("/in"), repo: Path = Path("/repo"),
         out_dir: Path = Path("/out")) -> int:
    try:
        proposal = strict_json((in_dir / "proposal.json").read_text(encoding="utf-8"))
        inv = strict_json((in_dir / "invocation.json").read_text(encoding="utf-8"))
        result = apply(_obj(proposal), _obj(inv), repo)
    except Refused as exc:
        (out_dir / "result.json").write_text(json.dumps(
            {"status": "refused", "reason": exc.reason, "message": exc.message}))
        print(f"refused: {exc}", file=sys.stderr)
        return 2
    except (ValueError, UnicodeDecodeError) as exc:
        (out_dir / "result.json").write_text(json.dumps(
            {"status": "refused", "reason": "malformed_proposal", "message": str(exc)}))
        return 2
    except subprocess.CalledProcessError as exc:
        # git refused the edit (a path inside a submodule, say): named, with git's words
        said = str(exc.stderr or "").strip()[-1500:] or f"exit {exc.returncode}, no stderr"
        (out_dir / "result.json").write_text(json.dumps(
            {"status": "refused", "reason": "git_failed",
             "message": f"git {' '.join(map(str, exc.cmd[3:5]))} failed: {said}"}))
        print(f"refused: git_failed: {said}", file=sys.stderr)
        return 2
    patch = result.pop("patch")
    (out_dir / "candidate.patch").write_bytes(patch if isinstance(patch, bytes) else b"")
    (out_dir / "result.json").write_text(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
