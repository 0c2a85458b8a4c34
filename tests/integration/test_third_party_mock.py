"""Each API family against an upstream this project did not write: mock-ai-api (PyPI,
pinned; it serves /v1/chat/completions, /v1/responses, /v1/embeddings on its OpenAI app
and /v1/messages on its Anthropic app, streaming included). It pins fastapi==0.115.14,
which the dev environment's fakellm cannot share, so it lives in its own venv
(``make mock-env``: build/mock-venv). Each app runs on 127.0.0.1 behind
tests/fixtures/keyed_mock.py, which answers 401 unless the request carries the canary
key, so a call that reached the mock without the host-side key cannot pass unnoticed.

Two cycles of the framework matrix's log-triage agent (one derived image), unmodified:
the OpenAI-family variants with ``provider: openai`` and the Anthropic variant with
``provider: anthropic``. mock-ai-api answers text (no tool call: its tool scenarios call
a tool of its own), so the verdict is whatever the answers earn; what is checked is the
wire: every call recorded ok with the mock's reported usage and cost basis ``measured``,
in the family and streaming mode each variant speaks, the key only at the mock, and a
replay reproducing the outcome hashes with no key and no mock call.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.paths import PROJECT_ROOT

# each family's fixture may build the matrix's derived image, then records and replays
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(2700)]

MOCK_PY = PROJECT_ROOT / "build" / "mock-venv" / "bin" / "python"
KEYED = PROJECT_ROOT / "tests" / "fixtures" / "keyed_mock.py"
KEY_ENV = "CBX_MOCK_KEY"
MODEL = "gpt-4.1:mock-text"
"""mock-ai-api picks its scenario from the model's suffix: plain text replies."""
FAMILIES = {
    "openai": (["openai_chat", "openai_chat_stream", "openai_responses_stream",
                "openai_agents"], "app.openai_app:app"),
    "anthropic": (["anthropic_messages_stream"], "app.anthropic_app:app"),
}


def _e2e() -> Any:
    path = PROJECT_ROOT / "tests" / "e2e" / "test_frameworks.py"
    spec = importlib.util.spec_from_file_location("matrix_e2e", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Mock:
    def __init__(self, app: str, key: str, base: Path) -> None:
        name = app.partition(":")[0]
        portfile = base / f"{name}.port"
        self.log = (base / f"{name}.log").open("w")
        env = {k: v for k, v in os.environ.items() if k != KEY_ENV} | {KEY_ENV: key}
        self.proc = subprocess.Popen([str(MOCK_PY), str(KEYED), app, str(portfile)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=base)
        deadline = time.monotonic() + 30
        while not (portfile.is_file() and portfile.read_text()):
            assert self.proc.poll() is None and time.monotonic() < deadline, "mock down"
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{portfile.read_text()}"
        while True:
            try:
                self.stats()
                break
            except OSError:
                assert time.monotonic() < deadline, "mock does not answer"
                time.sleep(0.1)

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(self.url + "/_keyed/stats", timeout=10) as resp:
            data: dict[str, int] = json.loads(resp.read())
        return data

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_run(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    assert MOCK_PY.is_file(), "mock-ai-api's venv is missing: run make mock-env"
    provider = request.param
    variants, app = FAMILIES[provider]
    e2e = _e2e()
    base = tmp_path_factory.mktemp(f"mock-{provider}")
    key = "sk-cbxcanary-" + os.urandom(12).hex()
    mock = Mock(app, key, base)
    try:
        cycle = e2e.make_project(base / "project", [0, 4], variants)
        cyc = yaml.safe_load(cycle.read_text())
        models = [MODEL, "fixture-embed"] if provider == "openai" else [MODEL]
        cyc["upstreams"]["target"] = {
            "provider": provider, "credential": {"env": KEY_ENV}, "models": models,
            "base_url": mock.url + ("/v1" if provider == "openai" else ""),
            "max_tokens": 1024, "rules": {"allow_tools": True},
            "prices": {m: {"input_per_mtok": 0.15, "output_per_mtok": 0.6} for m in models}}
        cycle.write_text(yaml.safe_dump(cyc, sort_keys=False))
        env = dict(os.environ, TMPDIR=str(base), NO_PROXY="127.0.0.1,localhost",
                   no_proxy="127.0.0.1,localhost", COLUMNS="200")
        run = base / "run"
        res = e2e.cyclebox("cycle", "run", str(cycle), "--out", str(run), "--json",
                           env=env | {KEY_ENV: key})
        yield {"provider": provider, "variants": variants, "run": run, "cycle": cycle,
               "result": res, "mock": mock, "key": key, "env": env, "base": base,
               "e2e": e2e}
    finally:
        mock.close()


def test_every_call_reaches_the_mock_and_is_recorded_with_its_usage(
        family_run: dict[str, Any]) -> None:
    run, res, e2e = family_run["run"], family_run["result"], family_run["e2e"]
    assert res.returncode in (0, 1, 2), res.stdout[-3000:] + res.stderr[-3000:]
    calls = [c for c in e2e._calls(run) if c["role"] == "analyst"]
    assert calls, e2e._explain(run)
    for c in calls:
        assert c["status"] == "ok", (c, e2e._explain(run))
        assert c["provider"] == family_run["provider"] and c["fixture"] is False
        assert c["usage"] and c["cost_usd"] and c["cost_basis"] == "measured", c
    seen = {(c["api"], bool(c["stream"])) for c in calls}
    want = {call for v in family_run["variants"] for call in e2e.EXPECTED_CALLS[v][:1]}
    assert want <= seen, (want, seen)
    stats = family_run["mock"].stats()
    assert stats.get("refused", 0) == 0
    assert sum(stats.values()) == len(calls)
    for f in run.rglob("*"):
        if f.is_file() and not f.is_symlink():
            assert family_run["key"].encode() not in f.read_bytes(), f


def test_replay_reproduces_the_outcome_without_key_or_mock(
        family_run: dict[str, Any]) -> None:
    run, base, e2e = family_run["run"], family_run["base"], family_run["e2e"]
    before = sum(family_run["mock"].stats().values())
    replayed = base / "replayed"
    rep = e2e.cyclebox("cycle", "run", str(family_run["cycle"]), "--replay", str(run),
                       "--out", str(replayed), "--json", env=family_run["env"])
    assert rep.returncode == family_run["result"].returncode, rep.stdout + rep.stderr
    assert sum(family_run["mock"].stats().values()) == before
    res = e2e.cyclebox("receipt", "compare", str(run), str(replayed), env=family_run["env"])
    assert res.returncode == 0, res.stdout + res.stderr

