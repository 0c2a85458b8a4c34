"""Receipts (SPEC §10): one canonical JSON file binding every input, output and run record.

``files`` maps every file of the run directory (except the receipt itself) to its
sha256, and ``external`` the data stores outside it; ``verify`` re-hashes all of them.
``outcome`` holds digests that do not depend on time (inputs, proposal, patch,
verdict, grades, call request/response hashes), so that a replayed run can be shown
to reproduce them; timings live apart in ``timing``.
"""

from __future__ import annotations

import contextlib
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from runner.cycle.run import Outcome
from runner.errors import IntegrityError
from runner.gateway.calllog import CallLog
from runner.gateway.report import summarize
from runner.hashing import canonical_bytes, sha256_file, sha256_json

SCHEMA = 1
RECEIPT = "receipt.json"


def _files(root: Path) -> tuple[dict[str, str], dict[str, str]]:
    """sha256 of every regular file under ``root``, as (UTF-8 named, other).

    Iterative (a container may nest directories thousands deep) and never following a
    symlink. A path that is not UTF-8 (only a container writes one; collect refuses it)
    goes into the second map under its backslash-escaped form: hashed, but not a name
    ``verify`` could open."""
    out: dict[str, str] = {}
    escaped: dict[str, str] = {}
    stack = [b""]
    while stack:
        rel_dir = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(bytes(root), rel_dir) if rel_dir
                                      else bytes(root)))
        except OSError:
            continue
        for e in entries:
            rel_b = os.path.join(rel_dir, e.name) if rel_dir else e.name
            if e.is_dir(follow_symlinks=False):
                stack.append(rel_b)
                continue
            if not e.is_file(follow_symlinks=False) or e.name == RECEIPT.encode():
                continue
            rel = rel_b.decode("utf-8", "backslashreplace")
            if "/candidate.git/" in f"/{rel}" or "/work/repo/.git/" in f"/{rel}":
                continue  # git internals: bound through the commit and tree ids instead
            try:
                rel_b.decode("utf-8")
                target = out
            except UnicodeDecodeError:
                target = escaped
            target[rel] = sha256_file(Path(os.fsdecode(e.path)))
    return dict(sorted(out.items())), dict(sorted(escaped.items()))


def _records_digest(path: Path) -> str | None:
    if not path.is_file():
        return None
    rows = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        rows.append({k: r.get(k) for k in ("case_id", "trial", "status", "reason", "answer",
                                            "grades", "identities")})
    return sha256_json(rows)


def build(outcome: Outcome) -> dict[str, Any]:
    """Assemble and write ``receipt.json``; returns it."""
    d = outcome.run_dir
    doc = json.loads((d / "plan.json").read_text())
    plan = doc["plan"]
    calls = CallLog(d / "gateway").records()
    stages = d / "stages"
    containers = [json.loads(line) for line in (d / "containers.jsonl").read_text().splitlines()
                  ] if (d / "containers.jsonl").exists() else []
    verdict = outcome.result.model_dump(mode="json")
    verdict_core = {k: v for k, v in verdict.items() if k != "usage"}
    outcome_digests = {
        "inputs": sha256_json(doc["hashes"]),
        "proposal_sha256": outcome.proposal_sha256,
        "patch_sha256": outcome.patch_sha256,
        "candidate_tree": outcome.candidate_tree,
        "verdict": verdict["verdict"],
        "verdict_sha256": sha256_json(verdict_core),
        "baseline_records_sha256": _records_digest(stages / "baseline" / "records.jsonl"),
        "candidate_records_sha256": _records_digest(stages / "candidate" / "records.jsonl"),
        "calls_sha256": sha256_json([[c.role, c.stage, c.case, c.trial, c.turn, c.status,
                                      c.request_sha256, c.response_sha256] for c in
                                     sorted(calls, key=lambda c: (c.stage, c.case or "",
                                                                  c.trial or 0, c.turn,
                                                                  c.role))]),
    }
    receipt = {
        "schema": SCHEMA,
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "plan_hash": outcome.plan_hash,
        "inputs": doc["hashes"],
        "identities": {k: plan[k] for k in ("reference_hash", "data_hash", "scorer", "judge_id",
                                            "manifest_sha256")},
        "base_tree": plan["project"]["base_tree"],
        "images": plan["images"],
        "upstreams": {n: {"provider": u["provider"], "credential":
                          (u.get("credential") or {}).get("env") or
                          (u.get("credential") or {}).get("file"),
                          "fixture": u["provider"] == "scripted",
                          "id": plan["upstream_ids"].get(n)}
                      for n, u in plan["upstreams"].items()},
        "containers": containers,
        "usage": summarize(calls),
        "fixture": any(c.fixture for c in calls),
        "proposal_sha256": outcome.proposal_sha256,
        "patch_sha256": outcome.patch_sha256,
        "verdict": verdict,
        "leftovers": outcome.leftovers,
        "dream": json.loads((stages / "dream" / "summary.json").read_text())
        if (stages / "dream" / "summary.json").is_file() else None,
        "timing": outcome.timings,
        "outcome": outcome_digests,
        "external": {f"store:{sid}": {"path": str(Path(plan["data_dir"]) / s["path"]),
                                      "sha256": s["sha256"]}
                     for sid, s in plan["stores"].items()},
    }
    receipt["files"], receipt["files_not_utf8"] = _files(d)
    _write_atomic(d / RECEIPT, canonical_bytes(receipt))
    return receipt


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file and rename, so a full disk leaves no partial receipt."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def verify(run_dir: Path) -> list[str]:
    """Problems found re-hashing everything the receipt names; empty when all match."""
    try:
        receipt = json.loads((run_dir / RECEIPT).read_text())
    except (OSError, ValueError) as exc:
        raise IntegrityError(f"{run_dir / RECEIPT}: unreadable ({exc})") from None
    problems = []
    for rel, digest in sorted(receipt["files"].items()):
        p = run_dir / rel
        if p.is_symlink() or not p.is_file():
            problems.append(f"{rel}: missing")
        elif sha256_file(p) != digest:
            problems.append(f"{rel}: sha256 differs from the receipt")
    for name, ext in sorted(receipt.get("external", {}).items()):
        p = Path(ext["path"])
        if not p.is_file() or sha256_file(p) != ext["sha256"]:
            problems.append(f"{name} ({p}): missing or changed")
    try:
        plan = json.loads((run_dir / "plan.json").read_text())
        ok = (plan.get("plan_hash") == receipt["plan_hash"]
              and sha256_json(plan.get("plan")) == receipt["plan_hash"])
    except (OSError, ValueError):
        ok = False
    if not ok:
        problems.append("plan.json: plan_hash differs from the receipt")
    return problems
