"""Upstream providers: ``openai`` (any OpenAI-compatible server), ``scripted`` (offline
fixtures) and ``replay`` (byte-exact answers from a recorded call log).

All three return the same :class:`ProviderResult`; none retries. The real key lives
only inside :class:`OpenAIProvider` on the host.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runner.errors import ConfigError, OutputRejected
from runner.gateway.calllog import CallLog, Usage, sha256
from runner.gateway.upstream_http import UpstreamError, client_for
from runner.isolation.collect import loads_strict


@dataclass(frozen=True)
class ProviderResult:
    """What came back from upstream (or why nothing usable did)."""

    http_status: int | None
    response: bytes | None
    """Exact response bytes as received (None when nothing was received)."""
    error: str | None = None
    """Named infra error; None when the response is a well-formed completion."""
    usage: Usage | None = None
    fixture: bool = False
    upstream_reached: bool = True
    """False when no upstream was contacted (script miss, replay miss): nothing can have
    been charged, so the cost is a known zero rather than unknown."""


class Provider(Protocol):
    name: str

    async def call(self, request: bytes, body: dict[str, Any], *, role: str,
                   stream: bool) -> ProviderResult: ...

    async def aclose(self) -> None: ...


# -- response inspection (pure) --------------------------------------------------
def _usage(obj: Any) -> Usage | None:
    if not isinstance(obj, dict):
        return None
    try:
        return Usage(prompt_tokens=int(obj["prompt_tokens"]),
                     completion_tokens=int(obj["completion_tokens"]),
                     total_tokens=int(obj.get("total_tokens",
                                              obj["prompt_tokens"] + obj["completion_tokens"])))
    except (KeyError, TypeError, ValueError):
        return None


def inspect_completion(data: bytes) -> tuple[Usage | None, str | None]:
    """(usage, error) for a non-streamed chat completion body."""
    try:
        obj = loads_strict(data, source="upstream response")
    except OutputRejected:
        return None, "malformed_response"
    if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list) or not obj["choices"]:
        return None, "malformed_response"
    return _usage(obj.get("usage")), None


def sse_events(data: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    events = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        if line.startswith("data:"):
            events.append(line[5:].strip())
    return events


def inspect_stream(data: bytes) -> tuple[Usage | None, str | None]:
    """(usage, error) for a streamed (SSE) completion: it must end with [DONE]."""
    events = sse_events(data)
    if not events or events[-1] != "[DONE]":
        return None, "truncated_stream"
    usage = None
    for ev in events[:-1]:
        try:
            obj = loads_strict(ev, source="upstream stream chunk")
        except OutputRejected:
            return None, "malformed_response"
        if not isinstance(obj, dict):
            return None, "malformed_response"
        usage = _usage(obj.get("usage")) or usage
    return usage, None


def inspect(data: bytes, *, stream: bool) -> tuple[Usage | None, str | None]:
    return inspect_stream(data) if stream else inspect_completion(data)


# -- openai ----------------------------------------------------------------------
class OpenAIProvider:
    """Forwards the exact request bytes to an OpenAI-compatible server with the real key.

    The client (:mod:`upstream_http`) sends the bytes unchanged, so the recorded request
    is byte-for-byte what the upstream received; no retries, no redirects.
    """

    name = "openai"

    def __init__(self, base_url: str, key: str, *, timeout_s: float, max_response: int) -> None:
        self._client = client_for(base_url, read_timeout=timeout_s, max_response=max_response)
        self._key = key

    async def call(self, request: bytes, body: dict[str, Any], *, role: str,
                   stream: bool) -> ProviderResult:
        headers = {"Authorization": f"Bearer {self._key}", "Content-Type": "application/json",
                   "Accept": "text/event-stream" if stream else "application/json"}
        try:
            status, data = await self._client.post("chat/completions", request, headers)
        except UpstreamError as exc:
            if exc.kind == "response_too_large":
                return ProviderResult(exc.status, exc.partial, exc.kind)
            kind = "truncated_stream" if stream and exc.kind == "upstream_disconnected" \
                else exc.kind
            return ProviderResult(None, None, kind)
        if status != 200:
            return ProviderResult(status, data, f"upstream_status_{status}")
        usage, error = inspect(data, stream=stream)
        return ProviderResult(status, data, error, usage)

    async def aclose(self) -> None:
        await self._client.aclose()


# -- scripted ----------------------------------------------------------------------
def _text_of(body: dict[str, Any]) -> tuple[str, str]:
    """(all message text, last user message text)."""
    parts, last_user = [], ""
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        text = str(content or "")
        parts.append(text)
        if m.get("role") == "user":
            last_user = text
    return "\n".join(parts), last_user


@dataclass(frozen=True)
class ScriptRule:
    reply: str
    role: str | None = None
    model: str | None = None
    contains: tuple[str, ...] = ()
    not_contains: tuple[str, ...] = ()
    last_user_contains: tuple[str, ...] = ()
    last_user_regex: str | None = None

    def matches(self, role: str, model: str, text: str, last_user: str) -> bool:
        return ((self.role is None or self.role == role)
                and (self.model is None or self.model == model)
                and all(c in text for c in self.contains)
                and not any(c in text for c in self.not_contains)
                and all(c in last_user for c in self.last_user_contains)
                and (self.last_user_regex is None
                     or re.search(self.last_user_regex, last_user) is not None))


class ScriptWhen(BaseModel):
    """When a rule applies: every condition given must hold (an empty ``when`` always does)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    role: str | None = None
    """The calling role: analyst, worker or evaluator."""
    model: str | None = None
    """The requested model name."""
    contains: tuple[str, ...] = ()
    """Strings that must all occur in the request's messages (any role, joined)."""
    not_contains: tuple[str, ...] = ()
    """Strings none of which may occur in the request's messages."""
    last_user_contains: tuple[str, ...] = ()
    """Strings that must all occur in the last user message."""
    last_user_regex: str | None = None
    """A regular expression that must match (re.search) the last user message."""

    @field_validator("last_user_regex")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return v


class ScriptReply(BaseModel):
    """A reply: exactly one of ``reply`` (text) or ``reply_json`` (sent as compact JSON)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    reply: str | None = None
    """The assistant message's text, verbatim."""
    reply_json: Any = None
    """Any JSON value, sent as its compact serialisation (keys sorted)."""

    @model_validator(mode="after")
    def _one(self) -> ScriptReply:
        if (self.reply is None) == (self.reply_json is None):
            raise ValueError("give exactly one of reply or reply_json")
        if self.reply_json is not None:
            try:
                json.dumps(self.reply_json, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"reply_json must be plain JSON data: {exc}") from None
        return self

    def text(self) -> str:
        if self.reply is not None:
            return self.reply
        return json.dumps(self.reply_json, separators=(",", ":"), sort_keys=True)


class ScriptRuleSpec(ScriptReply):
    """One rule: the first rule (in file order) whose ``when`` matches gives the reply."""

    when: ScriptWhen = ScriptWhen()
    """The conditions; omitted: always matches."""


class ScriptFile(BaseModel):
    """A scripted-provider file: offline, deterministic model replies (marked fixture)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    schema_: int = Field(alias="schema")
    """File format version; this code reads version 1."""
    rules: tuple[ScriptRuleSpec, ...] = ()
    """Tried in order; the first match answers."""
    default: ScriptReply | None = None
    """The reply when no rule matches; none: the call fails as ``script_no_match``."""


def load_script(path: Path, *, ref: tuple[str, str] | None = None
                ) -> tuple[list[ScriptRule], str | None]:
    """Rules and the default reply of a scripted-provider file (runner.loading rules)."""
    from runner.loading import load_model

    doc = load_model(path, ScriptFile, fmt="yaml", what="script", ref=ref, schema=1,
                     fix="a mapping with schema: 1, rules: [{when: {...}, reply: TEXT}], "
                     "default: {reply: TEXT}")
    rules = [ScriptRule(reply=r.text(), role=r.when.role, model=r.when.model,
                        contains=r.when.contains, not_contains=r.when.not_contains,
                        last_user_contains=r.when.last_user_contains,
                        last_user_regex=r.when.last_user_regex) for r in doc.rules]
    return rules, (doc.default.text() if doc.default else None)


def _tokens(text: str) -> int:
    return max(1, math.ceil(len(text.encode()) / 4))


def scripted_body(request: bytes, body: dict[str, Any], reply: str, *, stream: bool) -> bytes:
    """A deterministic chat completion (or SSE stream) carrying ``reply``, marked fixture."""
    text, _ = _text_of(body)
    usage = {"prompt_tokens": _tokens(text), "completion_tokens": _tokens(reply)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    rid = "chatcmpl-fixture-" + sha256(request)[:24]
    base = {"id": rid, "created": 0, "model": body.get("model"),
            "system_fingerprint": "cyclebox-scripted-fixture"}
    if not stream:
        obj = {**base, "object": "chat.completion", "usage": usage,
               "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                            "message": {"role": "assistant", "content": reply}}]}
        return json.dumps(obj, separators=(",", ":")).encode()
    pieces = [reply[i:i + 64] for i in range(0, len(reply), 64)] or [""]
    events = []
    for n, piece in enumerate(pieces):
        delta: dict[str, Any] = {"content": piece}
        if n == 0:
            delta["role"] = "assistant"
        events.append({**base, "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    events.append({**base, "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events.append({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
    out = "".join(f"data: {json.dumps(e, separators=(',', ':'))}\n\n" for e in events)
    return (out + "data: [DONE]\n\n").encode()


class ScriptedProvider:
    """Offline, deterministic replies from a script file; every record says fixture."""

    name = "scripted"

    def __init__(self, script: Path) -> None:
        self.rules, self.default = load_script(script)

    async def call(self, request: bytes, body: dict[str, Any], *, role: str,
                   stream: bool) -> ProviderResult:
        text, last_user = _text_of(body)
        model = str(body.get("model"))
        reply = next((r.reply for r in self.rules if r.matches(role, model, text, last_user)),
                     self.default)
        if reply is None:
            return ProviderResult(None, None, "script_no_match", fixture=True,
                                  upstream_reached=False)
        data = scripted_body(request, body, reply, stream=stream)
        usage, error = inspect(data, stream=stream)
        return ProviderResult(200, data, error, usage, fixture=True)

    async def aclose(self) -> None:
        return None


# -- replay ------------------------------------------------------------------------
class ReplayProvider:
    """Answers byte-exactly from a recorded run by request hash; a miss fails closed."""

    name = "replay"

    def __init__(self, run_dir: Path) -> None:
        self.log = CallLog(run_dir / "gateway") if (run_dir / "gateway").is_dir() else None
        if self.log is None or not self.log.index.exists():
            raise ConfigError(f"no recorded call log under {run_dir}/gateway",
                              field="replay_from", fix="point to a finished run directory")
        self.index: dict[str, tuple[int | None, str, bool]] = {}
        for rec in self.log.records():
            if rec.response_sha256 and rec.request_sha256 not in self.index:
                self.index[rec.request_sha256] = (rec.http_status, rec.response_sha256,
                                                  rec.fixture)

    async def call(self, request: bytes, body: dict[str, Any], *, role: str,
                   stream: bool) -> ProviderResult:
        hit = self.index.get(sha256(request))
        if hit is None:
            return ProviderResult(None, None, "replay_miss", upstream_reached=False)
        status, digest, fixture = hit
        assert self.log is not None  # noqa: S101 - checked in __init__
        data = self.log.blob(digest)
        if status != 200:
            return ProviderResult(status, data, f"upstream_status_{status}", fixture=fixture)
        usage, error = inspect(data, stream=stream)
        return ProviderResult(status, data, error, usage, fixture=fixture)

    async def aclose(self) -> None:
        return None
