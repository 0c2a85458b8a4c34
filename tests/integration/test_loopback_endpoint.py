"""The in-container model endpoint: unmodified SDKs, no argument, inside a real hardened
analyst container, through the holder's loopback relay to the container's own gateway
binding (scripted upstream, offline)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runner.gateway.calllog import CallLog
from runner.gateway.server import Gateway
from runner.isolation.docker.images import resolve_image
from runner.isolation.launcher import launch
from runner.isolation.policy import RolePolicies
from runner.isolation.sandbox import RunRecord, StopReason

pytestmark = pytest.mark.docker

SDKS = """
import asyncio, json, os
import anthropic, openai
out = {"token_is_key": os.environ["OPENAI_API_KEY"] == os.environ["ANTHROPIC_API_KEY"]
       == open("/run/cyclebox/gateway/token").read().strip(),
       "urls": [os.environ[k] for k in ("OPENAI_BASE_URL", "OPENAI_API_BASE",
                                         "ANTHROPIC_BASE_URL", "CYCLEBOX_GATEWAY_URL")]}
msgs = [{"role": "user", "content": "ping"}]
out["sync"] = openai.OpenAI().chat.completions.create(
    model="fixture-target", messages=msgs).choices[0].message.content
out["sync_stream"] = "".join(ch.choices[0].delta.content or "" for ch in
    openai.OpenAI().chat.completions.create(model="fixture-target", messages=msgs,
                                            stream=True) if ch.choices)

async def in_async():
    async with openai.AsyncOpenAI() as c:
        r = await c.chat.completions.create(model="fixture-target", messages=msgs)
        return r.choices[0].message.content
out["async"] = asyncio.run(in_async())
try:
    m = anthropic.Anthropic().messages.create(model="fixture-target", max_tokens=64,
                                              messages=msgs)
    out["anthropic"] = ["ok", "".join(b.text for b in m.content if b.type == "text")]
except anthropic.APIStatusError as e:
    out["anthropic"] = [e.status_code, e.body]
from sandbox.gateway_client import client
out["socket"] = client().chat.completions.create(
    model="fixture-target", messages=msgs).choices[0].message.content
print(json.dumps(out))
"""


def run_analyst(gw: Gateway, policies: RolePolicies, backend: Any, code: str,
                **kw: Any) -> RunRecord:
    return launch(backend, policies.roles["analyst"], role="analyst", run_id="loopback",
                  image=resolve_image("analyst"), command=["python", "-c", code],
                  gateway=gw, stage="baseline", case="c1", trial=0, **kw)


def test_unmodified_sdks_reach_the_gateway_by_environment_alone(
        tmp_path: Path, policies: RolePolicies, upstreams: dict[str, Any],
        backend: Any) -> None:
    with Gateway(tmp_path, "loopback", dict(upstreams), {"analyst": "target"}) as gw:
        rec = run_analyst(gw, policies, backend, SDKS)
        calls = gw.calls("baseline", "c1", 0)
    assert rec.stop_reason is StopReason.OK, rec.stderr_tail
    out = json.loads(rec.stdout_tail)
    assert out["token_is_key"] is True
    assert out["urls"] == ["http://127.0.0.1:40080/v1", "http://127.0.0.1:40080/v1",
                           "http://127.0.0.1:40080", "http://127.0.0.1:40080"]
    assert out["sync"] == out["sync_stream"] == out["async"] == out["socket"] == "pong"
    # anthropic.Anthropic() on Messages, answered by the scripted upstream (the gateway's
    # /v1/messages route); every call is in this container's binding
    assert out["anthropic"] == ["ok", "pong"]
    recs = CallLog(tmp_path / "gateway").records()
    assert recs == calls  # the same records, on disk and in the binding's index
    got = [(r.role, r.stage, r.case, r.trial, r.status, r.error, r.stream, r.api)
           for r in recs]
    assert got == [
        ("analyst", "baseline", "c1", 0, "ok", None, False, "chat"),      # openai.OpenAI()
        ("analyst", "baseline", "c1", 0, "ok", None, True, "chat"),       # stream=True
        ("analyst", "baseline", "c1", 0, "ok", None, False, "chat"),      # AsyncOpenAI()
        ("analyst", "baseline", "c1", 0, "ok", None, False, "messages"),  # Anthropic()
        ("analyst", "baseline", "c1", 0, "ok", None, False, "chat"),      # gateway_client
    ]
    assert [r.turn for r in recs] == [0, 1, 2, 3, 4]
