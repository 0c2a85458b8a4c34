"""Apply stage (SPEC §5): the apply container edits a throwaway repository; the host then
re-verifies the result on a bare clone it makes itself.

Invariant: the host never runs git inside a directory a container wrote (its
.git/config could carry commands); it clones it with ``--no-local`` into
``candidate.git`` and checks that clone: parent is the frozen base, changed paths are
exactly the proposal's, contents equal the proposal, the patch equals the host's diff.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner import gitops
from runner.collect import collect
from runner.errors import OutputRejected
from runner.hashing import write_json
from runner.sandbox import RunRecord, StopReason
from sandbox.proposal import Change, Refused, check_changes


def apply_proposal(stage_dir: Path, repo: Path, tree: str, *,
                   run: Callable[[Path], RunRecord], uid: int) -> dict[str, Any]:
    """Run the apply container on a throwaway repo, then re-verify on a host-made bare clone.

    ``stage_dir/in`` holds proposal.json and invocation.json. The host never runs git
    inside the directory the container wrote (its .git/config could carry commands):
    it clones it with --no-local into ``candidate.git`` and checks that clone.
    """
    work = stage_dir / "work"
    work.mkdir(mode=0o700)
    base_commit = gitops.throwaway_repo(repo, tree, work / "repo")
    (work / "out").mkdir()
    if os.getuid() == 0 and uid != 0:
        for p in [work, *work.rglob("*")]:
            os.lchown(p, uid, uid)
    rec = run(work)
    try:
        # container output: no symlink followed, sizes capped, strict JSON
        got = collect(work / "out")
        result = got.json("result.json")
        if not isinstance(result, dict):
            raise OutputRejected("result.json is not a JSON object")
    except OutputRejected as exc:
        result = {"status": "refused", "reason": "apply_failed",
                  "message": f"{rec.stop_reason.value}: {exc}: {rec.stderr_tail[-300:]}"}
    write_json(stage_dir / "result.json", result)
    if result.get("status") != "applied":
        return dict(result)
    if rec.stop_reason is not StopReason.OK:
        return {"status": "refused", "reason": "apply_failed", "message": rec.detail}
    proposal = json.loads((stage_dir / "in" / "proposal.json").read_text())
    inv = json.loads((stage_dir / "in" / "invocation.json").read_text())
    bare = stage_dir / "candidate.git"
    commit = str(result["commit"])
    gitops.clone_bare_untrusted(work / "repo", bare, branch="cyclebox/candidate")
    problems = _verify_candidate(bare, base_commit, commit, proposal, inv)
    if problems:
        return {"status": "refused", "reason": "host_verification_failed", "message": problems}
    patch = gitops.diff(bare, base_commit, commit)
    if patch != got.files.get("candidate.patch"):
        return {"status": "refused", "reason": "host_verification_failed",
                "message": "candidate.patch differs from the host's diff"}
    (stage_dir / "candidate.patch").write_bytes(patch)
    result["tree"] = gitops.head_tree(bare, commit)
    write_json(stage_dir / "result.json", result)
    return dict(result)


def _verify_candidate(bare: Path, base: str, commit: str, proposal: dict[str, Any],
                      inv: dict[str, Any]) -> str:
    if gitops.rev(bare, f"{commit}^") != base:
        return "candidate commit is not a child of the frozen base"
    changes = [Change(f["path"], f["content"]) for f in proposal["files"]]
    try:
        check_changes(changes, paths=set(inv["paths"]), allowlist=list(inv["allowlist"]),
                      max_bytes=int(inv["max_file_bytes"]))
    except Refused as exc:
        return str(exc)
    changed = gitops.changed_paths(bare, base, commit)
    if changed != sorted(c.path for c in changes if gitops.read_blob(bare, base, c.path)
                         != c.content.encode()):
        return f"changed paths {changed} differ from the proposal"
    for c in changes:
        if gitops.read_blob(bare, commit, c.path) != c.content.encode():
            return f"{c.path}: committed content differs from the proposal"
    return ""
