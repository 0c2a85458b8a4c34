"""The framework matrix (issue 20): one log-triage agent written eight ways, each on its
framework's defaults and reaching its model by environment alone (the in-container
loopback endpoint), all frameworks installed through ``project.requirements`` into ONE
derived analyst image. One cycle covers the matrix: each case names its variant, so the
baseline and the candidate run every variant (two incidents per variant here, one
development and one acceptance; ``make matrix`` runs all 11).

Shows: the cycle ends with a verdict (every variant's answers improve after the worker's
prompt edit, each through a real tool call); every call is in gateway/calls.jsonl with
its API family, usage, cost and cost basis, in the family and streaming mode the variant
speaks; a replay reproduces every outcome hash (``receipt compare``); the table
generator prints one row per variant with replay equal.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from runner import gitops
from tests.fixtures.standalone import standalone_cycle

# the first run builds the matrix's derived image (~100 wheels), then records and
# replays 16 cases a side
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(2700)]

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "tests" / "e2e" / "agents" / "log_triage"
CLI = [str(Path(sys.executable).with_name("cyclebox"))]
if not Path(CLI[0]).exists():  # pragma: no cover - fallback when not installed as a script
    CLI = [sys.executable, "-m", "runner.cli"]
INCIDENTS = [0, 4]
"""Per variant: incident 1 (development split) and incident 5 (acceptance)."""


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"log_triage_{name}", AGENT / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(AGENT))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(AGENT))
    return module


matrix = _load("matrix")
table = _load("table")

# variant -> the analyst calls one case makes: (api, stream) in order
EXPECTED_CALLS: dict[str, list[tuple[str, bool]]] = {
    "openai_chat": [("embeddings", False), ("chat", False), ("chat", False)],
    "openai_chat_stream": [("chat", True), ("chat", True)],
    "openai_responses_stream": [("responses", True), ("responses", True)],
    "openai_agents": [("responses", False), ("responses", False)],
    "anthropic_messages_stream": [("messages", True), ("messages", True)],
    "langgraph_react": [("chat", False), ("chat", False)],
    "pydantic_ai": [("responses", False), ("responses", False)],
    "litellm_tools": [("chat", False), ("chat", False)],
}


def cyclebox(*args: str, env: dict[str, str], timeout: float = 1500
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          check=False, env=env, cwd=ROOT)


def make_project(dest: Path, incidents: list[int], variants: list[str]) -> Path:
    """The log-triage project in its own repository (the agent tree at its root), with
    the cases of ``incidents`` x ``variants``; returns its cycle file."""
    repo = dest / "repo"
    shutil.copytree(AGENT / "project", repo, ignore=shutil.ignore_patterns("__pycache__"))
    gitops.init_fixed(repo, "log-triage agent")
    matrix.write(dest, incidents, variants)
    return standalone_cycle(AGENT / "cycle.yaml", repo, dest, cyclebox)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("matrix")
    cycle = make_project(base / "project", INCIDENTS, list(matrix.VARIANTS))
    env = dict(os.environ, TMPDIR=str(base), COLUMNS="200")
    run, replayed = base / "run", base / "replayed"
    t0 = time.monotonic()
    rec = cyclebox("cycle", "run", str(cycle), "--out", str(run), "--json", env=env)
    t1 = time.monotonic()
    rep = cyclebox("cycle", "run", str(cycle), "--replay", str(run), "--out", str(replayed),
                   "--json", env=env)
    t2 = time.monotonic()
    print(f"\nmatrix: recorded {t1 - t0:.0f}s, replayed {t2 - t1:.0f}s ({base})")
    yield {"cycle": cycle, "run": run, "replayed": replayed, "recorded": rec,
           "replay": rep, "env": env}


def _calls(run: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (run / "gateway" / "calls.jsonl").read_text().splitlines()
            if ln.strip()]


def _explain(run: Path) -> str:
    """What to read when the cycle did not go as expected: the refused or failed calls
    and the stderr tails of the cases that did not answer."""
    lines = [f"{c.get('case')} {c.get('api')} {c.get('status')} {c.get('http_status')} "
             f"{c.get('error')}" for c in _calls(run) if c.get("status") != "ok"]
    for stage in ("baseline", "candidate"):
        path = run / "stages" / stage / "records.jsonl"
        for r in [json.loads(ln) for ln in path.read_text().splitlines()] if path.is_file() else []:
            if r["status"] != "ok":
                lines.append(f"{stage} {r['case_id']}: {r['status']} {r.get('reason')}")
    return "\n".join(lines[:80])


def test_the_cycle_ends_with_a_verdict_every_variant_improved(runs: dict[str, Any]) -> None:
    res, run = runs["recorded"], runs["run"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + _explain(run)
    assert json.loads(res.stdout)["verdict"] == "accept_for_review"
    verdict = json.loads((run / "stages/compare/verdict.json").read_text())
    expected = {matrix.case_id(n, v) for n in INCIDENTS for v in matrix.VARIANTS}
    assert {c["case_id"] for c in verdict["improvements"]} == expected
    assert verdict["regressions"] == []
    # each answer came after the tool ran inside the agent: evidence is the log it read
    for stage in ("baseline", "candidate"):
        for line in (run / "stages" / stage / "records.jsonl").read_text().splitlines():
            r = json.loads(line)
            n = int(r["case_id"][1:3]) - 1
            service = matrix.INCIDENTS[n][1]
            assert r["answer"]["tool_calls"] == [
                {"name": "read_log", "arguments": {"service": service}}], r
            assert r["answer"]["evidence"] == [service]
            if stage == "candidate":
                assert r["answer"]["answer"] == matrix.INCIDENTS[n][3]
    embedded = [json.loads(p.read_text()) for p in (run / "stages").glob(
        "*/cases/*openai-chat__t*/out/answer.json")]
    assert embedded and all(a["embedding_dims"] > 0 for a in embedded)


def test_every_call_is_recorded_with_api_usage_cost_and_basis(runs: dict[str, Any]) -> None:
    run = runs["run"]
    calls = _calls(run)
    analyst = [c for c in calls if c["role"] == "analyst"]
    for c in calls:
        assert c["status"] == "ok", (c, _explain(run))
        assert c["usage"] and c["usage"]["prompt_tokens"] > 0, c
        assert c["cost_usd"] is not None and c["cost_usd"] > 0, c
        assert c["cost_basis"] == "measured", c
        assert c["api"] in {"chat", "responses", "embeddings", "messages"}, c
    per_case: dict[tuple[str, str], list[tuple[str, bool]]] = {}
    for c in sorted(analyst, key=lambda c: c.get("seq", 0)):
        per_case.setdefault((c["stage"], c["case"]), []).append((c["api"], bool(c["stream"])))
    expected_cases = {(s, matrix.case_id(n, v)) for s in ("baseline", "candidate")
                      for n in INCIDENTS for v in matrix.VARIANTS}
    assert set(per_case) == expected_cases
    for (_stage, case), got in per_case.items():
        want = EXPECTED_CALLS[table.variant_of(case)]
        assert Counter(got) == Counter(want), (case, got)
    receipt = json.loads((run / "receipt.json").read_text())
    total = receipt["usage"]["total"]
    assert total["complete"] is True
    assert total["cost_usd"] == pytest.approx(sum(c["cost_usd"] for c in calls), abs=1e-8)


def test_replay_reproduces_every_outcome_hash(runs: dict[str, Any]) -> None:
    rec, rep, run, replayed = (runs["recorded"], runs["replay"], runs["run"],
                               runs["replayed"])
    assert rec.returncode == 0
    assert rep.returncode == 0, rep.stdout[-3000:] + rep.stderr[-3000:] + _explain(replayed)
    assert json.loads(rep.stdout)["verdict"] == json.loads(rec.stdout)["verdict"]
    res = cyclebox("receipt", "compare", str(run), str(replayed), env=runs["env"])
    assert res.returncode == 0, res.stdout + res.stderr
    a, b = (json.loads((d / "receipt.json").read_text()) for d in (run, replayed))
    assert {k: v for k, v in a["outcome"].items() if k != "inputs"} == {
        k: v for k, v in b["outcome"].items() if k != "inputs"}
    replay_calls = _calls(replayed)
    assert {c["provider"] for c in replay_calls} == {"replay"}
    assert sorted(c["request_sha256"] for c in replay_calls) == sorted(
        c["request_sha256"] for c in _calls(run))


def test_the_table_has_every_variant_with_replay_equal(runs: dict[str, Any]) -> None:
    rows = table.rows(runs["run"], runs["replayed"])
    print("\n" + table.markdown(rows))
    assert [r["variant"] for r in rows] == list(matrix.VARIANTS)
    for r in rows:
        assert r["replay_equal"] is True, r
        assert r["cases"] == len(INCIDENTS)
        assert r["ok_calls"] == r["with_usage"] == sum(r["calls"].values()) > 0
        assert r["cost_basis"] == {"measured": r["ok_calls"]}
        assert r["tool_calls"] == 2 * len(INCIDENTS)
        assert r["passed"] == {"baseline": 0, "candidate": len(INCIDENTS)}
