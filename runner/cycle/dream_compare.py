"""Paired dream evidence: the same cycle with dream off and on, one receipt (SPEC §8).

Both arms freeze the same cycle file (same tasks, models, seeds, images); only the dream
setting differs. The receipt reports each arm's held-out scores (every policy case that
is not development-split) and verdict, the dream acceptance and fallback rates, the
incremental held-out delta and the incremental cost, and claims lift only when the
delta is positive.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner.cycle.config import DreamSpec, load_cycle
from runner.cycle.models import DEVELOPMENT, Record
from runner.cycle.plan import check_cycle, freeze, make_fresh_dir, refuse_existing
from runner.cycle.receipt import build
from runner.cycle.run import CycleRunner, Progress
from runner.errors import ConfigError
from runner.hashing import canonical_bytes, sha256_file
from runner.isolation.sandbox import Sandbox


def heldout(records_file: Path, cases: set[str]) -> dict[str, Any]:
    """Pass counts over held-out cases (status ok and every criterion passed)."""
    rows = [Record.model_validate_json(x) for x in records_file.read_text().splitlines()]
    rows = [r for r in rows if r.case_id in cases]
    passed = sum(r.status == "ok" and r.grades is not None and r.grades.passed() for r in rows)
    return {"passed": passed, "total": len(rows),
            "rate": round(passed / len(rows), 6) if rows else None}


def _arm(cycle: Path, out: Path, *, images: dict[str, str], spec: DreamSpec,
         sandbox: Sandbox, progress: Progress | None) -> dict[str, Any]:
    _, plan_hash = freeze(cycle, out, images=images, dream_override=spec)
    outcome = CycleRunner(out / "plan.json", sandbox=sandbox, progress=progress).run()
    receipt = build(outcome)
    plan = json.loads((out / "plan.json").read_text())["plan"]
    manifest = json.loads((out / "inputs" / "manifest.json").read_text())
    split = {s["id"]: s["split"] for s in manifest["scenarios"]}
    cases = {c for c in plan["policy"]["cases"] if split.get(c) != DEVELOPMENT}
    stages = out / "stages"
    total = receipt["usage"]["total"]
    return {
        "dir": str(out), "plan_hash": plan_hash,
        "receipt_sha256": sha256_file(out / "receipt.json"),
        "verdict": outcome.result.verdict, "reasons": list(outcome.result.reasons),
        "heldout_cases": sorted(cases),
        "heldout": {side: heldout(stages / side / "records.jsonl", cases)
                    if (stages / side / "records.jsonl").is_file() else None
                    for side in ("baseline", "candidate")},
        "cost_usd": total["cost_usd"], "cost_complete": total["complete"],
        "model_calls": total["calls"], "dream": receipt["dream"],
        "patch_sha256": outcome.patch_sha256,
    }


def paired(cycle: Path, out: Path, *, images: dict[str, str], sandbox: Sandbox,
           progress_for: Callable[[str], Progress | None] = lambda _a: None) -> dict[str, Any]:
    """Run both arms under ``out/off`` and ``out/on``; write ``out/dream-receipt.json``."""
    parsed, _ = load_cycle(cycle)
    if parsed.dream.mode == "off":
        raise ConfigError("dream.mode is off; the paired run needs template or model",
                          path=str(cycle), field="dream.mode", fix="set dream: {mode: model}")
    # every input checked before anything is written (the arms' freezes check again)
    refuse_existing(out)
    check_cycle(cycle)
    make_fresh_dir(out)
    off = _arm(cycle, out / "off", images=images, spec=DreamSpec(mode="off"),
               sandbox=sandbox, progress=progress_for("off"))
    on = _arm(cycle, out / "on", images=images, spec=parsed.dream, sandbox=sandbox,
              progress=progress_for("on"))
    d = on["dream"] or {}
    requested = d.get("requested") or 0
    rate_off = (off["heldout"]["candidate"] or {}).get("rate")
    rate_on = (on["heldout"]["candidate"] or {}).get("rate")
    delta = None if rate_off is None or rate_on is None else round(rate_on - rate_off, 6)
    cost = (None if off["cost_usd"] is None or on["cost_usd"] is None
            else round(on["cost_usd"] - off["cost_usd"], 9))
    lift = delta is not None and delta > 0
    receipt = {
        "schema": 1, "kind": "dream-paired", "cycle_sha256": sha256_file(cycle),
        "dream": parsed.dream.model_dump(mode="json"), "arms": {"off": off, "on": on},
        "acceptance_rate": round(d["accepted"] / requested, 6) if requested else None,
        "fallback_rate": round(d["fallback"] / requested, 6) if requested else None,
        "heldout_delta": delta, "incremental_cost_usd": cost,
        "lift_claimed": lift,
        "claim": (f"held-out pass rate {rate_off} -> {rate_on} (+{delta}) with dream on"
                  if lift else "no lift claimed: the held-out delta is not positive"),
    }
    (out / "dream-receipt.json").write_bytes(canonical_bytes(receipt))
    return receipt
