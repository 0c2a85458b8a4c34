"""One recorded model call as chat messages (SPEC §11: every API family is exported as chat
messages, tool calls kept).

:func:`transcript` turns a call's ``api``, exact request bytes, exact response bytes and
stream flag into the request's messages, its tools and the assistant's reply, all in
OpenAI chat-completions shape, which verl's and TRL's loaders and chat templates read:

- messages: ``{"role", "content": str}``; an assistant turn that calls tools also has
  ``"tool_calls": [{"id", "type": "function", "function": {"name", "arguments": str}}]``
  (arguments are JSON text, as on the chat wire); a tool result is
  ``{"role": "tool", "content": str, "tool_call_id"}``; ``developer`` becomes ``system``.
- tools: ``{"type": "function", "function": {"name", "description", "parameters"}}``.

Families (wire shapes as the ``openai`` and ``anthropic`` SDK types define them):
``chat`` (/v1/chat/completions; streamed replies reassembled from ``choices[].delta``,
tool-call deltas merged by ``index`` as the openai SDK does), ``responses``
(/v1/responses: ``instructions`` -> system, ``input`` string or items ``message`` /
``function_call`` / ``function_call_output``; the reply from ``output`` items, streamed:
``response.completed``'s response, else reassembled from the item and delta events) and
``messages`` (Anthropic /v1/messages: ``system`` string or text blocks, ``text``,
``tool_use`` -> ``tool_calls``, ``tool_result`` -> ``tool`` messages; streamed:
``content_block_start`` / ``content_block_delta`` (``text_delta``, ``input_json_delta``) /
``content_block_stop``). ``embeddings`` and ``count_tokens`` calls are not turns
(:data:`NOT_TURNS`).

Everything parsed is hostile: bytes are capped, JSON is strict (no duplicate keys, no
NaN, bounded depth), counts are capped, and a shape this module does not know gives a
named ``reason`` instead of an exception. Pure: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from runner.errors import OutputRejected
from runner.gateway.usage import sse_lines
from runner.isolation.collect import loads_strict

APIS = ("chat", "responses", "messages", "embeddings", "count_tokens")
NOT_TURNS = frozenset({"embeddings", "count_tokens"})
"""Calls that are not conversation turns: exported nowhere, counted."""
MAX_BYTES = 32 << 20
"""Largest request or response parsed; a larger one is a turn that did not parse."""
MAX_MESSAGES = 10_000
"""Messages (or input items, or content blocks) read from one request or reply."""
MAX_TOOL_CALLS = 512
"""Tool calls in one assistant message; also the bound on a streamed tool-call index."""
MAX_TOOLS = 1_024
"""Tools declared by one request."""
MAX_EVENTS = 1_000_000
"""Server-sent events read from one streamed reply."""

Message = dict[str, Any]


class Unparsed(Exception):
    """A recorded call whose shape this module does not read; ``reason`` names where."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Transcript:
    """One recorded call in chat shape. ``reason`` is None when request and reply both
    parsed; otherwise it names the first thing that did not (``messages``, ``tools`` or
    ``reply`` may then be partial or empty)."""

    api: str
    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    reply: Message | None = None
    """The assistant message the call returned (None without a usable response)."""
    reason: str | None = None


def _bad(reason: str) -> Unparsed:
    return Unparsed(reason)


def _name(v: object, limit: int = 40) -> str:
    """A hostile value shown in a reason: repr, capped, ASCII (escaped by json later)."""
    s = ascii(v)
    return s if len(s) <= limit else s[:limit] + "..."


def _json(data: bytes, what: str) -> Any:
    if len(data) > MAX_BYTES:
        raise _bad(f"{what}_too_large: {len(data)} bytes, over {MAX_BYTES}")
    try:
        return loads_strict(data, source=what)
    except OutputRejected:
        raise _bad(f"{what}_not_json") from None


def _obj(v: object, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _bad(f"{where}: expected an object, got {type(v).__name__}")
    return v


def _list(v: object, where: str, cap: int = MAX_MESSAGES) -> list[Any]:
    if not isinstance(v, list):
        raise _bad(f"{where}: expected a list, got {type(v).__name__}")
    if len(v) > cap:
        raise _bad(f"{where}: {len(v)} entries, over {cap}")
    return v


def _str(v: object, where: str) -> str:
    if not isinstance(v, str):
        raise _bad(f"{where}: expected a string, got {type(v).__name__}")
    return v


def _opt_str(v: object, where: str) -> str:
    return "" if v is None else _str(v, where)


def _as_json_text(v: object) -> str:
    return json.dumps(v, sort_keys=True, ensure_ascii=False)


def _args_text(v: object, where: str) -> str:
    """Tool-call arguments as JSON text (chat wire shape) from an object (Anthropic
    ``input``): compact, key order kept."""
    return json.dumps(_obj(v, where), ensure_ascii=False, separators=(",", ":"))


def _call(call_id: object, name: object, arguments: str, where: str) -> dict[str, Any]:
    return {"id": _opt_str(call_id, f"{where}.id"), "type": "function",
            "function": {"name": _str(name, f"{where}.name"), "arguments": arguments}}


def _assistant(content: str, calls: list[dict[str, Any]]) -> Message:
    m: Message = {"role": "assistant", "content": content}
    if calls:
        if len(calls) > MAX_TOOL_CALLS:
            raise _bad(f"reply: {len(calls)} tool calls, over {MAX_TOOL_CALLS}")
        m["tool_calls"] = calls
    return m


def _function_tool(name: object, description: object, parameters: object,
                   where: str) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": _str(name, f"{where}.name")}
    if description is not None:
        fn["description"] = _str(description, f"{where}.description")
    if parameters is not None:
        fn["parameters"] = _obj(parameters, f"{where}.parameters")
    return {"type": "function", "function": fn}


def _sse(data: bytes, what: str = "response") -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of each server-sent event; ``[DONE]`` ends the stream."""
    if len(data) > MAX_BYTES:
        raise _bad(f"{what}_too_large: {len(data)} bytes, over {MAX_BYTES}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad("stream_not_utf8") from None
    events: list[tuple[str | None, Any]] = []
    name: str | None = None
    buf: list[str] = []

    def flush() -> None:
        nonlocal name
        if buf:
            body = "\n".join(buf)
            buf.clear()
            if body.strip() != "[DONE]":
                if len(events) >= MAX_EVENTS:
                    raise _bad(f"stream: over {MAX_EVENTS} events")
                try:
                    events.append((name, loads_strict(body, source="stream event")))
                except OutputRejected:
                    raise _bad(f"stream_event_not_json (event {len(events)})") from None
        name = None

    for line in sse_lines(text):
        if not line:
            flush()
        elif line.startswith(":"):
            continue
        elif line.startswith("data:"):
            buf.append(line[5:].removeprefix(" "))
        elif line.startswith("event:"):
            name = line[6:].strip()
        # id:, retry: and unknown fields are ignored, as the SSE standard says
    flush()
    if not events:
        raise _bad("stream_without_events")
    return events


def _is_stream(response: bytes, stream: bool) -> bool:
    head = response.lstrip()[:16]
    return stream or head.startswith((b"data:", b"event:", b":"))


# -- chat completions ------------------------------------------------------------------


def _chat_content(c: object, where: str) -> str:
    """String content; text parts joined in order; any other content kept as JSON text."""
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    parts = _list(c, where)
    if all(isinstance(p, dict) and p.get("type") in ("text", "refusal") for p in parts):
        return "".join(_str(p.get("text", p.get("refusal")), f"{where}[{i}].text")
                       for i, p in enumerate(parts))
    return _as_json_text(parts)


def _chat_tool_calls(v: object, where: str) -> list[dict[str, Any]]:
    out = []
    for i, raw_tc in enumerate(_list(v, where, MAX_TOOL_CALLS)):
        w = f"{where}[{i}]"
        tc = _obj(raw_tc, w)
        if tc.get("type", "function") != "function":
            raise _bad(f"{w}.type {_name(tc.get('type'))} is not a function call")
        fn = _obj(tc.get("function"), f"{w}.function")
        out.append(_call(tc.get("id"), fn.get("name"),
                         _str(fn.get("arguments"), f"{w}.function.arguments"), w))
    return out


def chat_request(req: object) -> tuple[list[Message], list[dict[str, Any]]]:
    req = _obj(req, "request")
    msgs = _list(req.get("messages"), "request.messages")
    if not msgs:
        raise _bad("request.messages: empty")
    out: list[Message] = []
    for i, raw_m in enumerate(msgs):
        w = f"request.messages[{i}]"
        m = _obj(raw_m, w)
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise _bad(f"{w}.role {_name(role)} unsupported")
        content = _chat_content(m.get("content"), f"{w}.content")
        if role == "assistant":
            if m.get("content") is None and isinstance(m.get("refusal"), str):
                content = m["refusal"]  # a refusal sent back: its text, as chat_reply reads it
            if m.get("function_call") is not None:
                raise _bad(f"{w}.function_call (legacy functions) unsupported")
            calls = (_chat_tool_calls(m["tool_calls"], f"{w}.tool_calls")
                     if m.get("tool_calls") is not None else [])
            out.append(_assistant(content, calls))
        elif role == "tool":
            out.append({"role": "tool", "content": content,
                        "tool_call_id": _str(m.get("tool_call_id"), f"{w}.tool_call_id")})
        else:
            out.append({"role": "system" if role == "developer" else role, "content": content})
    tools = []
    for i, raw_t in enumerate(_list(req.get("tools") or [], "request.tools", MAX_TOOLS)):
        w = f"request.tools[{i}]"
        t = _obj(raw_t, w)
        if t.get("type") != "function":
            raise _bad(f"{w}.type {_name(t.get('type'))} is not a function tool")
        fn = _obj(t.get("function"), f"{w}.function")
        tools.append(_function_tool(fn.get("name"), fn.get("description"),
                                    fn.get("parameters"), f"{w}.function"))
    return out, tools


def chat_reply(response: bytes, stream: bool) -> Message:
    if not _is_stream(response, stream):
        obj = _obj(_json(response, "response"), "response")
        if "error" in obj and "choices" not in obj:
            raise _bad("response is an error")
        choices = _list(obj.get("choices"), "response.choices")
        if not choices:
            raise _bad("response.choices: empty")
        msg = _obj(_obj(choices[0], "response.choices[0]").get("message"),
                   "response.choices[0].message")
        content = msg.get("content")
        if content is None and isinstance(msg.get("refusal"), str):
            content = msg["refusal"]
        calls = (_chat_tool_calls(msg["tool_calls"], "response.choices[0].message.tool_calls")
                 if msg.get("tool_calls") is not None else [])
        return _assistant(_chat_content(content, "response.choices[0].message.content"), calls)
    text: list[str] = []
    refusal: list[str] = []
    acc: dict[int, dict[str, list[str]]] = {}
    for n, (_, raw_chunk) in enumerate(_sse(response)):
        w = f"stream chunk {n}"
        chunk = _obj(raw_chunk, w)
        if "error" in chunk:
            raise _bad(f"{w}: an error event")
        for raw_ch in _list(chunk.get("choices") or [], f"{w}.choices"):
            ch = _obj(raw_ch, f"{w}.choices[]")
            if ch.get("index", 0) != 0:
                continue  # n > 1: the first choice is the reply, as in a completion
            delta = _obj(ch.get("delta") or {}, f"{w}.delta")
            if delta.get("content") is not None:
                text.append(_str(delta["content"], f"{w}.delta.content"))
            if delta.get("refusal") is not None:
                refusal.append(_str(delta["refusal"], f"{w}.delta.refusal"))
            for raw_tc in _list(delta.get("tool_calls") or [], f"{w}.delta.tool_calls",
                            MAX_TOOL_CALLS):
                tc = _obj(raw_tc, f"{w}.delta.tool_calls[]")
                idx = tc.get("index")
                if type(idx) is not int or not 0 <= idx < MAX_TOOL_CALLS:
                    raise _bad(f"{w}.delta.tool_calls[].index {_name(idx)} is not 0.."
                               f"{MAX_TOOL_CALLS - 1}")
                slot = acc.setdefault(idx, {"id": [], "name": [], "arguments": []})
                # strings accumulate, as the openai SDK's accumulate_delta does (pieces
                # joined once at the end: += on a dict's string copies it every time)
                if tc.get("id") is not None:
                    slot["id"].append(_str(tc["id"], f"{w}.delta.tool_calls[].id"))
                fn = _obj(tc.get("function") or {}, f"{w}.delta.tool_calls[].function")
                for k in ("name", "arguments"):
                    if fn.get(k) is not None:
                        slot[k].append(_str(fn[k], f"{w}.delta.tool_calls[].function.{k}"))
    calls = [_call("".join(s["id"]), "".join(s["name"]), "".join(s["arguments"]),
                   f"stream tool call {i}") for i, s in sorted(acc.items())]
    content = "".join(text) if text or not refusal else "".join(refusal)
    return _assistant(content, calls)


# -- responses ---------------------------------------------------------------------------


def _responses_text(c: object, where: str) -> str:
    """Message content: a string, or parts (input_text / output_text / refusal joined;
    anything else, e.g. images, kept as JSON text)."""
    if isinstance(c, str):
        return c
    parts = _list(c, where)
    if all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text",
                                                      "refusal") for p in parts):
        return "".join(_str(p.get("refusal") if p.get("type") == "refusal" else p.get("text"),
                            f"{where}[{i}].text") for i, p in enumerate(parts))
    return _as_json_text(parts)


def _append_call(out: list[Message], call: dict[str, Any]) -> None:
    """A function call joins the assistant message just before it (one chat assistant
    message holds text and tool calls), else starts one with empty content."""
    if out and out[-1]["role"] == "assistant":
        calls = out[-1].setdefault("tool_calls", [])
        if len(calls) >= MAX_TOOL_CALLS:
            raise _bad(f"over {MAX_TOOL_CALLS} tool calls in one assistant message")
        calls.append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _responses_items(items: list[Any], where: str, out: list[Message], *,
                     request: bool) -> None:
    for i, raw_it in enumerate(items):
        w = f"{where}[{i}]"
        it = _obj(raw_it, w)
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            allowed = ("user", "system", "developer", "assistant") if request else ("assistant",)
            if role not in allowed:
                raise _bad(f"{w}.role {_name(role)} unsupported")
            text = _responses_text(it.get("content"), f"{w}.content")
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            _append_call(out, _call(it.get("call_id"), it.get("name"),
                                    _str(it.get("arguments"), f"{w}.arguments"), w))
        elif kind == "function_call_output" and request:
            out.append({"role": "tool",
                        "content": _responses_text(it.get("output"), f"{w}.output"),
                        "tool_call_id": _str(it.get("call_id"), f"{w}.call_id")})
        elif kind == "reasoning":
            continue  # chat messages have no place for it; the exact bytes keep it
        else:
            raise _bad(f"{w}.type {_name(kind)} unsupported")


def responses_request(req: object) -> tuple[list[Message], list[dict[str, Any]]]:
    req = _obj(req, "request")
    out: list[Message] = []
    if req.get("instructions") is not None:
        out.append({"role": "system",
                    "content": _str(req["instructions"], "request.instructions")})
    inp = req.get("input")
    if isinstance(inp, str):
        out.append({"role": "user", "content": inp})
    else:
        _responses_items(_list(inp, "request.input"), "request.input", out, request=True)
    if not out:
        raise _bad("request.input: empty")
    tools = []
    for i, raw_t in enumerate(_list(req.get("tools") or [], "request.tools", MAX_TOOLS)):
        w = f"request.tools[{i}]"
        t = _obj(raw_t, w)
        if t.get("type") != "function":
            raise _bad(f"{w}.type {_name(t.get('type'))} is not a function tool")
        tools.append(_function_tool(t.get("name"), t.get("description"),
                                    t.get("parameters"), w))
    return out, tools


def _responses_output(output: object, where: str) -> Message:
    out: list[Message] = []
    _responses_items(_list(output, where), where, out, request=False)
    # several output messages and calls make one assistant message
    content = "".join(m["content"] for m in out)
    calls = [c for m in out for c in m.get("tool_calls", [])]
    return _assistant(content, calls)


def responses_reply(response: bytes, stream: bool) -> Message:
    if not _is_stream(response, stream):
        obj = _obj(_json(response, "response"), "response")
        if obj.get("error") is not None and "output" not in obj:
            raise _bad("response is an error")
        return _responses_output(obj.get("output"), "response.output")
    items: dict[int, dict[str, Any]] = {}
    # Deltas gather as pieces, joined once when the stream ends (+= on a dict's string
    # copies it every time: quadratic in the reply's length).
    args: dict[int, list[str]] = {}
    texts: dict[int, list[tuple[dict[str, Any], str, list[str]]]] = {}
    for n, (name, raw_ev) in enumerate(_sse(response)):
        w = f"stream event {n}"
        ev = _obj(raw_ev, w)
        kind = ev.get("type", name)
        if kind in ("response.completed", "response.incomplete"):
            resp = _obj(ev.get("response"), f"{w}.response")
            return _responses_output(resp.get("output"), f"{w}.response.output")
        if kind in ("response.failed", "error"):
            raise _bad(f"{w}: the stream reports {kind}")
        if kind not in ("response.output_item.added", "response.output_item.done",
                        "response.output_text.delta", "response.refusal.delta",
                        "response.function_call_arguments.delta"):
            continue
        idx = ev.get("output_index")
        if type(idx) is not int or not 0 <= idx < MAX_MESSAGES:
            raise _bad(f"{w}.output_index {_name(idx)} out of range")
        if kind in ("response.output_item.done", "response.output_item.added"):
            item = dict(_obj(ev.get("item"), f"{w}.item"))
            if kind == "response.output_item.added" and item.get("type") == "message":
                item["content"] = []
            items[idx] = item  # the done item is whole: deltas gathered so far are moot
            args.pop(idx, None)
            texts.pop(idx, None)
        elif idx not in items:
            raise _bad(f"{w}: a delta for output {idx} before its item")
        else:
            item = items[idx]
            delta = _str(ev.get("delta"), f"{w}.delta")
            if kind == "response.function_call_arguments.delta":
                if idx not in args:
                    args[idx] = [_opt_str(item.get("arguments"), f"{w}.arguments")]
                args[idx].append(delta)
            else:
                part = "refusal" if kind == "response.refusal.delta" else "output_text"
                key = "refusal" if part == "refusal" else "text"
                content = _list(item.setdefault("content", []), f"{w}.content")
                parts = texts.setdefault(idx, [])
                last = _obj(content[-1], f"{w}.content[-1]") if content else None
                if last is None or last.get("type") != part:
                    last = {"type": part, key: ""}
                    content.append(last)
                if not parts or parts[-1][0] is not last:
                    parts.append((last, key, [_opt_str(last.get(key), f"{w}.content.{key}")]))
                parts[-1][2].append(delta)
    for idx, pieces in args.items():
        items[idx]["arguments"] = "".join(pieces)
    for gathered in texts.values():
        for block, key, pieces in gathered:
            block[key] = "".join(pieces)
    return _responses_output([items[k] for k in sorted(items)], "stream output")


# -- anthropic messages ----------------------------------------------------------------


def _blocks_text(c: object, where: str) -> str:
    """A string, or blocks: text joined in order, anything else kept as JSON text."""
    if isinstance(c, str):
        return c
    blocks = _list(c, where)
    if all(isinstance(b, dict) and b.get("type") == "text" for b in blocks):
        return "".join(_str(b.get("text"), f"{where}[{i}].text") for i, b in enumerate(blocks))
    return _as_json_text(blocks)


SKIPPED_BLOCKS = ("thinking", "redacted_thinking")
"""Assistant blocks with no place in a chat message (the exact bytes keep them)."""


def _assistant_blocks(c: object, where: str) -> Message:
    if isinstance(c, str):
        return _assistant(c, [])
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, raw_b in enumerate(_list(c, where)):
        w = f"{where}[{i}]"
        b = _obj(raw_b, w)
        kind = b.get("type")
        if kind == "text":
            text.append(_str(b.get("text"), f"{w}.text"))
        elif kind == "tool_use":
            calls.append(_call(b.get("id"), b.get("name"), _args_text(b.get("input"),
                                                                      f"{w}.input"), w))
        elif kind in SKIPPED_BLOCKS:
            continue
        else:
            raise _bad(f"{w}.type {_name(kind)} unsupported")
    return _assistant("".join(text), calls)


def messages_request(req: object) -> tuple[list[Message], list[dict[str, Any]]]:
    req = _obj(req, "request")
    out: list[Message] = []
    if req.get("system") is not None:
        out.append({"role": "system", "content": _blocks_text(req["system"], "request.system")})
    msgs = _list(req.get("messages"), "request.messages")
    if not msgs:
        raise _bad("request.messages: empty")
    for i, raw_m in enumerate(msgs):
        w = f"request.messages[{i}]"
        m = _obj(raw_m, w)
        role, c = m.get("role"), m.get("content")
        if role == "assistant":
            out.append(_assistant_blocks(c, f"{w}.content"))
        elif role == "system":
            out.append({"role": "system", "content": _blocks_text(c, f"{w}.content")})
        elif role == "user":
            if isinstance(c, str):
                out.append({"role": "user", "content": c})
                continue
            rest: list[Any] = []
            for j, raw_b in enumerate(_list(c, f"{w}.content")):
                b = _obj(raw_b, f"{w}.content[{j}]")
                if b.get("type") == "tool_result":
                    wj = f"{w}.content[{j}]"
                    res = b.get("content")
                    out.append({"role": "tool",
                                "content": "" if res is None else _blocks_text(
                                    res, f"{wj}.content"),
                                "tool_call_id": _str(b.get("tool_use_id"),
                                                     f"{wj}.tool_use_id")})
                else:
                    rest.append(b)
            if rest or not c:
                out.append({"role": "user", "content": _blocks_text(rest, f"{w}.content")})
        else:
            raise _bad(f"{w}.role {_name(role)} unsupported")
    tools = []
    for i, raw_t in enumerate(_list(req.get("tools") or [], "request.tools", MAX_TOOLS)):
        w = f"request.tools[{i}]"
        t = _obj(raw_t, w)
        if t.get("type") not in (None, "custom"):
            raise _bad(f"{w}.type {_name(t.get('type'))} is not a client tool")
        tools.append(_function_tool(t.get("name"), t.get("description"),
                                    t.get("input_schema"), w))
    return out, tools


def messages_reply(response: bytes, stream: bool) -> Message:
    if not _is_stream(response, stream):
        obj = _obj(_json(response, "response"), "response")
        if obj.get("type") == "error":
            raise _bad("response is an error")
        if obj.get("role", "assistant") != "assistant":
            raise _bad(f"response.role {_name(obj.get('role'))} is not assistant")
        return _assistant_blocks(obj.get("content"), "response.content")
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, list[str]] = {}
    texts: dict[int, list[str]] = {}  # pieces joined at the end, not += (quadratic)
    for n, (name, raw_ev) in enumerate(_sse(response)):
        w = f"stream event {n}"
        ev = _obj(raw_ev, w)
        kind = ev.get("type", name)
        if kind == "error":
            raise _bad(f"{w}: the stream reports an error")
        if kind not in ("content_block_start", "content_block_delta", "content_block_stop"):
            continue  # message_start, message_delta, message_stop, ping
        idx = ev.get("index")
        if type(idx) is not int or not 0 <= idx < MAX_MESSAGES:
            raise _bad(f"{w}.index {_name(idx)} out of range")
        if kind == "content_block_start":
            blocks[idx] = dict(_obj(ev.get("content_block"), f"{w}.content_block"))
            partial[idx] = []
            texts.pop(idx, None)
        elif idx not in blocks:
            raise _bad(f"{w}: {kind} for block {idx} before its start")
        elif kind == "content_block_delta":
            delta = _obj(ev.get("delta"), f"{w}.delta")
            dk = delta.get("type")
            if dk == "text_delta":
                if idx not in texts:
                    texts[idx] = [_opt_str(blocks[idx].get("text"), f"{w}.text")]
                texts[idx].append(_str(delta.get("text"), f"{w}.delta.text"))
            elif dk == "input_json_delta":
                partial[idx].append(_str(delta.get("partial_json"), f"{w}.delta.partial_json"))
            elif dk in ("thinking_delta", "signature_delta", "citations_delta"):
                continue
            else:
                raise _bad(f"{w}.delta.type {_name(dk)} unsupported")
        else:  # content_block_stop: the tool input is the JSON its deltas spelled
            js = "".join(partial[idx])
            if js:
                try:
                    blocks[idx]["input"] = loads_strict(js, source="tool input")
                except OutputRejected:
                    raise _bad(f"{w}: streamed tool input of block {idx} is not JSON"
                               ) from None
    for idx, pieces in texts.items():
        blocks[idx]["text"] = "".join(pieces)
    return _assistant_blocks([blocks[k] for k in sorted(blocks)], "stream content")


# -- entry point -----------------------------------------------------------------------

_FAMILIES = {"chat": (chat_request, chat_reply),
             "responses": (responses_request, responses_reply),
             "messages": (messages_request, messages_reply)}


def transcript(api: str | None, request: bytes, response: bytes | None, *,
               stream: bool = False) -> Transcript:
    """One recorded call as chat messages, tools and reply; never raises on content.

    ``api`` None means an old log's record (all chat). Raises ValueError only for an api
    in :data:`NOT_TURNS` (the caller skips and counts those)."""
    api = api or "chat"
    if api in NOT_TURNS:
        raise ValueError(f"{api} calls are not conversation turns")
    fam = _FAMILIES.get(api)
    if fam is None:
        return Transcript(api=api, reason=f"unknown_api: {_name(api)}")
    read_request, read_reply = fam
    messages: list[Message] = []
    tools: list[dict[str, Any]] = []
    try:
        messages, tools = read_request(_json(request, "request"))
    except Unparsed as exc:
        return Transcript(api=api, reason=exc.reason)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        return Transcript(api=api, reason=f"request_shape: {type(exc).__name__}")
    if response is None:
        return Transcript(api=api, messages=messages, tools=tools, reason="no_response")
    try:
        reply = read_reply(response, stream)
    except Unparsed as exc:
        return Transcript(api=api, messages=messages, tools=tools, reason=exc.reason)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        return Transcript(api=api, messages=messages, tools=tools,
                          reason=f"response_shape: {type(exc).__name__}")
    return Transcript(api=api, messages=messages, tools=tools, reply=reply)


def arguments_are_objects(msg: Message) -> bool:
    """Every tool call of ``msg`` has arguments that are one JSON object."""
    for tc in msg.get("tool_calls", []):
        try:
            if not isinstance(loads_strict(tc["function"]["arguments"], source="arguments"),
                              dict):
                return False
        except OutputRejected:
            return False
    return True
