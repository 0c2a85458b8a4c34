"""The gateway as role containers see it: real Docker, the real openai SDK inside.

The OpenAI-compatible upstream runs in its own container started with testcontainers,
its port published on 127.0.0.1 only; it records the Authorization header and the
sha256 of every body it receives.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runner.gateway.calllog import CallLog, sha256
from runner.gateway.config import CredentialSource, UpstreamPolicy, parse_upstream
from runner.gateway.server import Gateway
from runner.isolation.docker.images import resolve_image
from runner.isolation.launcher import launch
from runner.isolation.policy import RolePolicies
from runner.isolation.sandbox import Mount, RunRecord, StopReason

pytestmark = pytest.mark.docker
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SCRIPT = Path(__file__).resolve().parents[2] / "policies" / "scripts" / "default.yaml"


@pytest.fixture(scope="module")
def upstream_url() -> Iterator[str]:
    os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
    from testcontainers.core.container import DockerContainer

    c = (DockerContainer(resolve_image("analyst"))
         .with_command(["python", "/srv/fake_upstream.py", "8000"])
         .with_volume_mapping(str(FIXTURES), "/srv", "ro")
         .with_kwargs(labels={"io.cyclebox.test": "fake-upstream"}))
    c.ports["8000/tcp"] = ("127.0.0.1", None)  # loopback only, never all interfaces
    c.start()
    try:
        port = int(c.get_exposed_port(8000))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url + "/_received", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        bindings = c.get_wrapped_container().attrs["HostConfig"]["PortBindings"]
        assert bindings["8000/tcp"][0]["HostIp"] == "127.0.0.1"
        yield url
    finally:
        c.stop()


def received(url: str) -> list[dict[str, Any]]:
    return json.loads(urllib.request.urlopen(url + "/_received", timeout=5).read())  # type: ignore[no-any-return]


def openai_upstream(url: str, env: str, **kw: Any) -> UpstreamPolicy:
    models = ["ok-model", "fail-500", "fail-timeout", "fail-garbage", "fail-truncated"]
    return parse_upstream({
        "provider": "openai", "base_url": url + "/v1", "credential": {"env": env},
        "models": models, "prices": {m: {"input_per_mtok": 1, "output_per_mtok": 2}
                                     for m in models}, **kw})


def run_in_role(gw: Gateway, policies: RolePolicies, backend: Any, role: str, code: str, *,
                mounts: tuple[Mount, ...] = (), during: Any = None) -> RunRecord:
    """Run python code in a role container with that role's gateway socket mounted."""
    def run() -> RunRecord:
        return launch(backend, policies.roles[role], role=role, run_id="gwtest",
                      image=resolve_image(role), command=["python", "-c", code],
                      mounts=mounts, gateway=gw, stage="test", case="c1", trial=0)

    if during is None:
        return run()
    box: list[RunRecord] = []
    t = threading.Thread(target=lambda: box.append(run()))
    t.start()
    during()
    t.join()
    return box[0]


CALL = """
import json, sys
from sandbox.gateway_client import client
c = client()
out = {}
for model, stream in %s:
    try:
        if stream:
            text = "".join((ch.choices[0].delta.content or "") for ch in
                           c.chat.completions.create(model=model, stream=True,
                               messages=[{"role": "user", "content": "ping"}]) if ch.choices)
        else:
            text = c.chat.completions.create(model=model,
                messages=[{"role": "user", "content": "ping"}]).choices[0].message.content
        out[model + (":stream" if stream else "")] = text
    except Exception as e:
        out[model + (":stream" if stream else "")] = "ERR %%s %%s" %% (
            type(e).__name__, getattr(e, "status_code", ""))
print(json.dumps(out))
"""


def test_scripted_provider_from_inside_a_container(tmp_path: Path, policies: RolePolicies,
                                                   upstreams: dict[str, Any],
                                                   backend: Any) -> None:
    with Gateway(tmp_path, "gwtest", dict(upstreams), {"analyst": "target"}) as gw:
        rec = run_in_role(gw, policies, backend, "analyst",
                          CALL % "[('fixture-target', False), ('fixture-target', True)]")
    assert rec.stop_reason is StopReason.OK, rec.stderr_tail
    out = json.loads(rec.stdout_tail)
    assert out["fixture-target"] == "pong"
    assert out["fixture-target:stream"] == "pong"
    recs = CallLog(tmp_path / "gateway").records()
    got = [(r.role, r.upstream, r.case, r.trial, r.turn, r.fixture, r.stream) for r in recs]
    assert got == [("analyst", "target", "c1", 0, 0, True, False),
                   ("analyst", "target", "c1", 0, 1, True, True)]


def test_real_upstream_gets_real_key_and_exact_bytes(tmp_path: Path, policies: RolePolicies,
                                                     backend: Any, upstream_url: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    key = "sk-live-" + os.urandom(12).hex()
    monkeypatch.setenv("CBX_TARGET_KEY", key)
    before = len(received(upstream_url))
    with Gateway(tmp_path, "gwtest", {"target": openai_upstream(upstream_url, "CBX_TARGET_KEY")},
                 {"analyst": "target"}) as gw:
        rec = run_in_role(gw, policies, backend, "analyst",
                          CALL % "[('ok-model', False), ('ok-model', True)]")
    assert rec.stop_reason is StopReason.OK, rec.stderr_tail
    out = json.loads(rec.stdout_tail)
    assert out == {"ok-model": "hello from ok-model", "ok-model:stream": "hello"}
    got = received(upstream_url)[before:]
    assert [g["auth"] for g in got] == [f"Bearer {key}"] * 2
    recs = CallLog(tmp_path / "gateway").records()
    assert [r.request_sha256 for r in recs] == [g["sha256"] for g in got]
    log = CallLog(tmp_path / "gateway")
    for r in recs:
        assert sha256(log.blob(r.request_sha256)) == r.request_sha256
        assert r.usage is not None and r.cost_usd == pytest.approx((11 * 1 + 7 * 2) / 1e6)


SCAN = """
import os, json
marker = "cbx" + "canary"
hits = []
for k, v in os.environ.items():
    if marker in k or marker in v: hits.append("env:" + k)
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            if marker.encode() in open("/proc/%s/environ" % pid, "rb").read():
                hits.append("environ:" + pid)
        except OSError: pass
scanned = 0
for root, dirs, files in os.walk("/"):
    if root == "/":
        dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev")]
    for f in files:
        p = os.path.join(root, f)
        try:
            if os.path.islink(p) or os.path.getsize(p) > 64 << 20: continue
            with open(p, "rb") as fh:
                if marker.encode() in fh.read(): hits.append("file:" + p)
            scanned += 1
        except OSError: pass
from sandbox.gateway_client import client
text = client().chat.completions.create(model="ok-model",
    messages=[{"role": "user", "content": "hi"}]).choices[0].message.content
print(json.dumps({"hits": hits, "scanned": scanned, "reply": text}))
import time; time.sleep(3)
"""


def test_canary_key_never_reaches_the_container(tmp_path: Path, policies: RolePolicies,
                                                backend: Any, upstream_url: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    canary = "sk-cbxcanary-" + os.urandom(12).hex()
    keyfile = tmp_path / "keys" / "target.key"
    keyfile.parent.mkdir()
    keyfile.write_text(canary + "\n")
    monkeypatch.setenv("CBX_CANARY_ENV", canary)  # also planted in the host environment
    up = openai_upstream(upstream_url, "unused").model_copy(
        update={"credential": CredentialSource(file=str(keyfile))})
    inspected: list[str] = []

    def inspect_while_running() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ids = subprocess.run(
                ["docker", "ps", "-q", "--filter", "label=io.cyclebox.run_id=gwtest"],
                capture_output=True, text=True, check=True).stdout.split()
            if ids:
                inspected.append(subprocess.run(["docker", "inspect", *ids], capture_output=True,
                                                text=True, check=True).stdout)
                return
            time.sleep(0.1)

    before = len(received(upstream_url))
    with Gateway(tmp_path / "run", "gwtest", {"target": up}, {"analyst": "target"}) as gw:
        rec = run_in_role(gw, policies, backend, "analyst", SCAN, during=inspect_while_running)
    assert rec.stop_reason is StopReason.OK, rec.stderr_tail
    result = json.loads(rec.stdout_tail)
    assert result["scanned"] > 1000, "the scan must actually read the filesystem"
    assert result["hits"] == []
    assert result["reply"] == "hello from ok-model"
    assert canary not in rec.stdout_tail + rec.stderr_tail
    assert inspected and "gwtest" in inspected[0]
    assert canary not in inspected[0] and "cbxcanary" not in inspected[0]
    for f in (tmp_path / "run").rglob("*"):
        if f.is_file():
            assert canary.encode() not in f.read_bytes(), f"canary in {f}"
    assert [g["auth"] for g in received(upstream_url)[before:]] == [f"Bearer {canary}"]


def test_foreign_token_and_model_refused(tmp_path: Path, policies: RolePolicies,
                                         upstreams: dict[str, Any], backend: Any) -> None:
    alien = tmp_path / "alien"
    alien.mkdir()
    with Gateway(tmp_path / "run", "gwtest", dict(upstreams),
                 {"analyst": "target", "worker": "optimizer"}) as gw:
        (alien / "token").write_text(gw.token_for("analyst"))
        os.chmod(alien, 0o755)
        os.chmod(alien / "token", 0o644)
        code = """
import json, openai
from sandbox.gateway_client import client
c = client()
alien = openai.OpenAI(api_key=open("/alien/token").read(), base_url="http://gw/v1",
                      http_client=c._client, max_retries=0)
out = {}
try:
    alien.chat.completions.create(model="fixture-optimizer",
                                  messages=[{"role":"user","content":"x"}])
    out["alien"] = "accepted"
except openai.AuthenticationError as e:
    out["alien"] = e.status_code
try:
    c.chat.completions.create(model="fixture-target", messages=[{"role":"user","content":"x"}])
    out["model"] = "accepted"
except openai.PermissionDeniedError as e:
    out["model"] = e.status_code
out["own"] = c.chat.completions.create(model="fixture-optimizer",
    messages=[{"role":"user","content":"ping"}]).choices[0].message.content
print(json.dumps(out))
"""
        rec = run_in_role(gw, policies, backend, "worker", code,
                          mounts=(Mount(source=alien, target="/alien"),))
    assert rec.stop_reason is StopReason.OK, rec.stderr_tail
    assert json.loads(rec.stdout_tail) == {"alien": 401, "model": 403, "own": "pong"}
    recs = CallLog(tmp_path / "run" / "gateway").records()
    assert [(r.role, r.status, r.error) for r in recs] == [
        ("worker", "refused", "bad_token"), ("worker", "refused", "model_not_allowed"),
        ("worker", "ok", None)]
    assert recs[2].upstream == "optimizer"


@pytest.mark.parametrize(("model", "stream", "error"), [
    ("fail-500", False, "upstream_status_500"),
    ("fail-timeout", False, "upstream_timeout"),
    ("fail-garbage", False, "malformed_response"),
    ("fail-truncated", True, "truncated_stream"),
])
def test_upstream_failures_are_recorded_once(tmp_path: Path, policies: RolePolicies,
                                             backend: Any, upstream_url: str, model: str,
                                             stream: bool, error: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CBX_FAIL_KEY", "sk-fail")
    before = [g for g in received(upstream_url) if g["model"] == model]
    with Gateway(tmp_path, "gwtest",
                 {"target": openai_upstream(upstream_url, "CBX_FAIL_KEY", timeout_s=1)},
                 {"analyst": "target"}) as gw:
        rec = run_in_role(gw, policies, backend, "analyst", CALL % f"[({model!r}, {stream})]")
    assert rec.stop_reason is StopReason.OK, rec.stderr_tail
    out = json.loads(rec.stdout_tail)
    (reply,) = out.values()
    assert reply.startswith("ERR ") and "502" in reply
    recs = CallLog(tmp_path / "gateway").records()
    assert [(r.status, r.error) for r in recs] == [("infra_error", error)]
    # no usage, admitted at a known worst case: charged that upper bound (never zero)
    assert recs[0].cost_basis == "upper_bound" and recs[0].cost_usd
    time.sleep(0.2 if model != "fail-timeout" else 5)
    after = [g for g in received(upstream_url) if g["model"] == model]
    assert len(after) - len(before) == 1, "exactly one upstream request, never a retry"
