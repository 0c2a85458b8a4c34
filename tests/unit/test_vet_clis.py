"""What Codex CLI 0.171.0 and Claude Code 2.1.332 really send, pinned from captures
(tests/fixtures/clis/: their first request, by default and through the wrapper
templates), against the gateway's allowlists: what carries only ids or input text
passes, what an upstream would run or a beta would switch on is refused by name."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from runner.gateway.config import RequestRules
from runner.gateway.vet import Refusal, vet

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "clis"
RULES = RequestRules(allow_tools=True)


def _body(name: str) -> dict[str, Any]:
    with gzip.open(FIXTURES / f"{name}.json.gz", "rt") as f:
        body: dict[str, Any] = json.load(f)["body"]
    return body


def _refusal(body: dict[str, Any], api: str, cap: int = 200_000) -> Refusal:
    with pytest.raises(Refusal) as got:
        vet(body, rules=RULES, cap=cap, api=api)  # type: ignore[arg-type]
    return got.value


def test_codex_through_the_wrapper_passes_as_sent() -> None:
    body = _body("codex-0.171.0-wrapper")
    assert {"client_metadata", "prompt_cache_key", "include", "reasoning", "store"} <= set(body)
    # recorded as sent upstream: the gateway had filled in its cap (128000)
    v = vet(body, rules=RULES, cap=128000, api="responses")
    assert v.body == body


def test_codex_by_default_sends_a_hosted_web_search_the_gateway_refuses() -> None:
    body = _body("codex-0.171.0-responses")
    kinds = [t["type"] for t in body["tools"]]
    assert "web_search" in kinds and "namespace" in kinds
    err = _refusal(body, "responses")
    assert err.code == "tool_not_allowed" and "web_search" in err.message
    assert err.param == f"tools[{kinds.index('web_search')}]"
    # without it (web_search = "disabled" in config.toml) the rest passes: the
    # namespace holds function tools only, client_metadata carries ids only
    body["tools"] = [t for t in body["tools"] if t["type"] != "web_search"]
    v = vet(body, rules=RULES, cap=1024, api="responses")
    assert v.body["max_output_tokens"] == 1024


def test_a_namespace_passes_only_with_function_tools_in_it() -> None:
    body = _body("codex-0.171.0-responses")
    body["tools"] = [t for t in body["tools"] if t["type"] == "namespace"]
    bad = copy.deepcopy(body)
    bad["tools"][0]["tools"].append({"type": "web_search"})
    assert _refusal(bad, "responses").code == "tool_not_allowed"
    bad["tools"][0]["tools"] = []
    assert _refusal(bad, "responses").code == "tool_not_allowed"
    vet(body, rules=RULES, cap=1024, api="responses")


def test_claude_code_through_the_wrapper_passes_within_the_cap() -> None:
    body = _body("claude-code-2.1.332-wrapper")
    assert [m["role"] for m in body["messages"]] == ["user", "system"]
    assert body["max_tokens"] == 32000
    vet(body, rules=RULES, cap=32000, api="messages")
    err = _refusal(body, "messages", cap=4096)
    assert err.code == "max_tokens_over_cap" and err.param == "max_tokens"


def test_claude_code_by_default_sends_a_beta_field_refused_with_its_switch_named() -> None:
    body = _body("claude-code-2.1.332-messages")
    err = _refusal(body, "messages")
    assert err.code == "field_not_allowed" and err.param == "context_management"
    assert "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS=1" in err.message
    del body["context_management"]
    vet(body, rules=RULES, cap=200_000, api="messages")
    body["messages"][0]["role"] = "tool"
    assert _refusal(body, "messages").param == "messages[0]"
