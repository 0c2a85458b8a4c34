"""Codex CLI and Claude Code as the agent under test (issue 22), one e2e per CLI.

The CLIs come from the node kinds' one package-lock.json (tests/e2e/agents/node_kinds/
project: the TypeScript agent's lockfile plus @openai/codex and @anthropic-ai/claude-code,
their native platform packages, Claude Code's install script acknowledged and never run),
so they run in the SAME derived analyst image as the TypeScript agent. Each case runs the
CLI non-interactively through its wrapper (codex_agent.py, claude_agent.py); the gateway's
scripted provider drives a full turn in each family's own stream shape: a shell tool call
the CLI runs inside the hardened container (it reads the case and the logs, runs the
canary scan, tries one fetch), then the answer built on the tool's output.

Shows, per CLI: a cycle from the project to a verdict and a verified receipt; every model
call in gateway/calls.jsonl, in the CLI's family, streamed, with usage and a measured
cost; the fetch refused at once by the container's deny-all proxy and named in the run
record (``egress_refused``); the host's canary key (set as the OpenAI and Anthropic keys
of the host environment) in no container's environment, process, file, the engine's view
of any container, the derived image's history, or anything the run wrote; a replay
reproducing every outcome hash (``receipt compare``) although each CLI puts fresh ids
into every request.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runner import gitops
from tests.fixtures.standalone import standalone_cycle
from tests.integration.test_openai_server import Inspector

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[2]
KINDS = ROOT / "tests" / "e2e" / "agents" / "node_kinds"
CLI = [str(Path(sys.executable).with_name("cyclebox"))]
if not Path(CLI[0]).exists():  # pragma: no cover - fallback when not installed as a script
    CLI = [sys.executable, "-m", "runner.cli"]
VARIANT = {"codex": ("responses", "codex"), "claude_code": ("messages", "claude-code")}
"""variant -> (API family, case-id suffix)."""
REFUSED = "runbooks.example.com:443"


def cyclebox(*args: str, env: dict[str, str], timeout: float = 1800
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          check=False, env=env, cwd=ROOT)


def make_project(dest: Path) -> Path:
    """The node kinds' project in its own repository, with the coding-CLI cycle."""
    repo = dest / "repo"
    shutil.copytree(KINDS / "project", repo, ignore=shutil.ignore_patterns(
        "__pycache__", "node_modules"))
    gitops.init_fixed(repo, "node kinds agent")
    for name in ("scenarios.yaml", "policy.yaml"):
        shutil.copy(KINDS / "coding_clis" / name, dest / name)
    shutil.copytree(KINDS / "coding_clis" / "data", dest / "data")
    shutil.copytree(KINDS / "coding_clis" / "scripts", dest / "scripts")
    return standalone_cycle(KINDS / "coding_clis" / "cycle.yaml", repo, dest, cyclebox)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, node_image: Any
         ) -> Iterator[dict[str, Any]]:
    print(f"\nnode image {node_image.tag}: {node_image.size_bytes / 1e6:.0f} MB, "
          f"{'built' if node_image.built else 'reused'} in {node_image.seconds:.1f}s")
    base = tmp_path_factory.mktemp("clis")
    cycle = make_project(base / "project")
    canary = "sk-cbxcanary-" + os.urandom(12).hex()
    env = dict(os.environ, TMPDIR=str(base), COLUMNS="200", OPENAI_API_KEY=canary,
               ANTHROPIC_API_KEY=canary, CODEX_API_KEY=canary, CBX_CANARY=canary)
    run, replayed = base / "run", base / "replayed"
    inspector = Inspector("")
    try:
        t0 = time.monotonic()
        rec = cyclebox("cycle", "run", str(cycle), "--out", str(run), "--json", env=env)
        t1 = time.monotonic()
        rep = cyclebox("cycle", "run", str(cycle), "--replay", str(run), "--out",
                       str(replayed), "--json", env=env)
        t2 = time.monotonic()
    finally:
        time.sleep(1)  # let the last create events be inspected
        inspector.close()
    print(f"\ncoding CLIs: recorded {t1 - t0:.0f}s, replayed {t2 - t1:.0f}s ({base})")
    yield {"cycle": cycle, "run": run, "replayed": replayed, "recorded": rec, "replay": rep,
           "env": env, "canary": canary, "inspected": inspector, "image": node_image}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _explain(run: Path) -> str:
    log = run / "gateway" / "calls.jsonl"
    lines = [f"{c.get('case')} {c.get('api')} {c.get('status')} {c.get('error')}"
             for c in (_lines(log) if log.is_file() else []) if c.get("status") != "ok"]
    for stage in ("baseline", "candidate"):
        path = run / "stages" / stage / "records.jsonl"
        for r in _lines(path) if path.is_file() else []:
            if r["status"] != "ok":
                lines.append(f"{stage} {r['case_id']}: {r['status']} {r.get('reason')}")
    return "\n".join(lines[:60])


def _of(variant: str, case: str | None) -> bool:
    return case is not None and case.endswith("--" + VARIANT[variant][1])


@pytest.fixture(scope="module")
def recorded(runs: dict[str, Any]) -> dict[str, Any]:
    res, run = runs["recorded"], runs["run"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + _explain(run)
    return runs


@pytest.mark.parametrize("variant", sorted(VARIANT))
def test_the_cycle_ends_with_a_verdict_and_a_verified_receipt(recorded: dict[str, Any],
                                                               variant: str) -> None:
    run = recorded["run"]
    assert json.loads(recorded["recorded"].stdout)["verdict"] == "accept_for_review"
    verdict = json.loads((run / "stages/compare/verdict.json").read_text())
    improved = {c["case_id"] for c in verdict["improvements"] if _of(variant, c["case_id"])}
    assert improved == {f"d01-checkout--{VARIANT[variant][1]}",
                        f"a02-search--{VARIANT[variant][1]}"}
    assert verdict["regressions"] == []
    for stage in ("baseline", "candidate"):
        for r in _lines(run / "stages" / stage / "records.jsonl"):
            if _of(variant, r["case_id"]):
                assert r["status"] == "ok", r
                assert r["answer"]["evidence"] in (["checkout"], ["search"]), r
    res = cyclebox("receipt", "verify", str(run), env=recorded["env"])
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("variant", sorted(VARIANT))
def test_every_call_is_recorded_streamed_with_usage_and_measured_cost(
        recorded: dict[str, Any], variant: str) -> None:
    calls = [c for c in _lines(recorded["run"] / "gateway" / "calls.jsonl")
             if c["role"] == "analyst" and _of(variant, c["case"])]
    api = VARIANT[variant][0]
    # per case: the call that asks for the tool, the call with the tool's result
    assert len(calls) == 2 * 2 * 2, [(c["case"], c["api"]) for c in calls]
    for c in calls:
        assert c["status"] == "ok" and c["api"] == api and c["stream"] is True, c
        assert c["usage"] and c["usage"]["prompt_tokens"] > 0, c
        assert c["cost_basis"] == "measured" and c["cost_usd"] > 0, c
        assert c["fixture"] is True
        # Codex gives its input messages fresh ids of its own, never stored upstream:
        # sent without them (runner/gateway/items.py), the calls go through unchanged
        assert bool(c.get("dropped_ids")) is (variant == "codex"), c
    receipt = json.loads((recorded["run"] / "receipt.json").read_text())
    assert receipt["usage"]["total"]["complete"] is True


@pytest.mark.parametrize("variant", sorted(VARIANT))
def test_the_cli_ran_its_tool_inside_and_its_egress_was_refused_and_named(
        recorded: dict[str, Any], variant: str) -> None:
    run = recorded["run"]
    started = [c for c in _lines(run / "containers.jsonl")
               if c["role"] == "analyst" and _of(variant, c.get("case"))]
    assert len(started) == 4
    for c in started:
        assert c["stop_reason"] == "ok", c
        assert c["egress_refused"] == [REFUSED] and c["egress_refused_count"] == 1, c
    scans = [json.loads(p.read_text()) for p in sorted((run / "stages").glob(
        f"*/cases/*--{VARIANT[variant][1]}__t*/out/canary-scan.json"))]
    assert len(scans) == 4
    binary = "codex" if variant == "codex" else "claude"
    for s in scans:
        assert s["hits"] == [] and s["scanned"] > 0, s
        assert s["probe"] == ["/src/canary_scan.py"], s
        assert any(binary in p for p in s["parents"]), s  # the CLI's own tool ran it


def test_the_canary_key_reaches_no_container_image_or_record(recorded: dict[str, Any],
                                                             tmp_path: Path) -> None:
    run, canary, inspector = recorded["run"], recorded["canary"], recorded["inspected"]
    names = {c["container_name"] for c in _lines(run / "containers.jsonl")}
    seen = {json.loads(doc)[0]["Name"].lstrip("/"): doc for doc in inspector.seen.values()}
    assert names <= set(seen), sorted(names - set(seen))
    for name in names:
        assert canary not in seen[name] and "cbxcanary" not in seen[name], name
    for f in run.rglob("*"):
        if f.is_file() and not f.is_symlink():
            assert canary.encode() not in f.read_bytes(), f"canary in {f}"
    # every layer of the image the CLIs ran in, and its config (env, labels, history)
    saved = tmp_path / "image.tar"
    with saved.open("wb") as out:
        subprocess.run(["docker", "save", _analyst_image(run)], stdout=out, check=True,
                       timeout=900)
    with tarfile.open(saved) as outer:  # layers are plain tars: their bytes are the files
        for member in outer:
            f = outer.extractfile(member) if member.isfile() else None
            while f is not None and (chunk := f.read(1 << 24)):
                assert b"cbxcanary" not in chunk, member.name


def _analyst_image(run: Path) -> str:
    return str(json.loads((run / "plan.json").read_text())["plan"]["images"]["analyst"])


def test_the_clis_ran_in_the_typescript_agents_derived_image(recorded: dict[str, Any]
                                                           ) -> None:
    """One lockfile, one image: the session's node image (built from the TypeScript
    agent's cycle file, tests/fixtures/node_kinds.py) is the one the CLIs' plan froze."""
    image = recorded["image"]
    assert _analyst_image(recorded["run"]) == image.id
    assert {"@openai/codex-linux-x64@0.171.0-linux-x64",
            "@anthropic-ai/claude-code-linux-x64@2.1.332"} <= set(image.installed["npm"])


def test_replay_reproduces_every_outcome_hash(runs: dict[str, Any]) -> None:
    rep, run, replayed = runs["replay"], runs["run"], runs["replayed"]
    assert runs["recorded"].returncode == 0
    assert rep.returncode == 0, rep.stdout[-3000:] + rep.stderr[-3000:] + _explain(replayed)
    assert json.loads(rep.stdout)["verdict"] == json.loads(runs["recorded"].stdout)["verdict"]
    res = cyclebox("receipt", "compare", str(run), str(replayed), env=runs["env"])
    assert res.returncode == 0, res.stdout + res.stderr
    a, b = (json.loads((d / "receipt.json").read_text()) for d in (run, replayed))
    assert {k: v for k, v in a["outcome"].items() if k != "inputs"} == {
        k: v for k, v in b["outcome"].items() if k != "inputs"}
    calls = _lines(replayed / "gateway" / "calls.jsonl")
    assert {c["provider"] for c in calls} == {"replay"}
    assert all(c["status"] == "ok" for c in calls), _explain(replayed)
    # the CLIs' fresh ids: the replayed requests differ from the recorded ones in bytes
    # (matched by the request without them) yet got the recorded responses
    recorded = {c["request_sha256"] for c in _lines(run / "gateway" / "calls.jsonl")}
    fresh = [c for c in calls if c["request_sha256"] not in recorded]
    assert fresh and all(c["role"] == "analyst" for c in fresh)
