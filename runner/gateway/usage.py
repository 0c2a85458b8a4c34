"""Usage and completeness of upstream responses, per API family (pure).

Each family reports tokens in its own fields and, when streamed, its own events; all are
normalised into :class:`Usage` (prompt = every input token, cache reads and writes
included; completion = every output token, reasoning included):

- chat: ``usage.prompt_tokens`` / ``completion_tokens``,
  ``prompt_tokens_details.cached_tokens`` (and ``cache_write_tokens``),
  ``completion_tokens_details.reasoning_tokens``; a stream is complete with ``[DONE]``
  and carries usage in its last chunk (``stream_options.include_usage``).
- responses: ``usage.input_tokens`` / ``output_tokens``,
  ``input_tokens_details.cached_tokens`` (and ``cache_write_tokens``),
  ``output_tokens_details.reasoning_tokens``; a stream is complete with its terminal
  ``response.completed`` / ``response.incomplete`` / ``response.failed`` event, whose
  ``response.usage`` is the usage.
- embeddings: ``usage.prompt_tokens``; never streamed.
- messages (Anthropic): ``usage.input_tokens`` (uncached part only) +
  ``cache_read_input_tokens`` + ``cache_creation_input_tokens``, ``output_tokens``; a
  stream is complete with ``message_stop``; usage starts in ``message_start`` and
  ``message_delta`` carries cumulative values.
- count_tokens: ``{"input_tokens": N}``, not billed (no usage).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

from runner.errors import OutputRejected
from runner.gateway.calllog import MAX_TOKENS, Api, Usage
from runner.isolation.collect import loads_strict

RESPONSES_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


# More tokens than any call can use: a count above it is no measurement (an upstream's
# 401-digit integer overflowed the cost to an exception that left its reservation open).



def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TOKENS


class _NoCount(Exception):
    """A usage field is there but holds no token count: the usage is no measurement."""


def _int(obj: Any, *path: str) -> int:
    """The token count at ``path`` inside nested dicts: 0 when absent or null, _NoCount
    when present but not a count (read as 0, an uncountable cache read or write would
    drop its tokens from the charge)."""
    for key in path:
        if obj is None:
            return 0
        if not isinstance(obj, dict):
            raise _NoCount
        obj = obj.get(key)
    if obj is None:
        return 0
    if _count(obj):
        return int(obj)
    raise _NoCount


def _measured(read: Callable[..., Usage | None]) -> Callable[..., Usage | None]:
    """None (no measurement: the call is charged its worst case) when a field is bad."""
    @functools.wraps(read)
    def wrapper(u: Any, *more: Any) -> Usage | None:
        try:
            return read(u, *more)
        except _NoCount:
            return None
    return wrapper


def _has_int(obj: Any, key: str) -> bool:
    return _count(obj.get(key) if isinstance(obj, dict) else None)


def _make(prompt: int, completion: int, *, cached: int = 0, write: int = 0,
          write_1h: int = 0, reasoning: int = 0, total: int = 0) -> Usage:
    """Usage as billed at the most the fields allow, where they disagree: cache reads and
    writes above the prompt raise the prompt; reasoning above the completion, or a total
    above prompt plus completion, raise the completion (some OpenAI-compatible upstreams
    report a completion without its reasoning and a total with it: lowering the details
    to fit charged a 60,021-token call for 21)."""
    prompt = max(prompt, cached + write)
    completion = max(completion, reasoning, total - prompt)
    if prompt > MAX_TOKENS or completion > MAX_TOKENS:  # sums and differences of counts
        raise _NoCount
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion, cached_tokens=cached,
                 cache_write_tokens=write, cache_write_1h_tokens=min(write_1h, write),
                 reasoning_tokens=reasoning)


@_measured
def usage_chat(u: Any) -> Usage | None:
    if not (_has_int(u, "prompt_tokens") and _has_int(u, "completion_tokens")):
        return None
    return _make(u["prompt_tokens"], u["completion_tokens"],
                 cached=_int(u, "prompt_tokens_details", "cached_tokens"),
                 write=_int(u, "prompt_tokens_details", "cache_write_tokens"),
                 reasoning=_int(u, "completion_tokens_details", "reasoning_tokens"),
                 total=_int(u, "total_tokens"))


@_measured
def usage_responses(u: Any) -> Usage | None:
    if not (_has_int(u, "input_tokens") and _has_int(u, "output_tokens")):
        return None
    return _make(u["input_tokens"], u["output_tokens"],
                 cached=_int(u, "input_tokens_details", "cached_tokens"),
                 write=_int(u, "input_tokens_details", "cache_write_tokens"),
                 reasoning=_int(u, "output_tokens_details", "reasoning_tokens"),
                 total=_int(u, "total_tokens"))


@_measured
def usage_embeddings(u: Any) -> Usage | None:
    if not _has_int(u, "prompt_tokens"):
        return None
    return _make(u["prompt_tokens"], 0, total=_int(u, "total_tokens"))


def usage_messages(u: Any, *, asked_1h: bool = False) -> Usage | None:
    """``asked_1h``: the request asked for the 1-hour cache somewhere; then, when the usage
    does not say which cache its writes went to (no ``cache_creation``, as some
    Anthropic-compatible upstreams answer), every write is charged at the 1-hour price."""
    return _usage_messages(u, asked_1h)


@_measured
def _usage_messages(u: Any, asked_1h: bool) -> Usage | None:
    if not (_has_int(u, "input_tokens") and _has_int(u, "output_tokens")):
        return None
    read = _int(u, "cache_read_input_tokens")
    five = _int(u, "cache_creation", "ephemeral_5m_input_tokens")
    hour = _int(u, "cache_creation", "ephemeral_1h_input_tokens")
    write = max(_int(u, "cache_creation_input_tokens"), five + hour)  # the most they say
    told = isinstance(u.get("cache_creation"), dict) and \
        "ephemeral_1h_input_tokens" in u["cache_creation"]
    if asked_1h and not told:  # which cache is not said: the dearer one
        hour = write
    return _make(u["input_tokens"] + read + write, u["output_tokens"], cached=read,
                 write=write, write_1h=hour,
                 reasoning=_int(u, "output_tokens_details", "reasoning_tokens"))


_SSE_LINE_END = re.compile(r"\r\n|\r|\n")
_SSE_LINE = re.compile(r"([^\r\n]*)(?:\r\n|\r|\n|$)")


def sse_lines(text: str) -> list[str]:
    """The lines of an SSE body. A line ends at CRLF, CR or LF alone (the SSE standard),
    never at U+2028, U+2029, U+0085 or the other breaks ``str.splitlines()`` honours:
    JSON carries those raw inside a string, so an event would be cut in two."""
    return _SSE_LINE_END.split(text)


def iter_sse_events(data: bytes) -> Iterator[str]:
    """The data payloads of an SSE body, in order (multi-line data joined by newlines),
    one at a time: a 16 MB stream of tiny events is never held as a list of them."""
    lines: list[str] = []
    for m in _SSE_LINE.finditer(data.decode("utf-8", errors="replace")):
        line = m.group(1)
        if not line:
            if lines:
                yield "\n".join(lines)
                lines = []
        elif line.startswith("data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(" ") else value)
    if lines:
        yield "\n".join(lines)


def sse_events(data: bytes) -> list[str]:
    """The data payloads of an SSE body, in order (multi-line data joined by newlines)."""
    return list(iter_sse_events(data))


def _json(data: bytes | str, what: str) -> Any:
    try:
        return loads_strict(data, source=what)
    except OutputRejected:
        return None


def _body(api: Api, data: bytes, asked_1h: bool) -> tuple[Usage | None, str | None]:
    obj = _json(data, "upstream response")
    if not isinstance(obj, dict):
        return None, "malformed_response"
    if api == "chat":
        ok = isinstance(obj.get("choices"), list) and bool(obj["choices"])
        return (usage_chat(obj.get("usage")), None) if ok else (None, "malformed_response")
    if api == "responses":
        ok = isinstance(obj.get("output"), list)
        return (usage_responses(obj.get("usage")), None) if ok else (None, "malformed_response")
    if api == "embeddings":
        ok = isinstance(obj.get("data"), list)
        return (usage_embeddings(obj.get("usage")), None) if ok else (None,
                                                                     "malformed_response")
    if api == "messages":
        ok = obj.get("type") == "message" and isinstance(obj.get("content"), list)
        return ((usage_messages(obj.get("usage"), asked_1h=asked_1h), None) if ok
                else (None, "malformed_response"))
    return None, None if _has_int(obj, "input_tokens") else "malformed_response"


def _stream(api: Api, data: bytes, asked_1h: bool) -> tuple[Usage | None, str | None]:
    """One pass over the events, keeping only what the family's usage and completeness
    need (never every parsed event: a stream may hold millions)."""
    usage: Usage | None = None
    kinds: set[object] = set()
    terminal: dict[str, Any] | None = None
    fields: dict[str, Any] = {}
    done = False
    for ev in iter_sse_events(data):
        if done:  # chat: [DONE] is the last event or the stream is cut
            return None, "truncated_stream"
        if api == "chat" and ev.strip() == "[DONE]":
            done = True
            continue
        obj = _json(ev, "upstream stream event")
        if not isinstance(obj, dict):
            return None, "malformed_response"
        if api == "chat":
            usage = usage_chat(obj.get("usage")) or usage
            continue
        kind = obj.get("type")
        if not isinstance(kind, str):
            kind = None  # a list or object is no event type (and cannot be looked up)
        kinds.add(kind)
        if api == "responses":
            if kind in RESPONSES_TERMINAL:
                terminal = obj
            continue
        if kind == "message_start":
            msg = obj.get("message")
            u = msg.get("usage") if isinstance(msg, dict) else None
        elif kind == "message_delta":
            u = obj.get("usage")
        else:
            continue
        if isinstance(u, dict):  # message_delta's values are cumulative: the latest wins
            fields.update({k: v for k, v in u.items() if v is not None})
    if api == "chat":
        return (usage, None) if done else (None, "truncated_stream")
    if api == "responses":
        if terminal is None:
            return None, "upstream_stream_error" if "error" in kinds else "truncated_stream"
        resp = terminal.get("response")
        return usage_responses(resp.get("usage") if isinstance(resp, dict) else None), None
    if "message_stop" not in kinds:
        return None, "upstream_stream_error" if "error" in kinds else "truncated_stream"
    return usage_messages(fields, asked_1h=asked_1h), None


def inspect(data: bytes, *, stream: bool, api: Api = "chat",
            asked_1h: bool = False) -> tuple[Usage | None, str | None]:
    """(usage, error) of a family's response body or SSE stream; error names why the
    response is not a complete one (malformed_response, truncated_stream, ...).
    ``asked_1h``: see :func:`usage_messages`."""
    return _stream(api, data, asked_1h) if stream else _body(api, data, asked_1h)
