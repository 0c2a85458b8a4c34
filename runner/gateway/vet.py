"""Request vetting and worst-case cost, per API family (pure; SPEC §4).

A request reaches an upstream only with fields on its family's allowlist, every
token-limit key at or under the role's cap (the cap is filled in, in the family's own
key, when none is named, so the worst case is always known), ``n`` within the policy,
no remote content the upstream would fetch (URLs, stored files, server-side tools,
server-held conversation state, background jobs) and no function tools unless the
policy opts in. Every refusal names the field and the policy place that changes it.

Each family is described once, in :data:`FAMILIES`; the checks that differ (content
parts, tools) are small functions named after the family.

The worst case bounds input tokens by the request's byte length: every tokenizer in
use maps at least one byte of text to a token, and the JSON framing of a message is
longer than the template tokens it becomes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from runner.gateway.config import Price, RequestRules

Api = Literal["chat", "responses", "embeddings", "messages", "count_tokens"]
ROUTES: dict[str, Api] = {
    "/v1/chat/completions": "chat", "/v1/responses": "responses",
    "/v1/embeddings": "embeddings", "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens"}
"""POST routes -> API family."""
TEMPLATE_MARGIN_TOKENS = 64
"""Priming tokens a chat template may add beyond the request's bytes."""
TOOL_PROMPT_TOKENS = 600
"""Input tokens a provider adds to a request that offers tools, beyond their bytes:
Anthropic's tool-use system prompt is 346 tokens (Claude 4, tool_choice auto) and was up
to 530 (Claude 3 Opus)."""
SERVER_STATE = ("previous_response_id", "conversation", "prompt")
"""Responses fields that make the upstream read state the gateway cannot bound or replay."""


class Refusal(Exception):
    """A request the gateway will not forward; ``code`` is the recorded reason."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param


@dataclass(frozen=True)
class Vetted:
    body: dict[str, Any]
    """The body to send upstream (token cap filled in, stream usage requested)."""
    choices: int
    """Completions the upstream may generate (max of n and best_of)."""
    max_tokens: int
    """Output tokens per choice, at most (0 for embeddings and token counting)."""
    images: int
    documents: int = 0
    """Inline files read page by page (PDFs), each reserved at document_token_bound."""
    cache_1h: bool = False
    """A ``cache_control`` asks for Anthropic's 1-hour cache (writes at its own price), in
    any family: an OpenAI-compatible router may pass it on to Anthropic."""
    tools: bool = False
    """The request offers tools (reserved with :data:`TOOL_PROMPT_TOKENS` more input)."""


@dataclass
class _Ctx:
    """What the checks need to name the policy place in a refusal."""

    rules: RequestRules
    where: str
    """e.g. ``upstreams.target.rules`` (the policy place of this role's rules)."""
    images: int = 0
    documents: int = 0

    def place(self, key: str) -> str:
        return f"{self.where}.{key} in cycle.yaml"


def _refuse(code: str, param: str, message: str, status: int = 400) -> Refusal:
    return Refusal(status, code, message, param)


def _remote(ctx: _Ctx, where: str, what: str) -> Refusal:
    return _refuse("remote_content_not_allowed", where,
                   f"{where}: {what} cannot be sent: the upstream would fetch or read it on "
                   "the role's behalf, outside the gateway's bounds and record; send the "
                   "content inline")


def _image(ctx: _Ctx, where: str, url: Any) -> None:
    if not isinstance(url, str) or not url.startswith("data:"):
        raise _remote(ctx, where, "a remote or stored image")
    media = url[5:].split(",", 1)[0].split(";", 1)[0].strip().lower()
    if not media.startswith("image/"):
        # a PDF (or any file) in an image's place: some OpenAI-compatible routers read it
        # as a document, billed by the page, so it is one here (reserved and allowed so)
        _document(ctx, where)
        return
    if not ctx.rules.allow_images:
        raise _refuse("images_not_allowed", where,
                      f"{where}: image input is off for this role "
                      f"({ctx.place('allow_images')})")
    ctx.images += 1


def _document(ctx: _Ctx, where: str) -> None:
    """An inline file the upstream reads page by page: its bytes do not bound its tokens."""
    if not ctx.rules.allow_documents:
        raise _refuse("documents_not_allowed", where,
                      f"{where}: inline files (PDFs) are off for this role: their pages are "
                      f"billed beyond their bytes; turn them on with "
                      f"{ctx.place('allow_documents')} (each reserved at "
                      f"document_token_bound tokens)")
    ctx.documents += 1


# -- per-family content -----------------------------------------------------------
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
CHAT_PARTS = frozenset({"text", "image_url", "refusal"})


def _chat_content(body: dict[str, Any], ctx: _Ctx) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _refuse("bad_request", "messages", "messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise _refuse("bad_request", f"messages[{i}]",
                          f"messages[{i}] needs a role in {sorted(CHAT_ROLES)}")
        if m.get("audio") is not None:
            raise _refuse("server_state_not_allowed", f"messages[{i}].audio",
                          f"messages[{i}].audio names audio the upstream keeps from an "
                          "earlier answer, which the gateway can neither bound nor replay")
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in CHAT_PARTS:
                raise _refuse("content_part_not_allowed", where,
                              f"{where}: type {kind!r} is not allowed; allowed: "
                              f"{sorted(CHAT_PARTS)}")
            if kind == "image_url":
                image = part.get("image_url")
                _image(ctx, where, image.get("url") if isinstance(image, dict) else image)


RESPONSES_ITEMS = frozenset({"message", "function_call", "function_call_output", "reasoning"})
RESPONSES_ROLES = frozenset({"user", "assistant", "system", "developer"})
RESPONSES_PARTS = frozenset({"input_text", "output_text", "text", "refusal", "input_image",
                             "input_file", "summary_text", "reasoning_text"})


def _responses_parts(parts: Any, where: str, ctx: _Ctx,
                     allowed: frozenset[str] = RESPONSES_PARTS) -> None:
    if not isinstance(parts, list):
        return
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            w = f"{where}[{j}]"
            raise _refuse("content_part_not_allowed", w,
                          f"{w}: type {kind!r} is not allowed; allowed: {sorted(allowed)}")
        if kind not in ("input_image", "input_file"):
            continue
        w = f"{where}[{j}]"
        assert isinstance(part, dict)  # noqa: S101 - kind came from it
        if kind == "input_image":
            if part.get("file_id") is not None:
                raise _remote(ctx, w, "a stored file (file_id)")
            _image(ctx, w, part.get("image_url"))
        elif kind == "input_file":
            if part.get("file_id") is not None or part.get("file_url") is not None:
                raise _remote(ctx, w, "a stored or remote file (file_id/file_url)")
            if not isinstance(part.get("file_data"), str):
                raise _refuse("bad_request", w, f"{w}: input_file needs inline file_data")
            _document(ctx, w)


def _responses_content(body: dict[str, Any], ctx: _Ctx) -> None:
    for key in SERVER_STATE:
        if body.get(key) is not None:
            raise _refuse("server_state_not_allowed", key,
                          f"{key} makes the upstream use state it keeps (earlier responses, "
                          "conversations, stored prompts) that the gateway can neither bound "
                          "nor replay; send the whole input instead")
    if body.get("background") is not None and body["background"] is not False:
        raise _refuse("background_not_allowed", "background",
                      "background: true runs the call detached from this request, beyond the "
                      "call deadline and the record; send it in the foreground")
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        raise _refuse("bad_request", "instructions", "instructions must be a string (a "
                      "list may name items the upstream keeps)")
    items = body.get("input")
    if isinstance(items, str):
        return
    if not isinstance(items, list) or not items:
        raise _refuse("bad_request", "input", "input must be a string or a non-empty list")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _refuse("bad_request", where, f"{where} must be an object")
        kind = item.get("type", "message")
        if kind not in RESPONSES_ITEMS:
            raise _refuse("input_item_not_allowed", where,
                          f"{where}: item type {kind!r} is not allowed (stored items and "
                          f"server-side tool calls are refused); allowed: "
                          f"{sorted(RESPONSES_ITEMS)}")
        if kind == "message":
            if item.get("role") not in RESPONSES_ROLES:
                # {"id": ...} alone is an item reference (runner.gateway.items resolves
                # this container's own); a message without a role is not one to forward
                raise _refuse("bad_request", f"{where}.role",
                              f"{where}: a message needs a role in {sorted(RESPONSES_ROLES)}")
            _responses_parts(item.get("content"), f"{where}.content", ctx)
        elif kind == "function_call_output":
            _responses_parts(item.get("output"), f"{where}.output", ctx)
        elif kind == "reasoning":  # its text only: no item or file reached through it
            _responses_parts(item.get("summary"), f"{where}.summary", ctx,
                             frozenset({"summary_text"}))
            _responses_parts(item.get("content"), f"{where}.content", ctx,
                             frozenset({"reasoning_text"}))


ANTHROPIC_BLOCKS = frozenset({"text", "image", "document", "tool_use", "tool_result",
                              "thinking", "redacted_thinking"})
INLINE_SOURCES = frozenset({"base64", "text", "content"})


def _anthropic_blocks(blocks: Any, where: str, ctx: _Ctx) -> None:
    if not isinstance(blocks, list):
        return
    for j, block in enumerate(blocks):
        w = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in ANTHROPIC_BLOCKS:
            raise _refuse("content_part_not_allowed", w,
                          f"{w}: block type {kind!r} is not allowed (server tool results and "
                          f"uploads are refused); allowed: {sorted(ANTHROPIC_BLOCKS)}")
        assert isinstance(block, dict)  # noqa: S101 - kind came from it
        if kind in ("image", "document"):
            source = block.get("source")
            stype = source.get("type") if isinstance(source, dict) else None
            if stype not in INLINE_SOURCES:
                raise _remote(ctx, f"{w}.source", f"a {stype!r} source (URL or stored file)")
            if kind == "image":
                assert isinstance(source, dict)  # noqa: S101 - its type was read above
                media = source.get("media_type")
                _image(ctx, w, f"data:{media if isinstance(media, str) else ''}")
            elif stype == "base64":
                _document(ctx, w)
            elif stype == "content":
                _anthropic_blocks(source.get("content") if isinstance(source, dict) else None,
                                  f"{w}.source.content", ctx)
        elif kind == "tool_result":
            _anthropic_blocks(block.get("content"), f"{w}.content", ctx)


def _messages_content(body: dict[str, Any], ctx: _Ctx) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _refuse("bad_request", "messages", "messages must be a non-empty list")
    for i, m in enumerate(messages):
        # A system message among the messages (Claude Code sends its environment so) is
        # input text like any other: counted in the worst case, nothing fetched.
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise _refuse("bad_request", f"messages[{i}]",
                          f"messages[{i}] needs a role, user, assistant or system")
        _anthropic_blocks(m.get("content"), f"messages[{i}].content", ctx)
    _anthropic_blocks(body.get("system"), "system", ctx)
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("budget_tokens") is not None:
        budget = thinking["budget_tokens"]
        cap = body.get("max_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1 or (
                isinstance(cap, int) and budget > cap):
            raise _refuse("max_tokens_over_cap", "thinking.budget_tokens",
                          f"thinking.budget_tokens={budget!r} must be an integer from 1 to "
                          f"max_tokens ({cap}); thinking is counted within max_tokens")


def _embeddings_content(body: dict[str, Any], ctx: _Ctx) -> None:
    inp = body.get("input")
    if isinstance(inp, str) and inp:
        return
    if not isinstance(inp, list) or not inp or not all(
            isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool))
            or (isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in x)) for x in inp):
        raise _refuse("bad_request", "input", "input must be a string, a list of strings, "
                                              "or token lists")


# -- tools ---------------------------------------------------------------------------
def _openai_tool(t: Any) -> bool:
    return isinstance(t, dict) and t.get("type") == "function"


def _responses_tool(t: Any) -> bool:
    # A namespace groups function tools under one name (Codex CLI sends its sub-agent
    # tools so); every tool in it runs on the caller's side like any function tool.
    if isinstance(t, dict) and t.get("type") == "namespace":
        tools = t.get("tools")
        return isinstance(tools, list) and bool(tools) and all(map(_openai_tool, tools))
    return _openai_tool(t)


def _anthropic_tool(t: Any) -> bool:
    # Custom (client-executed) tools have no type or type "custom"; every typed tool
    # (web_search_*, web_fetch_*, code_execution_*, computer_*, bash_*, text_editor_*,
    # memory_*, mcp ...) is one the upstream or a beta feature runs.
    return isinstance(t, dict) and t.get("type") in (None, "custom") and "input_schema" in t


BETA_HINT = {
    "context_management": (
        ": a beta field (server-side context editing), and the gateway forwards no "
        "anthropic-beta header, since a beta can switch on upstream behaviour it cannot "
        "bound; Claude Code sends none with CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS=1"),
}
"""Why a field an agent sends by default is refused, and its own switch for it."""


# -- the families --------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """Everything that differs between API families, in one place."""

    api: Api
    fields: frozenset[str]
    """Top-level fields forwarded; any other is refused."""
    tool_fields: frozenset[str]
    """Forwarded only when rules.allow_tools."""
    token_keys: tuple[str, ...]
    """Output-cap spellings; each must be within the cap."""
    content: Callable[[dict[str, Any], _Ctx], None]
    tool_ok: Callable[[Any], bool] = _openai_tool
    cap_key: str | None = None
    """Key the cap is written to when none is given (None: rules.token_limit_key)."""
    output: bool = True
    """False: the call produces no output tokens (embeddings, token counting)."""
    n: bool = False
    """Whether ``n``/``best_of`` exist in this family."""
    tiers: frozenset[str] = field(default_factory=frozenset)
    """service_tier values that do not change the price."""


FAMILIES: dict[Api, Family] = {
    "chat": Family(
        "chat", frozenset({
            "model", "messages", "max_tokens", "max_completion_tokens", "temperature",
            "top_p", "stop", "stream", "stream_options", "presence_penalty",
            "frequency_penalty", "seed", "response_format", "logprobs", "top_logprobs",
            "logit_bias", "n", "user", "reasoning_effort", "verbosity", "service_tier"}),
        frozenset({"tools", "tool_choice", "parallel_tool_calls"}),
        ("max_tokens", "max_completion_tokens"), _chat_content, n=True,
        tiers=frozenset({"default", "flex"})),
    "responses": Family(
        "responses", frozenset({
            "model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
            "stream", "stream_options", "text", "reasoning", "metadata", "store", "user",
            "truncation", "include", "top_logprobs", "service_tier", "prompt_cache_key",
            "safety_identifier", "previous_response_id", "conversation", "background",
            "prompt", "client_metadata"}),
        frozenset({"tools", "tool_choice", "parallel_tool_calls"}),
        ("max_output_tokens",), _responses_content, tool_ok=_responses_tool,
        cap_key="max_output_tokens", tiers=frozenset({"default", "flex"})),
    "embeddings": Family(
        "embeddings", frozenset({"model", "input", "dimensions", "encoding_format", "user"}),
        frozenset(), (), _embeddings_content, output=False),
    "messages": Family(
        "messages", frozenset({
            "model", "messages", "max_tokens", "system", "temperature", "top_p", "top_k",
            "stop_sequences", "stream", "metadata", "thinking", "output_config",
            "cache_control", "service_tier", "speed"}),
        frozenset({"tools", "tool_choice"}), ("max_tokens",), _messages_content,
        tool_ok=_anthropic_tool, cap_key="max_tokens",
        tiers=frozenset({"standard_only"})),
    "count_tokens": Family(
        "count_tokens", frozenset({"model", "messages", "system", "thinking", "output_config",
                                   "cache_control"}),
        frozenset({"tools", "tool_choice"}), (), _messages_content, tool_ok=_anthropic_tool,
        output=False),
}


def _int_field(body: dict[str, Any], key: str, lo: int, hi: int, place: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        if key in ("n", "best_of"):
            raise _refuse(f"{key}_not_allowed", key,
                          f"{key}={v!r} is not allowed: it must be an integer from {lo} to "
                          f"{hi} ({place})")
        raise _refuse("max_tokens_over_cap", key,
                      f"{key}={v!r} exceeds the cap {hi} (an integer from {lo} to {hi}; "
                      f"{place})")
    return v


@functools.lru_cache(maxsize=256)
def _allowed(fam: Family, extra_fields: tuple[str, ...], allow_tools: bool) -> frozenset[str]:
    """The top-level fields forwarded for a family under one role's rules (built once)."""
    return fam.fields | frozenset(extra_fields) | (fam.tool_fields if allow_tools
                                                   else frozenset())


def vet(body: dict[str, Any], *, rules: RequestRules, cap: int, api: Api = "chat",
        where: str = "rules") -> Vetted:
    """Check a parsed request of family ``api`` against its allowlist and the token cap;
    Refusal names the field and the policy place (``where``: e.g. upstreams.NAME.rules)."""
    fam = FAMILIES[api]
    ctx = _Ctx(rules, where)
    allowed = _allowed(fam, rules.extra_fields, rules.allow_tools)
    if not allowed.issuperset(body):
        key = sorted(set(body) - allowed)[0]
        if key in fam.tool_fields:
            raise _refuse("tools_not_allowed", key,
                          f"field {key!r}: tools are off for this role; turn them on with "
                          f"{ctx.place('allow_tools')}")
        raise _refuse("field_not_allowed", key,
                      f"field {key!r} is not forwarded for this role ({api})"
                      f"{BETA_HINT.get(key, '')}; allowed fields: {sorted(allowed)} "
                      f"({ctx.place('extra_fields')})")
    tier = body.get("service_tier")
    if tier is not None and tier not in fam.tiers and "service_tier" not in rules.extra_fields:
        raise _refuse("service_tier_not_allowed", "service_tier",
                      f"service_tier={tier!r} may change the price the budget reserved; "
                      f"allowed: {sorted(fam.tiers)} (or add service_tier to "
                      f"{ctx.place('extra_fields')})")
    if body.get("speed") not in (None, "standard") and "speed" not in rules.extra_fields:
        raise _refuse("speed_not_allowed", "speed",
                      f"speed={body['speed']!r} changes the price; only 'standard' "
                      f"({ctx.place('extra_fields')})")
    if body.get("tools") is not None:
        tools = body["tools"]
        if not isinstance(tools, list):
            raise _refuse("bad_request", "tools", "tools must be a list")
        for i, t in enumerate(tools):
            if not fam.tool_ok(t):
                kind = t.get("type") if isinstance(t, dict) else None
                raise _refuse("tool_not_allowed", f"tools[{i}]",
                              f"tools[{i}]: type {kind!r} is not a function tool; server-side "
                              "tools (web search, web fetch, file search, code interpreter, "
                              "computer use, MCP, ...) are never forwarded")
    caps = [v for k in fam.token_keys if k in body
            and (v := _int_field(body, k, 1, cap, f"upstream max_tokens; "
                                 f"{ctx.where.removesuffix('.rules')}.max_tokens in cycle.yaml"))
            is not None]
    out = dict(body)
    if fam.output and not caps:
        key = fam.cap_key or rules.token_limit_key
        out[key] = cap
        caps = [cap]
    fam.content(out, ctx)
    n, best_of = 1, None
    if fam.n:
        n = (_int_field(body, "n", 1, rules.max_n, ctx.place("max_n")) if "n" in body
             else None) or 1
        if "best_of" in body:
            best_of = _int_field(body, "best_of", n, rules.max_n, ctx.place("max_n"))
    stream = body.get("stream")
    if stream is True and api in ("chat",):
        opts = body.get("stream_options")
        out["stream_options"] = {**(opts if isinstance(opts, dict) else {}),
                                 "include_usage": True}
    elif stream is not None and type(stream) is not bool:  # 1 == True in Python, not JSON
        raise _refuse("bad_request", "stream", "stream must be true or false")
    elif stream is True and not fam.output:
        raise _refuse("bad_request", "stream", f"{api} does not stream")
    thinking = body.get("thinking")
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    per_choice = max([*caps, budget if isinstance(budget, int) else 0]) if fam.output else 0
    return Vetted(body=out, choices=max(n, best_of or 1), max_tokens=per_choice,
                  images=ctx.images, documents=ctx.documents,
                  cache_1h=fam.output and _asks_1h_cache(out), tools=bool(out.get("tools")))


def _asks_1h_cache(body: object) -> bool:
    """Any ``cache_control`` in the request (system, messages, tools) with a ttl other
    than the default five minutes (depth is bounded: the request was parsed strictly)."""
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            cc = item.get("cache_control")
            if isinstance(cc, dict) and cc.get("ttl") not in (None, "5m"):
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def worst_case_usd(request_bytes: int, v: Vetted, price: Price, rules: RequestRules, *,
                   stored_tokens: int = 0) -> float:
    """Most a call can cost: every byte an input token at the dearest input price (cache
    writes can cost more than plain input), each inline image and document at its token
    bound, what the upstream may read by the item ids sent (``stored_tokens``,
    :class:`runner.gateway.items.Resolution`), every choice at max_tokens."""
    tokens_in = (request_bytes + TEMPLATE_MARGIN_TOKENS + TOOL_PROMPT_TOKENS * v.tools
                 + v.images * rules.image_token_bound
                 + v.documents * rules.document_token_bound + stored_tokens)
    tokens_out = v.choices * v.max_tokens
    return (tokens_in * price.max_input_per_mtok(cache_1h=v.cache_1h)
            + tokens_out * price.output_per_mtok) / 1e6
