"""Response inspection and the scripted provider (pure parts of the gateway)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from runner.errors import ConfigError
from runner.gateway.config import Price
from runner.gateway.providers import ScriptedProvider, inspect_completion, inspect_stream
from runner.gateway.server import cost_usd


def test_inspect_completion() -> None:
    ok = json.dumps({"choices": [{"message": {"content": "x"}}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
    usage, err = inspect_completion(ok)
    assert err is None and usage is not None and usage.total_tokens == 7
    assert inspect_completion(b"<html>") == (None, "malformed_response")
    assert inspect_completion(b'{"choices": []}') == (None, "malformed_response")
    assert inspect_completion(b'{"choices": [{}], "x": NaN}') == (None, "malformed_response")
    usage, err = inspect_completion(b'{"choices": [{}]}')
    assert usage is None and err is None  # no usage: the caller treats cost as unknown


def test_inspect_stream() -> None:
    good = (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
            b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n'
            b"data: [DONE]\n\n")
    usage, err = inspect_stream(good)
    assert err is None and usage is not None and usage.completion_tokens == 2
    assert inspect_stream(good[: good.index(b"data: [DONE]")])[1] == "truncated_stream"
    assert inspect_stream(b"data: {nope\n\ndata: [DONE]\n\n")[1] == "malformed_response"


def test_cost_unknown_never_zero() -> None:
    from runner.gateway.calllog import Usage

    u = Usage(prompt_tokens=1_000_000, completion_tokens=500_000, total_tokens=1_500_000)
    assert cost_usd(u, Price(input_per_mtok=2.0, output_per_mtok=4.0)) == 4.0
    assert cost_usd(None, Price(input_per_mtok=2.0, output_per_mtok=4.0)) is None
    assert cost_usd(u, None) is None


def _script(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


def test_scripted_rules_and_determinism(tmp_path: Path) -> None:
    p = _script(tmp_path, """
schema: 1
rules:
  - when: {role: worker, contains: ["ALWAYS"]}
    reply_json: {files: [], rationale: r}
  - when: {last_user_regex: "^q\\\\d+$"}
    reply: numbered
""")
    prov = ScriptedProvider(p)
    body = {"model": "m", "messages": [{"role": "system", "content": "ALWAYS cite"},
                                       {"role": "user", "content": "q1"}]}
    req = json.dumps(body).encode()
    r1 = asyncio.run(prov.call(req, body, role="worker", stream=False))
    r2 = asyncio.run(prov.call(req, body, role="worker", stream=False))
    assert r1.response == r2.response and r1.fixture
    assert json.loads(json.loads(r1.response or b"")["choices"][0]["message"]["content"]) == {
        "files": [], "rationale": "r"}
    r3 = asyncio.run(prov.call(req, body, role="analyst", stream=True))
    assert r3.error is None and b"numbered" in (r3.response or b"")
    miss = {"model": "m", "messages": [{"role": "user", "content": "other"}]}
    r4 = asyncio.run(prov.call(b"{}", miss, role="analyst", stream=False))
    assert r4.error == "script_no_match"


def test_script_errors_name_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rules\[0\]\.when"):
        ScriptedProvider(_script(tmp_path, "schema: 1\nrules:\n  - when: {regex: x}\n"
                                            "    reply: y\n"))
    with pytest.raises(ConfigError, match="schema"):
        ScriptedProvider(_script(tmp_path, "rules: []\n"))
