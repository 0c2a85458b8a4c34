"""The framework matrix table from finished runs: framework x family x stream x tools ->
calls, cost basis, replay equal.

    python tests/e2e/agents/log_triage/table.py RUN [REPLAYED] [--json]

RUN is a cycle run of the log-triage project (any selection of incidents and variants);
REPLAYED its ``cycle run --replay RUN``. Each case's variant is read from its id
(``...--<variant>``). A variant's replay is equal when every one of its records (answer,
status, grades) and the request hashes of its calls are the same in both runs. Only
plain characters of the runs' own data are printed (ids and counts).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matrix import VARIANTS

STAGES = ("baseline", "candidate")


def variant_of(case_id: str) -> str:
    return case_id.rpartition("--")[2].replace("-", "_")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def records(run: Path) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for stage in STAGES:
        for r in _jsonl(run / "stages" / stage / "records.jsonl"):
            out[(stage, r["case_id"])] = r
    return out


def calls(run: Path) -> list[dict[str, Any]]:
    return [c for c in _jsonl(run / "gateway" / "calls.jsonl") if c.get("role") == "analyst"]


def passes(record: dict[str, Any]) -> bool:
    """ok and every graded criterion true (judge fields are None without a judge)."""
    grades = record.get("grades") or {}
    return record.get("status") == "ok" and all(
        grades.get(k) is not False for k in ("correctness", "evidence", "refusal")) and bool(
        grades)


def rows(run: Path, replayed: Path | None = None) -> list[dict[str, Any]]:
    recs = records(run)
    again = records(replayed) if replayed else {}
    by_variant: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in calls(run):
        by_variant[variant_of(str(c.get("case") or ""))].append(c)
    replay_calls: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in calls(replayed) if replayed else []:
        replay_calls[variant_of(str(c.get("case") or ""))].append(c)
    out = []
    for variant, (framework, family, stream, tools) in VARIANTS.items():
        mine = {k: r for k, r in recs.items() if variant_of(k[1]) == variant}
        if not mine:
            continue
        cs = by_variant[variant]
        apis = Counter(str(c.get("api")) for c in cs)
        basis = Counter(str(c.get("cost_basis")) for c in cs)
        tool_calls = sum(len(r.get("answer", {}).get("tool_calls", [])) for r in mine.values()
                         if isinstance(r.get("answer"), dict))
        passed = {s: sum(1 for (st, _), r in mine.items() if st == s and passes(r))
                  for s in STAGES}
        row: dict[str, Any] = {
            "variant": variant, "framework": framework, "family": family,
            "stream": stream, "tools": tools, "cases": len(mine) // len(STAGES),
            "calls": dict(sorted(apis.items())), "ok_calls": sum(
                1 for c in cs if c.get("status") == "ok"),
            "streamed_calls": sum(1 for c in cs if c.get("stream")),
            "with_usage": sum(1 for c in cs if c.get("usage")),
            "cost_basis": dict(sorted(basis.items())),
            "cost_usd": round(sum(c.get("cost_usd") or 0 for c in cs), 8),
            "tool_calls": tool_calls, "passed": passed, "replay_equal": None}
        if replayed:
            theirs = {k: r for k, r in again.items() if variant_of(k[1]) == variant}
            strip = ("latency_s", "usage")
            same_records = {k: {f: v for f, v in r.items() if f not in strip}
                            for k, r in mine.items()} == {
                k: {f: v for f, v in r.items() if f not in strip} for k, r in theirs.items()}
            same_calls = sorted(c["request_sha256"] for c in cs) == sorted(
                c["request_sha256"] for c in replay_calls[variant])
            row["replay_equal"] = same_records and same_calls
        out.append(row)
    return out


def markdown(table: list[dict[str, Any]]) -> str:
    head = ("| variant | framework | family | stream | tools | cases | calls (api: n) | "
            "ok/with usage | cost basis | cost USD | tool calls | passed base/cand | "
            "replay equal |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in table:
        apis = ", ".join(f"{k} {v}" for k, v in r["calls"].items()) or "none"
        basis = ", ".join(f"{k} {v}" for k, v in r["cost_basis"].items()) or "none"
        eq = {None: "not replayed", True: "yes", False: "NO"}[r["replay_equal"]]
        lines.append(
            f"| {r['variant']} | {r['framework']} | {r['family']} | "
            f"{'yes' if r['stream'] else 'no'} | {'yes' if r['tools'] else 'no'} | "
            f"{r['cases']} | {apis} | {r['ok_calls']}/{r['with_usage']} | {basis} | "
            f"{r['cost_usd']:.6f} | {r['tool_calls']} | "
            f"{r['passed']['baseline']}/{r['passed']['candidate']} | {eq} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("replayed", type=Path, nargs="?")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    table = rows(args.run, args.replayed)
    print(json.dumps(table, indent=1) if args.json else markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
