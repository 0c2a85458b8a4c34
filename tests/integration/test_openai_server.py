"""A whole cycle with ``provider: openai`` against an OpenAI-compatible server no one here
wrote: fakellm (PyPI, pinned in the dev extras), run on 127.0.0.1 in a subprocess.

The server's replies come from a rules file generated from the bundled example's
scripts, so the cycle reaches the same verdict as the offline demo; every rule also
requires ``Authorization: Bearer <canary>``, and a last catch-all rule answers 401, so
a call that reached the server without the real key cannot pass unnoticed. The test
shows: every model call is in the run's call log (the server's own count agrees); the
key reaches only the server (no container's inspect data, no container's files or
environment, no file of the run holds it); costs are the server's reported usage times
the cycle's prices; a replay of the recorded run, with no key and no server call,
reproduces the outcome hashes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.gateway.calllog import CallLog, CallRecord, sha256
from runner.paths import PROJECT_ROOT
from tests.fixtures.cycle_project import (
    EXAMPLE,
    example_agent,
    project_with_agent,
    require_judge,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

KEY_ENV = "CBX_FAKELLM_KEY"
MODELS = {"target": "fakellm-target", "optimizer": "fakellm-optimizer",
          "judge": "fakellm-judge"}
PRICES = {"target": (0.15, 0.6), "optimizer": (2.5, 10.0), "judge": (0.5, 1.5)}
"""USD per million input / output tokens, per upstream (distinct, so a mix-up shows)."""
ROLE_UPSTREAM = {"analyst": "target", "worker": "optimizer", "evaluator": "judge"}
UNAUTHORIZED = "unauthorized-or-unknown"
CLI = [sys.executable, "-m", "runner.cli"]


# -- the server's rules ---------------------------------------------------------------
def _reply_text(rule: dict[str, Any]) -> str:
    """The reply of one of our scripted-provider rules, as the scripted provider sends it."""
    if "reply" in rule:
        return str(rule["reply"])
    return json.dumps(rule["reply_json"], separators=(",", ":"), sort_keys=True)


def fakellm_rules(key: str) -> dict[str, Any]:
    """fakellm's config: the example's target script, its worker edit and a judge.

    fakellm matches one substring over all messages (``messages_contain``) and one over
    the message before the last (``previous_message_contains``): the analyst sends
    [system prompt, question], so the question and a line of the (edited) prompt map
    onto those two. Script rules needing two prompt lines are left out (they fire only
    in the dream cycle); their question then falls through to its one-line rule.
    """
    auth = {"header.authorization": f"Bearer {key}"}
    target = yaml.safe_load((EXAMPLE / "scripts" / "target.yaml").read_text())["rules"]
    rules: list[dict[str, Any]] = []
    for n, r in enumerate(target):
        when = r["when"]
        assert set(when) <= {"last_user_contains", "contains"}, when
        assert len(when["last_user_contains"]) == 1, when
        prompt = when.get("contains", [])
        if len(prompt) > 1:
            continue
        cond: dict[str, Any] = {**auth, "model_matches": MODELS["target"],
                                "messages_contain": when["last_user_contains"][0]}
        if prompt:
            cond["previous_message_contains"] = prompt[0]
        rules.append({"name": f"target-{n}", "when": cond,
                      "respond": {"content": _reply_text(r)}})
    optimizer = yaml.safe_load((EXAMPLE / "scripts" / "optimizer.yaml").read_text())["rules"]
    edit = next(r for r in optimizer if r["when"].get("contains") == ["revenue"])
    rules.append({"name": "worker-edit",
                  "when": {**auth, "model_matches": MODELS["optimizer"],
                           "messages_contain": "# Failure brief"},
                  "respond": {"content": _reply_text(edit)}})
    rules.append({"name": "judge", "when": {**auth, "model_matches": MODELS["judge"]},
                  "respond": {"content": '{"score": 1}'}})
    # Last: anything else (a wrong or missing key, an unknown prompt) is refused.
    rules.append({"name": UNAUTHORIZED, "respond": {"status": 401,
                                                    "error": "no rule for this key or prompt"}})
    return {"version": 1, "rules": rules}


class FakeLLM:
    """The fakellm server in a subprocess on 127.0.0.1 (port chosen by the kernel)."""

    def __init__(self, config: Path, log: Path) -> None:
        self.log = log
        self._err = log.open("w")
        env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fakellm.cli", "serve", "--host", "127.0.0.1", "--port",
             "0", "--config", str(config)],
            stdout=self._err, stderr=subprocess.STDOUT, env=env, cwd=config.parent)
        deadline = time.monotonic() + 30
        while not (m := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)",
                                  log.read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"fakellm did not start:\n{log.read_text()}")
            time.sleep(0.1)
        self.url = m.group(1)

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/_fakellm/stats", timeout=10) as resp:
            data: dict[str, Any] = json.loads(resp.read())
        return data

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._err.close()


# -- watching the containers ------------------------------------------------------------
class Inspector:
    """``docker inspect`` of every cyclebox container created while it runs, whose run id
    starts with ``prefix`` (other sessions share the engine), taken right after create."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.seen: dict[str, str] = {}
        self.missed = 0
        self.proc = subprocess.Popen(
            ["docker", "events", "--format", "{{.ID}}", "--filter", "type=container",
             "--filter", "event=create", "--filter", "label=io.cyclebox.run_id"],
            stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            cid = line.strip()
            res = subprocess.run(["docker", "inspect", cid], capture_output=True, text=True,
                                 check=False)
            if res.returncode != 0:
                self.missed += 1
                continue
            labels = json.loads(res.stdout)[0]["Config"]["Labels"] or {}
            if labels.get("io.cyclebox.run_id", "").startswith(self.prefix):
                self.seen[cid] = res.stdout

    def names(self) -> set[str]:
        return {json.loads(doc)[0]["Name"].lstrip("/") for doc in self.seen.values()}

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.thread.join(timeout=30)


# -- the agent: the example's, calling its own model name, scanning for the key ----------
SCAN = '''

def canary_scan() -> None:
    """Test-only: look for the upstream key in the environment, every process's environ
    and the files this container can read (all of them for one question, the mounted
    and writable places for the others: a full walk costs seconds); the result goes to
    /out/canary-scan.json."""
    import os

    marker = ("cbx" + "canary").encode()
    probe = ("scan" + "-selftest").encode()  # this file holds it once: the scan must see it
    seen_probe = []
    hits = [f"env:{k}" for k, v in os.environ.items() if marker in (k + v).encode()]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/environ").read_bytes():
                hits.append(f"environ:{pid}")
        except OSError:
            pass
    full = "Lyon" in json.loads(Path("/case/input.json").read_text())["question"]
    tops = ["/"] if full else ["/run", "/src", "/case", "/data", "/tmp", "/out", "/etc",
                               "/root", "/home"]
    scanned = 0
    for top in tops:
        for root, dirs, files in os.walk(top):
            if root == "/":
                dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev")]
            for name in files:
                p = os.path.join(root, name)
                try:
                    if os.path.islink(p) or os.path.getsize(p) > 64 << 20:
                        continue
                    with open(p, "rb") as fh:
                        data = fh.read()
                    if marker in data:
                        hits.append(f"file:{p}")
                    if probe in data:
                        seen_probe.append(p)
                    scanned += 1
                except OSError:
                    pass
    Path("/out/canary-scan.json").write_text(json.dumps(
        {"hits": hits, "scanned": scanned, "full": full, "probe": seen_probe}))
    # scan-selftest

'''


def scanning_agent() -> str:
    src = example_agent()
    for old, new in (('MODEL = "fixture-target"', f'MODEL = "{MODELS["target"]}"'),
                     ("\n\ndef main() -> int:\n",
                      f"{SCAN}\ndef main() -> int:\n    canary_scan()\n")):
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    return src


# -- the run ----------------------------------------------------------------------------
def cli(*args: str, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          check=False, env=env, cwd=PROJECT_ROOT)


def upstream(name: str, url: str) -> dict[str, Any]:
    model = MODELS[name]
    pin, pout = PRICES[name]
    return {"provider": "openai", "base_url": url + "/v1", "credential": {"env": KEY_ENV},
            "models": [model], "max_tokens": 4096 if name == "optimizer" else 1024,
            "prices": {model: {"input_per_mtok": pin, "output_per_mtok": pout}}}


def no_proxy_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The host environment, with the loopback server never reached through a proxy."""
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    env.update(TMPDIR=str(tmp), NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
               COLUMNS="200", **extra)
    tmp.mkdir(parents=True, exist_ok=True)
    return env


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One cycle against fakellm; what the server, the engine and the CLI saw."""
    base = tmp_path_factory.mktemp("fakellm")
    canary = "sk-cbxcanary-" + os.urandom(12).hex()
    config = base / "fakellm.yaml"
    config.write_text(yaml.safe_dump(fakellm_rules(canary), sort_keys=False))
    server = FakeLLM(config, base / "fakellm.log")
    name = "fakellm-" + os.urandom(4).hex()
    try:
        cycle = project_with_agent(
            base / "ex", scanning_agent(), name=name,
            upstreams={n: upstream(n, server.url) for n in MODELS},
            worker={"model": MODELS["optimizer"], "max_tokens": 4096},
            judge={"model": MODELS["judge"], "threshold": 0.5, "required": True})
        require_judge(cycle)
        run = base / "run"
        inspector = Inspector(name)
        try:
            res = cli("cycle", "run", str(cycle), "--out", str(run), "--json",
                      env=no_proxy_env(base / "tmp", **{KEY_ENV: canary}))
        finally:
            time.sleep(1)  # let the last create events be inspected
            inspector.close()
        assert res.returncode == 0, res.stdout + res.stderr
        yield {"run": run, "cycle": cycle, "result": json.loads(res.stdout), "canary": canary,
               "server": server, "stats": server.stats(), "inspected": inspector,
               "base": base, "name": name}
    finally:
        server.close()


def records(run: Path) -> list[CallRecord]:
    return CallLog(run / "gateway").records()


def test_cycle_reaches_the_demo_verdict_through_the_server(recorded: dict[str, Any]) -> None:
    run, result = recorded["run"], recorded["result"]
    assert result["verdict"] == "accept_for_review", result
    verdict = json.loads((run / "stages/compare/verdict.json").read_text())
    assert {c["case_id"] for c in verdict["improvements"]} == {
        "d01-revenue-march", "d02-revenue-books", "a01-revenue-april", "a02-revenue-games",
        "a04-aov-january"}
    receipt = json.loads((run / "receipt.json").read_text())
    assert receipt["fixture"] is False  # no scripted reply anywhere in the run
    assert {n: u["provider"] for n, u in receipt["upstreams"].items()} == {
        "target": "openai", "optimizer": "openai", "judge": "openai"}
    res = cli("receipt", "verify", str(run), env=no_proxy_env(recorded["base"] / "tmp"))
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_call_is_in_the_call_log_and_the_server_agrees(recorded: dict[str, Any]) -> None:
    run, stats = recorded["run"], recorded["stats"]
    recs = records(run)
    log = CallLog(run / "gateway")
    cases = len(json.loads((EXAMPLE / "manifest.json").read_text())["scenarios"])
    # baseline and candidate: one analyst call and one judge call per case; one worker call
    assert Counter(r.role for r in recs) == {"analyst": 2 * cases, "evaluator": 2 * cases,
                                             "worker": 1}
    for r in recs:
        assert (r.status, r.error, r.http_status, r.provider, r.fixture) == (
            "ok", None, 200, "openai", False), r
        assert r.upstream == ROLE_UPSTREAM[r.role] and r.model == MODELS[r.upstream]
        assert sha256(log.blob(r.request_sha256)) == r.request_sha256
        assert r.response_sha256 and log.blob(r.response_sha256)
    # every analyst case and trial of both sides appears exactly once
    analyst = Counter((r.stage, r.case, r.trial) for r in recs if r.role == "analyst")
    assert set(analyst.values()) == {1} and {s for s, _, _ in analyst} == {"baseline",
                                                                            "candidate"}
    # the server saw the same calls, each matched by a rule that requires the canary key
    assert stats["total_requests"] == len(recs)
    assert UNAUTHORIZED not in stats["by_rule"] and "<fallthrough>" not in stats["by_rule"]
    by_model = Counter(r.model for r in recs)
    served: Counter[str] = Counter()
    for rule, n in stats["by_rule"].items():
        served[{"target": MODELS["target"], "worker": MODELS["optimizer"],
                "judge": MODELS["judge"]}[rule.split("-")[0]]] += n
    assert served == by_model


def test_key_reaches_only_the_server(recorded: dict[str, Any]) -> None:
    run, canary, inspector = recorded["run"], recorded["canary"], recorded["inspected"]
    cases = len(json.loads((EXAMPLE / "manifest.json").read_text())["scenarios"])
    # the engine's view (env, mounts, labels, command) of every container the run started
    started = [json.loads(line) for line in (run / "containers.jsonl").read_text().splitlines()]
    assert Counter(c["role"] for c in started) == {"analyst": 2 * cases, "evaluator": 2,
                                                   "worker": 1, "apply": 1}
    assert inspector.names() == {c["container_name"] for c in started}, inspector.missed
    for doc in inspector.seen.values():
        assert canary not in doc and "cbxcanary" not in doc
    # from inside: every analyst container scanned its env, /proc/*/environ and files
    scans = [json.loads(p.read_text()) for p in sorted(
        (run / "stages").glob("*/cases/*/out/canary-scan.json"))]
    assert len(scans) == 2 * cases
    assert all(s["hits"] == [] for s in scans), [s["hits"] for s in scans if s["hits"]]
    assert all(s["scanned"] > 0 and s["probe"] == ["/src/agent.py"] for s in scans), scans
    full = [s for s in scans if s["full"]]
    assert len(full) == 2 and min(s["scanned"] for s in full) > 1000, "a scan must read"
    # nothing the run wrote (call log, records, container logs, receipt) holds it
    for f in run.rglob("*"):
        if f.is_file() and not f.is_symlink():
            assert canary.encode() not in f.read_bytes(), f"canary in {f}"
    # ... yet the server got it on every call (no request fell through to the 401 rule)
    assert sum(recorded["stats"]["by_rule"].values()) == len(records(run)) > 0


def test_the_server_answers_no_other_key(recorded: dict[str, Any]) -> None:
    """The rules really discriminate: without the canary key the call is refused."""
    body = json.dumps({"model": MODELS["judge"],
                       "messages": [{"role": "user", "content": "grade"}]}).encode()

    def status(key: str | None) -> int:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(recorded["server"].url + "/v1/chat/completions",
                                     data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    assert [status(k) for k in (None, "sk-" + "0" * 32, recorded["canary"])] == [401, 401, 200]


def fakellm_tokens(text: str) -> int:
    """fakellm's documented count without tiktoken: len // 4, at least 1 for any text."""
    return max(1, len(text) // 4) if text else 0


def test_costs_come_from_the_servers_usage(recorded: dict[str, Any]) -> None:
    run = recorded["run"]
    log = CallLog(run / "gateway")
    total = 0.0
    for r in records(run):
        body = json.loads(log.blob(r.request_sha256))
        reply = json.loads(log.blob(r.response_sha256 or ""))
        # the usage recorded is what the server reported ...
        assert r.usage is not None
        assert r.usage.model_dump(include={"prompt_tokens", "completion_tokens",
                                           "total_tokens"}) == reply["usage"]
        # fakellm reports no cached or reasoning tokens: none are invented
        assert r.usage.cached_tokens == r.usage.reasoning_tokens == 0
        assert r.usage.cache_write_tokens == 0 and r.cost_basis == "measured"
        # ... which is the server's own count, not our scripted provider's
        assert r.usage.prompt_tokens == sum(fakellm_tokens(m["content"])
                                            for m in body["messages"])
        assert r.usage.completion_tokens == fakellm_tokens(
            reply["choices"][0]["message"]["content"])
        pin, pout = PRICES[ROLE_UPSTREAM[r.role]]
        expected = (r.usage.prompt_tokens * pin + r.usage.completion_tokens * pout) / 1e6
        assert r.cost_usd is not None and r.cost_usd > 0
        assert r.cost_usd == pytest.approx(expected, rel=1e-12, abs=0)
        total += expected
    receipt = json.loads((run / "receipt.json").read_text())
    usage = receipt["usage"]["total"]
    assert usage["complete"] is True and usage["fixture_calls"] == 0
    assert usage["cost_usd"] == pytest.approx(total, abs=1e-8)
    for role, row in receipt["usage"]["per_role"].items():
        pin, pout = PRICES[ROLE_UPSTREAM[role]]
        mine = [r for r in records(run) if r.role == role]
        assert row["cost_usd"] == pytest.approx(sum(
            (r.usage.prompt_tokens * pin + r.usage.completion_tokens * pout) / 1e6
            for r in mine if r.usage), abs=1e-8)


def test_replay_reproduces_the_outcome_without_key_or_server(recorded: dict[str, Any]) -> None:
    run, base = recorded["run"], recorded["base"]
    before = recorded["server"].stats()["total_requests"]
    replayed = base / "replayed"
    env = no_proxy_env(base / "tmp-replay")  # no key: a replay never needs one
    res = cli("cycle", "run", str(recorded["cycle"]), "--replay", str(run), "--out",
              str(replayed), "--json", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["verdict"] == recorded["result"]["verdict"]
    assert recorded["server"].stats()["total_requests"] == before  # nothing reached it
    res = cli("receipt", "compare", str(run), str(replayed), env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    a, b = (json.loads((d / "receipt.json").read_text()) for d in (run, replayed))
    # every outcome digest but the one over all inputs, which names the upstreams
    assert {k: v for k, v in a["outcome"].items() if k != "inputs"} == {
        k: v for k, v in b["outcome"].items() if k != "inputs"}
    assert a["identities"] == b["identities"]  # the judge included
    assert a["usage"] == b["usage"]  # the same reported usage, so the same costs
    replay_recs = records(replayed)
    assert [r.provider for r in replay_recs] == ["replay"] * len(replay_recs)
    assert sorted(r.request_sha256 for r in replay_recs) == sorted(
        r.request_sha256 for r in records(run))
