"""Evaluator (runs in the evaluator container): deterministic scorer plus an optional judge.

Reads /in/answers.jsonl ({case_id, trial, answer}), /ref/references.json ({case_id:
reference}) and /cfg/evaluator.json ({judge: null | {model, threshold}, questions}).
Writes /out/grades.jsonl ({case_id, trial, grades}). The scorer's identity is the
sha256 of this file plus its config, frozen in the plan.

Criteria (None where a criterion does not apply):
- correctness: number within relative tolerance, or text contained (case-insensitive);
- evidence: the cited evidence mentions every required string;
- refusal: the agent refused exactly when the reference says it must.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

JUDGE_PROMPT = """You grade an analyst's answer against a reference answer.
Question: {question}
Reference: {reference}
Answer: {answer}
Reply with exactly one JSON object: {{"score": <number from 0 to 1>}}."""


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def score(answer: dict[str, Any] | None, ref: dict[str, Any]) -> dict[str, bool | None]:
    """Deterministic per-criterion grades for one answer."""
    answer = answer or {}
    refused = answer.get("refused") is True
    if ref["kind"] == "refuse":
        return {"correctness": None, "evidence": None, "refusal": refused}
    value = answer.get("answer")
    if ref["kind"] == "number":
        got, want = _number(value), _number(ref["value"])
        correct = (got is not None and want is not None
                   and abs(got - want) <= float(ref.get("tolerance", 0.005)) * max(1.0, abs(want)))
    else:
        correct = value is not None and str(ref["value"]).lower() in str(value).lower()
    cited = " ".join(str(e) for e in answer.get("evidence") or [])
    required = ref.get("evidence") or []
    evidence = bool(cited) and all(r in cited for r in required)
    return {"correctness": correct, "evidence": evidence, "refusal": not refused}


def judge(question: str, answer: Any, ref: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Ask the judge model (through the gateway) for a score; errors are recorded, not hidden."""
    try:
        from sandbox.gateway_client import client

        text = client().chat.completions.create(
            model=cfg["model"], temperature=0,
            messages=[{"role": "user", "content": JUDGE_PROMPT.format(
                question=question, reference=json.dumps(ref, sort_keys=True),
                answer=json.dumps(answer, sort_keys=True))}],
        ).choices[0].message.content or ""
        obj = json.loads(text)
        s = obj["score"] if isinstance(obj, dict) else None
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s <= 1:
            return {"judge_error": "malformed judge reply"}
        return {"judge_score": float(s), "judge_pass": float(s) >= float(cfg["threshold"])}
    except Exception as exc:
        return {"judge_error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def main(in_dir: Path = Path("/in"), ref_dir: Path = Path("/ref"), cfg_dir: Path = Path("/cfg"),
         out_dir: Path = Path("/out")) -> int:
    refs = json.loads((ref_dir / "references.json").read_text())
    cfg = json.loads((cfg_dir / "evaluator.json").read_text())
    lines = []
    for line in (in_dir / "answers.jsonl").read_text().splitlines():
        row = json.loads(line)
        ref = refs[row["case_id"]]
        grades: dict[str, Any] = score(row.get("answer"), ref)
        if cfg.get("judge"):
            grades.update(judge(cfg["questions"].get(row["case_id"], ""), row.get("answer"),
                                ref, cfg["judge"]))
        lines.append(json.dumps({"case_id": row["case_id"], "trial": row["trial"],
                                 "grades": grades}, sort_keys=True))
    (out_dir / "grades.jsonl").write_text("".join(line + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
