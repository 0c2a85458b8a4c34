"""Training corpus export (SPEC §11): the gateway's call log and the evaluator's grades
become trajectories, one per (stage, case, trial), turns in order.

Invariants: each turn's prompt is the exact recorded request bytes (a missing or
corrupted blob fails the export, naming the call; nothing is re-assembled);
``r_format`` is 1 only when every turn of the trajectory parsed; ``r_outcome`` is the
evaluator's correctness where graded and null where not, never 0 for missing; grades
join trajectories by a hash of their identity, never by position; export is refused
without a calibration whose kappa meets the export policy.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from pydantic import Field

from runner.collect import loads_strict
from runner.cycle.models import Record
from runner.cycle.review import load_calibration
from runner.errors import ConfigError, IntegrityError, OutputRejected
from runner.gateway.calllog import CallLog, CallRecord
from runner.hashing import canonical_bytes, sha256_bytes, sha256_file, sha256_json
from runner.sandbox import Frozen

SIDES = {"baseline": "baseline", "candidate": "candidate"}


class ExportPolicy(Frozen):
    schema_: int = Field(alias="schema")
    min_kappa: float = Field(ge=-1, le=1)
    """Overall Cohen's kappa a calibration must reach before any export."""
    roles: tuple[str, ...] = ("analyst",)


def load_export_policy(path: Path) -> ExportPolicy:
    from runner.loading import load_model

    return load_model(path, ExportPolicy, fmt="yaml", what="export policy",
                      fix="see ExportPolicy in runner/export.py (default policies/export.yaml)")


def join_key(stage: str, case: str | None, trial: int | None) -> str:
    """Content hash joining a trajectory to its graded record."""
    return sha256_json([stage, case, trial])


def reply_of(response: bytes) -> tuple[str | None, bool]:
    """(assistant text, parsed) from recorded response bytes (completion or SSE).

    A turn parsed when the response is a well-formed completion whose message content
    is one JSON object (the agent protocol the scorer relies on)."""
    text: str | None = None
    try:
        if response.lstrip().startswith(b"data:"):
            parts = []
            for line in response.decode().splitlines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    chunk = json.loads(line[5:])
                    for ch in chunk.get("choices") or []:
                        parts.append((ch.get("delta") or {}).get("content") or "")
            text = "".join(parts)
        else:
            obj = loads_strict(response, source="response")
            text = obj["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError, OutputRejected):
        return text, False
    if not isinstance(text, str):
        return None, False
    try:
        return text, isinstance(json.loads(text), dict)
    except ValueError:
        return text, False


def _grades(run: Path) -> dict[str, Record]:
    out = {}
    for side in SIDES:
        f = run / "stages" / side / "records.jsonl"
        if not f.is_file():
            continue
        for line in f.read_text().splitlines():
            r = Record.model_validate_json(line)
            out[join_key(side, r.case_id, r.trial)] = r
    return out


def export(run: Path, out: Path, *, calibration: Path | None, policy: ExportPolicy,
           fmt: str = "verl") -> dict[str, Any]:
    """Write trajectories.jsonl, summary.json and export-receipt.json into a new ``out``."""
    if fmt != "verl":
        raise ConfigError(f"unknown format {fmt!r}", field="--format", fix="use verl")
    if calibration is None or not calibration.is_file():
        raise ConfigError("no calibration result: export needs human-model agreement first",
                          field="--calibration", fix="run `cyclebox review packet` on the run's "
                          "records, label it, then `cyclebox review calibrate ... --out FILE` "
                          "and pass --calibration FILE")
    cal = load_calibration(calibration)
    kappa = cal.cohen_kappa.get("overall")
    if kappa is None or kappa < policy.min_kappa:
        raise ConfigError(f"calibration kappa {kappa} is below the export policy's "
                          f"min_kappa {policy.min_kappa}", field="--calibration",
                          fix="improve the judge/scorer or relabel, then `cyclebox review "
                          "calibrate` again")
    if out.exists():
        raise ConfigError(f"{out} exists; evidence is never overwritten", field="--out")
    log = CallLog(run / "gateway")
    calls = [c for c in log.records() if c.role in policy.roles and c.status != "refused"]
    groups: dict[tuple[str, str | None, int | None], list[CallRecord]] = defaultdict(list)
    for c in calls:
        groups[(c.stage, c.case, c.trial)].append(c)
    grades = _grades(run)
    dataset = json.loads((run / "plan.json").read_text())["plan"]["dataset"]
    trajectories = []
    for (stage, case, trial), turns in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1] or "", kv[0][2] if kv[0][2] is not None else -1)):
        turns.sort(key=lambda c: c.turn)
        rows = []
        for c in turns:
            try:
                prompt = log.blob(c.request_sha256)
            except IntegrityError as exc:
                raise IntegrityError(f"call seq {c.seq} ({stage}/{case}/t{trial} turn "
                                     f"{c.turn}): {exc}") from None
            reply, parsed = None, False
            if c.response_sha256:
                try:
                    reply, parsed = reply_of(log.blob(c.response_sha256))
                except IntegrityError as exc:
                    raise IntegrityError(f"call seq {c.seq}: {exc}") from None
            try:
                prompt_text = prompt.decode("utf-8")
            except UnicodeDecodeError:
                raise IntegrityError(f"call seq {c.seq}: recorded request is not UTF-8; "
                                     "it cannot be exported byte-exactly as text") from None
            rows.append({"turn": c.turn, "prompt": prompt_text,
                         "prompt_sha256": c.request_sha256, "reply": reply,
                         "response_sha256": c.response_sha256, "parsed": parsed,
                         "status": c.status})
        rec = grades.get(join_key(stage, case, trial))
        correct = rec.grades.correctness if rec and rec.grades else None
        trajectories.append({
            "data_source": dataset, "trajectory_id": join_key(stage, case, trial),
            "stage": stage, "case_id": case, "trial": trial, "turns": rows,
            "r_format": 1 if rows and all(r["parsed"] for r in rows) else 0,
            "r_outcome": None if correct is None else (1.0 if correct else 0.0),
            "fixture": any(c.fixture for c in turns)})
    out.mkdir(parents=True)
    body = "".join(json.dumps(t, sort_keys=True, ensure_ascii=False) + "\n"
                   for t in trajectories)
    (out / "trajectories.jsonl").write_text(body, encoding="utf-8")
    fmt_pass = sum(t["r_format"] for t in trajectories)
    summary = {
        "trajectories": len(trajectories), "turns": sum(len(t["turns"]) for t in trajectories),
        "r_format": {"1": fmt_pass, "0": len(trajectories) - fmt_pass},
        "r_outcome": {"1": sum(t["r_outcome"] == 1.0 for t in trajectories),
                      "0": sum(t["r_outcome"] == 0.0 for t in trajectories),
                      "null": sum(t["r_outcome"] is None for t in trajectories)},
        "format_pass_rate": round(fmt_pass / len(trajectories), 4) if trajectories else None,
        "fixture": any(t["fixture"] for t in trajectories)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    receipt = {"schema": 1, "format": fmt, "run": str(run),
               "run_receipt_sha256": sha256_file(run / "receipt.json")
               if (run / "receipt.json").is_file() else None,
               "calibration_sha256": sha256_file(calibration), "kappa": kappa,
               "min_kappa": policy.min_kappa,
               "trajectories_sha256": sha256_bytes(body.encode("utf-8")), "summary": summary}
    (out / "export-receipt.json").write_bytes(canonical_bytes(receipt))
    return summary
