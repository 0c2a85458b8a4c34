"""Upstream providers: ``openai`` (any OpenAI-compatible server), ``scripted`` (offline
fixtures) and ``replay`` (byte-exact answers from a recorded call log).

All three return the same :class:`ProviderResult`; none retries. The real key lives
only inside :class:`OpenAIProvider` on the host.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runner.errors import ConfigError
from runner.gateway import scripted_wire as wire
from runner.gateway import usage as _usage_mod
from runner.gateway.calllog import (
    ALL_APIS,
    ANTHROPIC_APIS,
    OPENAI_APIS,
    Api,
    CallLog,
    Usage,
    sha256,
)
from runner.gateway.replay_key import stable_key
from runner.gateway.scripted_wire import Answer
from runner.gateway.upstream_http import UpstreamError, client_for


@dataclass(frozen=True)
class ProviderResult:
    """What came back from upstream (or why nothing usable did)."""

    http_status: int | None
    response: bytes | None
    """Exact response bytes as received (None when nothing was received)."""
    error: str | None = None
    """Named infra error; None when the response is a well-formed completion (a 200
    answer: once :func:`inspected` parsed it)."""
    usage: Usage | None = None
    """Set by :func:`inspected`."""
    fixture: bool = False
    upstream_reached: bool = True
    """False when no upstream was contacted (script miss, replay miss): nothing can have
    been charged, so the cost is a known zero rather than unknown."""
    replay_of: str | None = None
    """Replay only: sha256 of the recorded request whose response answered this call."""


@dataclass(frozen=True)
class CallSite:
    """Where a call comes from: its container's binding and its turn on that socket."""

    role: str
    stage: str
    case: str | None
    trial: int | None
    turn: int


class Provider(Protocol):
    name: str
    apis: frozenset[str]
    """API families this provider answers (no translation between families)."""

    async def call(self, request: bytes, body: dict[str, Any], *, role: str,
                   stream: bool, site: CallSite | None = None,
                   api: Api = "chat") -> ProviderResult: ...

    async def aclose(self) -> None: ...


# -- response inspection (pure): runner.gateway.usage --------------------------------
sse_events = _usage_mod.sse_events


def inspect(data: bytes, *, stream: bool, api: Api = "chat",
            asked_1h: bool = False) -> tuple[Usage | None, str | None]:
    return _usage_mod.inspect(data, stream=stream, api=api, asked_1h=asked_1h)


def inspected(result: ProviderResult, *, stream: bool, api: Api,
              asked_1h: bool = False) -> ProviderResult:
    """``result`` with the usage its answer reports and the error it shows (a cut stream,
    a malformed body): providers return a 200 answer unparsed, and the gateway parses it
    here, on its pool when it is large (pure; a 16 MB answer takes seconds)."""
    if result.http_status != 200 or result.error is not None or result.response is None:
        return result
    usage, error = inspect(result.response, stream=stream, api=api, asked_1h=asked_1h)
    return dataclasses.replace(result, usage=usage, error=error)


# -- openai ----------------------------------------------------------------------
class OpenAIProvider:
    """Forwards the exact request bytes to an OpenAI-compatible server with the real key.

    The client (:mod:`upstream_http`) sends the bytes unchanged, so the recorded request
    is byte-for-byte what the upstream received; no retries, no redirects.
    """

    name = "openai"
    apis = OPENAI_APIS
    paths: ClassVar[dict[str, str]] = {"chat": "chat/completions", "responses": "responses",
                                       "embeddings": "embeddings"}

    def __init__(self, base_url: str, key: str, *, timeout_s: float, max_response: int) -> None:
        self._client = client_for(base_url, read_timeout=timeout_s, max_response=max_response)
        self._key = key

    def headers(self, stream: bool) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._key}", "Content-Type": "application/json",
                "Accept": "text/event-stream" if stream else "application/json"}

    async def call(self, request: bytes, body: dict[str, Any], *, role: str,
                   stream: bool, site: CallSite | None = None,
                   api: Api = "chat") -> ProviderResult:
        try:
            status, data = await self._client.post(self.paths[api], request,
                                                   self.headers(stream))
        except UpstreamError as exc:
            if exc.kind == "response_too_large":
                return ProviderResult(exc.status, exc.partial, exc.kind)
            kind = "truncated_stream" if stream and exc.kind == "upstream_disconnected" \
                else exc.kind
            return ProviderResult(None, None, kind)
        if status != 200:
            return ProviderResult(status, data, f"upstream_status_{status}")
        return ProviderResult(status, data)

    async def aclose(self) -> None:
        await self._client.aclose()


class AnthropicProvider(OpenAIProvider):
    """Forwards the exact request bytes to Anthropic's Messages API with the real key in
    ``x-api-key`` and the policy's ``anthropic-version``; the client's own headers are
    never forwarded (the request is rebuilt from the body alone)."""

    name = "anthropic"
    apis = ANTHROPIC_APIS
    paths: ClassVar[dict[str, str]] = {"messages": "v1/messages",
                                       "count_tokens": "v1/messages/count_tokens"}

    def __init__(self, base_url: str, key: str, *, version: str, timeout_s: float,
                 max_response: int) -> None:
        super().__init__(base_url, key, timeout_s=timeout_s, max_response=max_response)
        self._version = version

    def headers(self, stream: bool) -> dict[str, str]:
        return {"x-api-key": self._key, "anthropic-version": self._version,
                "Content-Type": "application/json",
                "Accept": "text/event-stream" if stream else "application/json"}


# -- scripted ----------------------------------------------------------------------
def _flat(content: Any) -> str:
    """Text of a content value of any family: a string, or parts/blocks with text,
    tool-call arguments or inputs, and nested tool-result content."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    out = []
    for p in content:
        if not isinstance(p, dict):
            continue
        if isinstance(p.get("text"), str):
            out.append(p["text"])
        if p.get("type") == "tool_use":
            out.append(json.dumps(p.get("input"), sort_keys=True))
        if p.get("type") == "tool_result":
            out.append(_flat(p.get("content")))
    return "".join(out)


@dataclass(frozen=True)
class RequestText:
    """What script rules look at in a request of any family."""

    text: str
    """All text: messages, tool results and tool-call arguments, joined."""
    last_user: str
    tool_result: bool
    """The request's last input item is a tool result."""


def request_text(body: dict[str, Any], api: Api = "chat") -> RequestText:
    parts: list[str] = []
    last_user, tool_result = "", False
    if api in ("chat", "messages", "count_tokens"):
        if api != "chat":
            parts.append(_flat(body.get("system")))
        for m in body.get("messages") or []:
            if not isinstance(m, dict):
                continue
            text = _flat(m.get("content"))
            for call in m.get("tool_calls") or []:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict):
                    text += str(fn.get("arguments", ""))
            parts.append(text)
            content = m.get("content")
            blocks = content if isinstance(content, list) else []
            results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
            tool_result = m.get("role") == "tool" or (m.get("role") == "user" and bool(results))
            if m.get("role") == "user" and not (results and len(results) == len(blocks)):
                last_user = _flat([b for b in blocks if b not in results]) if blocks else text
    elif api == "responses":
        parts.append(str(body.get("instructions") or ""))
        items = body.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        for it in items if isinstance(items, list) else []:
            if not isinstance(it, dict):
                continue
            kind = it.get("type", "message")
            text = (_flat(it.get("content")) if kind == "message"
                    else str(it.get("arguments", "")) if kind == "function_call"
                    else _flat(it.get("output")) if kind == "function_call_output" else "")
            parts.append(text)
            tool_result = kind == "function_call_output"
            if kind == "message" and it.get("role") == "user":
                last_user = text
    else:
        raw = body.get("input")
        parts.extend(x for x in (raw if isinstance(raw, list) else [raw]) if isinstance(x, str))
    return RequestText("\n".join(p for p in parts if p), last_user, tool_result)


def _text_of(body: dict[str, Any]) -> tuple[str, str]:
    """(all message text, last user message text) of a chat request."""
    t = request_text(body, "chat")
    return t.text, t.last_user


@dataclass(frozen=True)
class ScriptRule:
    reply: str
    """The reply's text ("" for a tool call)."""
    role: str | None = None
    model: str | None = None
    contains: tuple[str, ...] = ()
    not_contains: tuple[str, ...] = ()
    last_user_contains: tuple[str, ...] = ()
    last_user_regex: str | None = None
    tool: str | None = None
    """Name of the function the reply calls (None: a text reply)."""
    arguments: str = "{}"
    tool_result: bool | None = None
    api: str | None = None

    def matches(self, role: str, model: str, text: str, last_user: str, *,
                api: str = "chat", tool_result: bool = False) -> bool:
        return ((self.role is None or self.role == role)
                and (self.model is None or self.model == model)
                and (self.api is None or self.api == api)
                and (self.tool_result is None or self.tool_result == tool_result)
                and all(c in text for c in self.contains)
                and not any(c in text for c in self.not_contains)
                and all(c in last_user for c in self.last_user_contains)
                and (self.last_user_regex is None
                     or re.search(self.last_user_regex, last_user) is not None))

    def answer(self) -> Answer:
        return Answer(text=self.reply, tool=self.tool, arguments=self.arguments)


class ScriptWhen(BaseModel):
    """When a rule applies: every condition given must hold (an empty ``when`` always does)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    role: Literal["analyst", "worker", "evaluator"] | None = None
    """The calling role: analyst, worker or evaluator."""
    model: str | None = None
    """The requested model name."""
    api: Literal["chat", "responses", "messages"] | None = None
    """The API family called (chat completions, responses, Anthropic messages)."""
    tool_result: bool | None = None
    """Whether the request's last input item is a tool result (chat: a ``tool`` message;
    responses: a ``function_call_output`` item; messages: a user ``tool_result`` block)."""
    contains: tuple[str, ...] = ()
    """Strings that must all occur in the request's text (any message, tool results and
    tool-call arguments included)."""
    not_contains: tuple[str, ...] = ()
    """Strings none of which may occur in the request's text."""
    last_user_contains: tuple[str, ...] = ()
    """Strings that must all occur in the last user message's text."""
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


class ScriptToolCall(BaseModel):
    """A reply that asks for one function tool call."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    """The function's name."""
    arguments: dict[str, Any] = Field(default_factory=dict)
    """The call's arguments (a JSON object)."""


def _non_string_key(value: Any) -> object | None:
    """The first mapping key in ``value`` that is not a string, or None."""
    stack: list[Any] = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            for k, item in v.items():
                if not isinstance(k, str):
                    found: object = k
                    return found
                stack.append(item)
        elif isinstance(v, list | tuple):
            stack.extend(v)
    return None


class ScriptReply(BaseModel):
    """A reply: exactly one of ``reply`` (text), ``reply_json`` (sent as compact JSON) or
    ``tool_call`` (one function tool call, in the called family's own shape)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    reply: str | None = None
    """The assistant message's text, verbatim."""
    reply_json: Any = None
    """Any JSON value, sent as its compact serialisation (keys sorted)."""
    tool_call: ScriptToolCall | None = None
    """The assistant asks for this function call (chat ``tool_calls``, a responses
    ``function_call`` item, a messages ``tool_use`` block)."""

    @model_validator(mode="after")
    def _one(self) -> ScriptReply:
        given = [self.reply is not None, self.reply_json is not None,
                 self.tool_call is not None]
        if sum(given) != 1:
            raise ValueError("give exactly one of reply, reply_json or tool_call")
        for value in (self.reply_json, self.tool_call.arguments if self.tool_call else None):
            if value is not None:
                key = _non_string_key(value)
                if key is not None:
                    raise ValueError(
                        f"a mapping key {key!r} is not a string (YAML reads unquoted on, "
                        "off, yes, no, true, false and numbers as other types); quote it, "
                        "e.g. 'on':")
                try:
                    json.dumps(value, allow_nan=False, sort_keys=True)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"must be plain JSON data: {exc}") from None
        return self

    def text(self) -> str:
        if self.reply is not None:
            return self.reply
        if self.reply_json is None:
            return ""
        return json.dumps(self.reply_json, separators=(",", ":"), sort_keys=True)

    def arguments(self) -> str:
        args = self.tool_call.arguments if self.tool_call else {}
        return json.dumps(args, separators=(",", ":"), sort_keys=True)


class ScriptRuleSpec(ScriptReply):
    """One rule: the first rule (in file order) whose ``when`` matches gives the reply."""

    when: ScriptWhen = ScriptWhen()
    """The conditions; omitted: always matches."""


class ScriptDefault(ScriptReply):
    """The reply when no rule matches: text only."""

    @model_validator(mode="after")
    def _text_only(self) -> ScriptDefault:
        if self.tool_call is not None:
            raise ValueError("the default reply is text (reply or reply_json), not a tool_call")
        return self


class ScriptFile(BaseModel):
    """A scripted-provider file: offline, deterministic model replies (marked fixture)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    schema_: int = Field(alias="schema")
    """File format version; this code reads version 1."""
    rules: tuple[ScriptRuleSpec, ...] = ()
    """Tried in order; the first match answers."""
    default: ScriptDefault | None = None
    """The reply when no rule matches; none: the call fails as ``script_no_match``.
    Embeddings need no rule: their vectors derive from the input's sha256."""


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
                        last_user_regex=r.when.last_user_regex,
                        tool=r.tool_call.name if r.tool_call else None,
                        arguments=r.arguments(), tool_result=r.when.tool_result,
                        api=r.when.api) for r in doc.rules]
    return rules, (doc.default.text() if doc.default else None)


_tokens = wire.tokens


def scripted_body(request: bytes, body: dict[str, Any], reply: str | Answer, *,
                  stream: bool, api: Api = "chat") -> bytes:
    """A deterministic response of family ``api`` (or its SSE stream) carrying ``reply``."""
    a = reply if isinstance(reply, Answer) else Answer(text=reply)
    if api == "embeddings":
        return wire.embeddings(body)
    prompt = _tokens(request_text(body, api).text)
    if api == "count_tokens":
        return wire.count_tokens(prompt)
    build = {"chat": wire.chat, "responses": wire.responses, "messages": wire.messages}[api]
    return build(request, body, a, prompt, stream=stream)


class ScriptedProvider:
    """Offline, deterministic replies from a script file; every record says fixture."""

    name = "scripted"
    apis = ALL_APIS

    def __init__(self, script: Path) -> None:
        self.rules, self.default = load_script(script)

    async def call(self, request: bytes, body: dict[str, Any], *, role: str,
                   stream: bool, site: CallSite | None = None,
                   api: Api = "chat") -> ProviderResult:
        answer: Answer | None = Answer()
        if api in ("chat", "responses", "messages"):
            t = request_text(body, api)
            model = str(body.get("model"))
            rule = next((r for r in self.rules if r.matches(
                role, model, t.text, t.last_user, api=api, tool_result=t.tool_result)), None)
            answer = rule.answer() if rule else (
                Answer(text=self.default) if self.default is not None else None)
        if answer is None:
            return ProviderResult(None, None, "script_no_match", fixture=True,
                                  upstream_reached=False)
        data = scripted_body(request, body, answer, stream=stream, api=api)
        return ProviderResult(200, data, fixture=True)

    async def aclose(self) -> None:
        return None


# -- replay ------------------------------------------------------------------------
@dataclass(frozen=True)
class _Recorded:
    seq: int
    site: CallSite
    http_status: int | None
    response_sha256: str
    fixture: bool
    api: str | None = "chat"
    request_sha256: str = ""


class ReplayProvider:
    """Answers byte-exactly from a recorded run by request hash; a miss fails closed.

    The same request bytes can have been answered more than once, differently (a real
    server's ids and timestamps, a sampled reply per trial), so each call gets the
    recording made at its own call site (role, stage, case, trial, turn); failing that,
    the earliest recording of those bytes not yet replayed; once all are replayed, the
    first again. Serving the first recording to every duplicate made a replayed run's
    responses differ from the recorded ones.

    When the exact bytes miss, the same choice is made among the recordings whose
    request has the same :func:`runner.gateway.replay_key.stable_key` (the request
    without the per-run ids coding CLIs send, UUIDs masked); the response is still the
    recorded bytes, unchanged.
    """

    name = "replay"
    apis = ALL_APIS

    def __init__(self, run_dir: Path) -> None:
        self.log = CallLog.reader(run_dir / "gateway") if (run_dir / "gateway").is_dir() \
            else None
        if self.log is None or not self.log.index.exists():
            raise ConfigError(f"no recorded call log under {run_dir}/gateway",
                              field="replay_from", fix="point to a finished run directory")
        self.index: dict[str, list[_Recorded]] = {}
        """Request sha256 -> its recordings, in log order."""
        for rec in self.log.records():
            if rec.response_sha256:
                site = CallSite(rec.role, rec.stage, rec.case, rec.trial, rec.turn)
                self.index.setdefault(rec.request_sha256, []).append(_Recorded(
                    rec.seq, site, rec.http_status, rec.response_sha256, rec.fixture,
                    rec.api, rec.request_sha256))
        self._replayed: set[int] = set()
        self._stable: dict[str, list[_Recorded]] | None = None

    def _by_stable_key(self) -> dict[str, list[_Recorded]]:
        """Recordings by the stable key of their stored request (built on the first miss)."""
        if self._stable is None:
            assert self.log is not None  # noqa: S101 - checked in __init__
            self._stable = {}
            for digest, recs in self.index.items():
                key = stable_key(self.log.blob(digest), recs[0].api or "chat")
                if key is not None:
                    self._stable.setdefault(key, []).extend(recs)
            for recs in self._stable.values():
                recs.sort(key=lambda r: r.seq)
        return self._stable

    def pick(self, request_sha256: str, site: CallSite | None,
             api: str = "chat", request: bytes | None = None) -> _Recorded | None:
        """The recording of this family that answers this call (marked replayed); None on
        a miss. Synchronous, so calls on the gateway's one event loop never race for an
        entry."""
        recorded = [r for r in self.index.get(request_sha256, ()) if r.api == api]
        if not recorded and request is not None:
            key = stable_key(request, api)
            if key is not None:
                recorded = [r for r in self._by_stable_key().get(key, ()) if r.api == api]
        if not recorded:
            return None
        fresh = [r for r in recorded if r.seq not in self._replayed]
        hit = next((r for r in fresh if r.site == site), fresh[0] if fresh else recorded[0])
        self._replayed.add(hit.seq)
        return hit

    async def call(self, request: bytes, body: dict[str, Any], *, role: str,
                   stream: bool, site: CallSite | None = None,
                   api: Api = "chat") -> ProviderResult:
        hit = self.pick(sha256(request), site, api, request)
        if hit is None:
            return ProviderResult(None, None, "replay_miss", upstream_reached=False)
        assert self.log is not None  # noqa: S101 - checked in __init__
        data = self.log.blob(hit.response_sha256)
        if hit.http_status != 200:
            return ProviderResult(hit.http_status, data, f"upstream_status_{hit.http_status}",
                                  fixture=hit.fixture, replay_of=hit.request_sha256)
        return ProviderResult(hit.http_status, data, fixture=hit.fixture,
                              replay_of=hit.request_sha256)

    async def aclose(self) -> None:
        return None
