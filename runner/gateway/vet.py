"""Request vetting and worst-case cost (pure; SPEC §4).

A request reaches an upstream only with fields on an allowlist, every token-limit key
at or under the role's cap (the cap is filled in when none is named, so the worst case
is always known), ``n`` within the policy, no remote content the upstream would fetch,
and no built-in tools unless the policy opts in. What is refused is named by field.

The worst case bounds input tokens by the request's byte length: every tokenizer in
use maps at least one byte of text to a token, and the JSON framing of a message is
longer than the template tokens it becomes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.gateway.config import Price, RequestRules

BASE_FIELDS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "stop", "stream", "stream_options", "presence_penalty", "frequency_penalty", "seed",
    "response_format", "logprobs", "top_logprobs", "logit_bias", "n", "user",
    "reasoning_effort", "verbosity"})
"""Fields that change neither who pays nor what the upstream fetches."""
TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
TOKEN_KEYS = ("max_tokens", "max_completion_tokens")
MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
PART_TYPES = frozenset({"text", "image_url", "refusal"})
TEMPLATE_MARGIN_TOKENS = 64
"""Priming tokens a chat template may add beyond the request's bytes."""


class Refusal(Exception):
    """A request the gateway will not forward; ``code`` is the recorded reason."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Vetted:
    body: dict[str, Any]
    """The body to send upstream (token cap filled in, stream usage requested)."""
    choices: int
    """Completions the upstream may generate (max of n and best_of)."""
    max_tokens: int
    """Completion tokens per choice, at most."""
    images: int


def _int_field(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        if key in TOKEN_KEYS:
            raise Refusal(400, "max_tokens_over_cap", f"{key}={v!r} exceeds the cap {hi} "
                                                      f"(an integer from {lo} to {hi})")
        raise Refusal(400, f"{key}_not_allowed", f"{key}={v!r} is not allowed: it must be "
                                                 f"an integer from {lo} to {hi} "
                                                 "(policy: rules.max_n)")
    return v


def _check_messages(messages: Any, rules: RequestRules) -> int:
    if not isinstance(messages, list) or not messages:
        raise Refusal(400, "bad_request", "messages must be a non-empty list")
    images = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in MESSAGE_ROLES:
            raise Refusal(400, "bad_request", f"messages[{i}] needs a role in "
                                              f"{sorted(MESSAGE_ROLES)}")
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in PART_TYPES:
                raise Refusal(400, "content_part_not_allowed",
                              f"{where}: type {kind!r} is not allowed; allowed: "
                              f"{sorted(PART_TYPES)}")
            if kind != "image_url":
                continue
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str) or not url.startswith("data:"):
                raise Refusal(400, "remote_content_not_allowed",
                              f"{where}: only inline data: images can be sent; the upstream "
                              "would fetch a remote URL on the role's behalf")
            if not rules.allow_images:
                raise Refusal(400, "images_not_allowed",
                              f"{where}: image input is off for this role (rules.allow_images)")
            images += 1
    return images


def vet(body: dict[str, Any], *, rules: RequestRules, cap: int) -> Vetted:
    """Check a parsed request against the allowlist and the token cap; Refusal names why."""
    allowed = BASE_FIELDS | set(rules.extra_fields) | (TOOL_FIELDS if rules.allow_tools
                                                       else frozenset())
    extra = sorted(set(body) - allowed)
    if extra:
        raise Refusal(400, "field_not_allowed",
                      f"field {extra[0]!r} is not forwarded for this role; allowed fields: "
                      f"{sorted(allowed)} (policy: rules.extra_fields, rules.allow_tools)")
    images = _check_messages(body.get("messages"), rules)
    if rules.allow_tools and body.get("tools") is not None:
        tools = body["tools"]
        if not isinstance(tools, list) or any(
                not isinstance(t, dict) or t.get("type") != "function" for t in tools):
            raise Refusal(400, "tool_not_allowed",
                          "only function tools are forwarded; built-in tools (web search, "
                          "file search, code interpreter) are refused")
    limits = [v for k in TOKEN_KEYS if (v := _int_field(body, k, 1, cap)) is not None]
    out = dict(body)
    if not limits:
        out[rules.token_limit_key] = cap
    n = _int_field(body, "n", 1, rules.max_n) or 1
    best_of = _int_field(body, "best_of", n, rules.max_n) if "best_of" in body else None
    if body.get("stream") is True:
        opts = body.get("stream_options")
        out["stream_options"] = {**(opts if isinstance(opts, dict) else {}),
                                 "include_usage": True}
    elif "stream" in body and body["stream"] not in (False, None):
        raise Refusal(400, "bad_request", "stream must be true or false")
    return Vetted(body=out, choices=max(n, best_of or 1), max_tokens=max(limits or [cap]),
                  images=images)


def worst_case_usd(request_bytes: int, v: Vetted, price: Price, rules: RequestRules) -> float:
    """Most a call can cost: every byte an input token, every choice at max_tokens."""
    tokens_in = request_bytes + TEMPLATE_MARGIN_TOKENS + v.images * rules.image_token_bound
    tokens_out = v.choices * v.max_tokens
    return (tokens_in * price.input_per_mtok + tokens_out * price.output_per_mtok) / 1e6
