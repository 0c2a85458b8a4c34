"""Wire bodies of the scripted provider, per API family (pure, deterministic).

Each builder returns the exact bytes a real server of that family would send for one
reply (text or one function tool call), as a JSON body or as an SSE stream in the
family's own event shapes, so that the ``openai`` and ``anthropic`` SDKs' parsers (and
frameworks on them) accept it. Ids derive from the request's sha256; nothing depends on
the clock. Usage is ~4 bytes per token of the request's text and of the reply.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from runner.gateway.calllog import sha256


@dataclass(frozen=True)
class Answer:
    """One scripted reply: ``text``, or a call of function ``tool`` with ``arguments``."""

    text: str = ""
    tool: str | None = None
    arguments: str = "{}"
    """The tool call's arguments as compact JSON text."""


def tokens(text: str) -> int:
    return max(1, math.ceil(len(text.encode()) / 4))


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _pieces(text: str) -> list[str]:
    return [text[i:i + 64] for i in range(0, len(text), 64)] or [""]


def _sse(events: list[tuple[str | None, Any]]) -> bytes:
    out = []
    for name, data in events:
        head = f"event: {name}\n" if name else ""
        out.append(f"{head}data: {data if isinstance(data, str) else _dumps(data)}\n\n")
    return "".join(out).encode()


# -- chat completions --------------------------------------------------------------
def chat(request: bytes, body: dict[str, Any], a: Answer, prompt_tokens: int, *,
         stream: bool) -> bytes:
    rid = sha256(request)[:24]
    completion = tokens(a.text if a.tool is None else a.tool + a.arguments)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
             "total_tokens": prompt_tokens + completion}
    base = {"id": "chatcmpl-fixture-" + rid, "created": 0, "model": body.get("model"),
            "system_fingerprint": "cyclebox-scripted-fixture"}
    finish = "stop" if a.tool is None else "tool_calls"
    call = {"id": "call_fixture_" + rid[:16], "type": "function",
            "function": {"name": a.tool, "arguments": a.arguments}}
    if not stream:
        message: dict[str, Any] = {"role": "assistant", "content": a.text}
        if a.tool is not None:
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        obj = {**base, "object": "chat.completion", "usage": usage,
               "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                            "message": message}]}
        return _dumps(obj).encode()
    deltas: list[dict[str, Any]]
    if a.tool is None:
        deltas = [{"content": p} for p in _pieces(a.text)]
    else:
        deltas = [{"content": None, "tool_calls": [{"index": 0, **call, "function": {
            "name": a.tool, "arguments": ""}}]}]
        deltas += [{"tool_calls": [{"index": 0, "function": {"arguments": p}}]}
                   for p in _pieces(a.arguments)]
    deltas[0] = {"role": "assistant", **deltas[0]}
    events: list[tuple[str | None, Any]] = [
        (None, {**base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": d, "finish_reason": None}]}) for d in deltas]
    events.append((None, {**base, "object": "chat.completion.chunk",
                          "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}))
    events.append((None, {**base, "object": "chat.completion.chunk", "choices": [],
                          "usage": usage}))
    events.append((None, "[DONE]"))
    return _sse(events)


# -- responses -------------------------------------------------------------------------
def responses(request: bytes, body: dict[str, Any], a: Answer, prompt_tokens: int, *,
              stream: bool) -> bytes:
    rid = sha256(request)[:24]
    completion = tokens(a.text if a.tool is None else a.tool + a.arguments)
    usage = {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": prompt_tokens + completion}
    item_id = ("msg_fixture_" if a.tool is None else "fc_fixture_") + rid[:16]
    item: dict[str, Any]
    if a.tool is None:
        part = {"type": "output_text", "text": a.text, "annotations": [], "logprobs": []}
        item = {"id": item_id, "type": "message", "status": "completed", "role": "assistant",
                "content": [part]}
    else:
        item = {"id": item_id, "type": "function_call", "status": "completed",
                "call_id": "call_fixture_" + rid[:16], "name": a.tool,
                "arguments": a.arguments}
    resp: dict[str, Any] = {
        "id": "resp_fixture_" + rid, "object": "response", "created_at": 0,
        "status": "completed", "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), "model": body.get("model"),
        "output": [item], "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools", []),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"), "metadata": {},
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": usage}
    if not stream:
        return _dumps(resp).encode()
    events: list[tuple[str | None, Any]] = []

    def ev(kind: str, **fields: Any) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **fields}))

    started = {**resp, "status": "in_progress", "output": [], "usage": None}
    ev("response.created", response=started)
    ev("response.in_progress", response=started)
    loc = {"item_id": item_id, "output_index": 0}
    if a.tool is None:
        ev("response.output_item.added", output_index=0,
           item={**item, "status": "in_progress", "content": []})
        empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        ev("response.content_part.added", **loc, content_index=0, part=empty)
        for p in _pieces(a.text):
            ev("response.output_text.delta", **loc, content_index=0, delta=p, logprobs=[])
        ev("response.output_text.done", **loc, content_index=0, text=a.text, logprobs=[])
        ev("response.content_part.done", **loc, content_index=0, part=item["content"][0])
    else:
        ev("response.output_item.added", output_index=0,
           item={**item, "status": "in_progress", "arguments": ""})
        for p in _pieces(a.arguments):
            ev("response.function_call_arguments.delta", **loc, delta=p)
        ev("response.function_call_arguments.done", **loc, name=a.tool, arguments=a.arguments)
    ev("response.output_item.done", output_index=0, item=item)
    ev("response.completed", response=resp)
    return _sse(events)


# -- messages (Anthropic) ------------------------------------------------------------
def messages(request: bytes, body: dict[str, Any], a: Answer, prompt_tokens: int, *,
             stream: bool) -> bytes:
    rid = sha256(request)[:24]
    completion = tokens(a.text if a.tool is None else a.tool + a.arguments)
    usage = {"input_tokens": prompt_tokens, "output_tokens": completion,
             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    block: dict[str, Any]
    if a.tool is None:
        block = {"type": "text", "text": a.text}
    else:
        block = {"type": "tool_use", "id": "toolu_fixture_" + rid[:16], "name": a.tool,
                 "input": json.loads(a.arguments)}
    stop = "end_turn" if a.tool is None else "tool_use"
    msg: dict[str, Any] = {"id": "msg_fixture_" + rid, "type": "message",
                           "role": "assistant", "model": body.get("model"),
                           "content": [block], "stop_reason": stop, "stop_sequence": None,
                           "usage": usage}
    if not stream:
        return _dumps(msg).encode()
    events: list[tuple[str | None, Any]] = []

    def ev(kind: str, **fields: Any) -> None:
        events.append((kind, {"type": kind, **fields}))

    ev("message_start", message={**msg, "content": [], "stop_reason": None,
                                 "usage": {**usage, "output_tokens": 1}})
    if a.tool is None:
        ev("content_block_start", index=0, content_block={"type": "text", "text": ""})
        ev("ping")
        for p in _pieces(a.text):
            ev("content_block_delta", index=0, delta={"type": "text_delta", "text": p})
    else:
        ev("content_block_start", index=0, content_block={**block, "input": {}})
        ev("ping")
        for p in _pieces(a.arguments):
            ev("content_block_delta", index=0,
               delta={"type": "input_json_delta", "partial_json": p})
    ev("content_block_stop", index=0)
    ev("message_delta", delta={"stop_reason": stop, "stop_sequence": None},
       usage={"output_tokens": completion})
    ev("message_stop")
    return _sse(events)


def count_tokens(prompt_tokens: int) -> bytes:
    return _dumps({"input_tokens": prompt_tokens}).encode()


# -- embeddings ------------------------------------------------------------------------
def _vector(text: str, dims: int) -> list[float]:
    out: list[float] = []
    counter = 0
    while len(out) < dims:
        digest = hashlib.sha256(f"{counter}:{text}".encode()).digest()
        out.extend(round(b / 127.5 - 1.0, 6) for b in digest)
        counter += 1
    return out[:dims]


def embeddings(body: dict[str, Any]) -> bytes:
    """One vector per input, derived from the input's sha256 (float or base64 float32)."""
    raw = body.get("input")
    inputs = [raw] if isinstance(raw, str) or (isinstance(raw, list) and raw
                                               and isinstance(raw[0], int)) else raw or []
    given = body.get("dimensions")
    dims = max(1, min(given, 4096)) if isinstance(given, int) else 8
    data, prompt = [], 0
    for i, x in enumerate(inputs):
        text = x if isinstance(x, str) else _dumps(x)
        prompt += tokens(text) if isinstance(x, str) else len(x) if isinstance(x, list) else 1
        vec = _vector(text, dims)
        emb: Any = vec
        if body.get("encoding_format") == "base64":
            emb = base64.b64encode(struct.pack(f"<{dims}f", *vec)).decode()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return _dumps({"object": "list", "data": data, "model": body.get("model"),
                   "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}).encode()
