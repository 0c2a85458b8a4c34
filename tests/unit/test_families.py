"""Per-family usage parsing, stream completeness, cost with cache prices, worst case,
and old call records (pure parts of the gateway)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runner.gateway.calllog import CallRecord, Usage
from runner.gateway.config import Price, RequestRules
from runner.gateway.server import cost_usd
from runner.gateway.usage import inspect
from runner.gateway.vet import Refusal, vet, worst_case_usd


def sse(*events: tuple[str | None, object]) -> bytes:
    return "".join((f"event: {n}\n" if n else "") + "data: "
                   + (d if isinstance(d, str) else json.dumps(d)) + "\n\n"
                   for n, d in events).encode()


def test_chat_usage_with_cached_and_reasoning_tokens() -> None:
    body = json.dumps({"choices": [{}], "usage": {
        "prompt_tokens": 100, "completion_tokens": 50, "total_tokens": 150,
        "prompt_tokens_details": {"cached_tokens": 40},
        "completion_tokens_details": {"reasoning_tokens": 30}}}).encode()
    assert inspect(body, stream=False) == (Usage(
        prompt_tokens=100, completion_tokens=50, total_tokens=150, cached_tokens=40,
        reasoning_tokens=30), None)


def test_responses_usage_body_and_stream_terminal_events() -> None:
    usage = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15,
             "input_tokens_details": {"cached_tokens": 4},
             "output_tokens_details": {"reasoning_tokens": 2}}
    want = Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15, cached_tokens=4,
                 reasoning_tokens=2)
    assert inspect(json.dumps({"output": [], "usage": usage}).encode(), stream=False,
                   api="responses") == (want, None)
    start = ("response.created", {"type": "response.created", "response": {}})
    for terminal in ("response.completed", "response.incomplete", "response.failed"):
        done = (terminal, {"type": terminal, "response": {"usage": usage}})
        assert inspect(sse(start, done), stream=True, api="responses") == (want, None)
    assert inspect(sse(start), stream=True, api="responses") == (None, "truncated_stream")
    err = ("error", {"type": "error", "message": "x"})
    assert inspect(sse(start, err), stream=True, api="responses")[1] == "upstream_stream_error"


def test_messages_usage_counts_cache_reads_and_writes_as_input() -> None:
    u = {"input_tokens": 10, "output_tokens": 7, "cache_read_input_tokens": 100,
         "cache_creation_input_tokens": 20}
    got, err = inspect(json.dumps({"type": "message", "content": [], "usage": u}).encode(),
                       stream=False, api="messages")
    assert err is None and got == Usage(prompt_tokens=130, completion_tokens=7,
                                        total_tokens=137, cached_tokens=100,
                                        cache_write_tokens=20)


def test_messages_stream_usage_is_cumulative_and_needs_message_stop() -> None:
    start = ("message_start", {"type": "message_start", "message": {"usage": {
        "input_tokens": 25, "output_tokens": 1, "cache_read_input_tokens": 5}}})
    d1 = ("message_delta", {"type": "message_delta", "delta": {}, "usage": {"output_tokens": 9}})
    d2 = ("message_delta", {"type": "message_delta", "delta": {},
                            "usage": {"output_tokens": 15}})
    stop = ("message_stop", {"type": "message_stop"})
    got, err = inspect(sse(start, d1, d2, stop), stream=True, api="messages")
    assert err is None and got == Usage(prompt_tokens=30, completion_tokens=15,
                                        total_tokens=45, cached_tokens=5)
    assert inspect(sse(start, d1), stream=True, api="messages") == (None, "truncated_stream")


@pytest.mark.parametrize("mark", ["\u2028", "\u2029", "\u0085"])
def test_a_stream_whose_text_holds_a_line_break_of_unicode_stays_whole(mark: str) -> None:
    """SSE lines end at CR, LF or CRLF only. JSON carries U+2028, U+2029 and U+0085 raw
    in a string (ensure_ascii=False, many encoders), and the reply is a whole stream:
    measured, and its text read back (str.splitlines() cut the event in two)."""
    from runner.gateway.transcript import chat_reply, messages_reply, responses_reply

    text = f"hel{mark}lo"
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    streams = {
        "chat": ("".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in (
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": text}}]},
            {"choices": [], "usage": usage})) + "data: [DONE]\n\n", chat_reply),
        "responses": ("".join(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}"
                              "\n\n" for e in (
            {"type": "response.output_item.added", "output_index": 0,
             "item": {"type": "message", "role": "assistant", "content": []}},
            {"type": "response.output_text.delta", "output_index": 0, "content_index": 0,
             "delta": text},
            {"type": "response.completed", "response": {"output": [{
                "type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": text}]}],
                "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}}})),
            responses_reply),
        "messages": ("".join(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}"
                             "\n\n" for e in (
            {"type": "message_start", "message": {"role": "assistant", "content": [],
                                                  "usage": {"input_tokens": 3,
                                                            "output_tokens": 1}}},
            {"type": "content_block_start", "index": 0,
             "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": text}},
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {}, "usage": {"output_tokens": 2}},
            {"type": "message_stop"})), messages_reply),
    }
    for api, (body, reply) in streams.items():
        raw = body.encode()
        assert mark.encode() in raw, api  # raw in the stream, not escaped
        got, err = inspect(raw, stream=True, api=api)  # type: ignore[arg-type]
        assert err is None and got is not None and got.completion_tokens == 2, api
        assert reply(raw, True)["content"] == text, api


def test_a_token_count_beyond_any_call_is_no_measurement() -> None:
    """A 401-digit count overflowed the cost to an exception after the upstream was
    reached (the reservation left open): it is no usage, so the call is bounded."""
    huge = 10 ** 400
    body = json.dumps({"choices": [{}], "usage": {"prompt_tokens": huge,
                                                  "completion_tokens": 1}}).encode()
    assert inspect(body, stream=False) == (None, None)
    # an optional count that is there but no count: no measurement either (read as 0,
    # a cache read or write over the bound dropped its tokens from the charge)
    for bad in (huge, 10**12 + 1, -1, "100", 1.5, [1]):
        body = json.dumps({"type": "message", "content": [], "usage": {
            "input_tokens": 5, "output_tokens": 1,
            "cache_read_input_tokens": bad}}).encode()
        assert inspect(body, stream=False, api="messages") == (None, None), bad
        body = json.dumps({"choices": [{}], "usage": {
            "prompt_tokens": 5, "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": bad}}}).encode()
        assert inspect(body, stream=False) == (None, None), bad
    body = json.dumps({"choices": [{}], "usage": {
        "prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": None,
        "completion_tokens_details": {"reasoning_tokens": None}}}).encode()
    got, _ = inspect(body, stream=False)  # absent or null: none of them
    assert got is not None and (got.cached_tokens, got.reasoning_tokens) == (0, 0)


@pytest.mark.parametrize(("api", "usage", "want"), [
    # helper-37: an OpenAI-compatible proxy's completion without its reasoning, the total
    # with it; read as 21 tokens, the call was charged 2,800 times less than billed
    ("chat", {"prompt_tokens": 21, "completion_tokens": 0, "total_tokens": 60021,
              "completion_tokens_details": {"reasoning_tokens": 60000}}, (21, 60000)),
    ("chat", {"prompt_tokens": 21, "completion_tokens": 5, "total_tokens": 26,
              "completion_tokens_details": {"reasoning_tokens": 900}}, (21, 900)),
    ("chat", {"prompt_tokens": 10, "completion_tokens": 5,
              "prompt_tokens_details": {"cached_tokens": 30, "cache_write_tokens": 20}},
     (50, 5)),
    ("responses", {"input_tokens": 7, "output_tokens": 1, "total_tokens": 5007}, (7, 5000)),
    ("embeddings", {"prompt_tokens": 8, "total_tokens": 12}, (8, 4)),
])
def test_usage_whose_fields_disagree_is_read_at_the_most_they_allow(
        api: str, usage: dict[str, Any], want: tuple[int, int]) -> None:
    """A detail above its total (reasoning above the completion, cache reads and writes
    above the prompt) or a total above prompt plus completion raises what is charged;
    it never lowers the detail to fit."""
    shape = {"chat": {"choices": [{}]}, "responses": {"output": []},
             "embeddings": {"data": []}}[api]
    got, err = inspect(json.dumps({**shape, "usage": usage}).encode(), stream=False,
                       api=api)  # type: ignore[arg-type]
    assert err is None and got is not None
    assert (got.prompt_tokens, got.completion_tokens) == want, got
    assert got.total_tokens == sum(want)


def test_messages_writes_without_their_cache_named_are_charged_at_the_hour_price() -> None:
    """An Anthropic-compatible upstream that reports cache writes without
    ``cache_creation``: when the request asked for the 1-hour cache, every write is
    charged at its price (they were charged at the 5-minute price); when it did not, or
    the breakdown is there, as reported."""
    u = {"input_tokens": 10, "output_tokens": 5, "cache_creation_input_tokens": 1000}
    body = json.dumps({"type": "message", "content": [], "usage": u}).encode()
    asked, _ = inspect(body, stream=False, api="messages", asked_1h=True)
    plain, _ = inspect(body, stream=False, api="messages")
    assert asked is not None and plain is not None
    assert (asked.cache_write_1h_tokens, plain.cache_write_1h_tokens) == (1000, 0)
    told = json.dumps({"type": "message", "content": [], "usage": {
        **u, "cache_creation": {"ephemeral_5m_input_tokens": 1000,
                                "ephemeral_1h_input_tokens": 0}}}).encode()
    got, _ = inspect(told, stream=False, api="messages", asked_1h=True)
    assert got is not None and got.cache_write_1h_tokens == 0
    stream = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
              + json.dumps(u).encode() + b'}}\n\nevent: message_stop\n'
              b'data: {"type":"message_stop"}\n\n')
    got, _ = inspect(stream, stream=True, api="messages", asked_1h=True)
    assert got is not None and got.cache_write_1h_tokens == 1000
    # helper-38: a breakdown that names writes the total leaves out, or an empty one
    for cc, want in (({"ephemeral_1h_input_tokens": 50000}, (50000, 50000)),
                     ({}, (1000, 1000)), ({"ephemeral_5m_input_tokens": 1000}, (1000, 1000))):
        body = json.dumps({"type": "message", "content": [], "usage": {
            **u, "cache_creation_input_tokens": 0 if cc.get("ephemeral_1h_input_tokens")
            else 1000, "cache_creation": cc}}).encode()
        got, _ = inspect(body, stream=False, api="messages", asked_1h=True)
        assert got is not None, cc
        assert (got.cache_write_tokens, got.cache_write_1h_tokens) == want, cc
        assert got.prompt_tokens == 10 + want[0], cc


def test_embeddings_and_count_tokens() -> None:
    body = json.dumps({"data": [], "usage": {"prompt_tokens": 8, "total_tokens": 8}}).encode()
    assert inspect(body, stream=False, api="embeddings") == (Usage(
        prompt_tokens=8, completion_tokens=0, total_tokens=8), None)
    assert inspect(b'{"input_tokens": 3}', stream=False, api="count_tokens") == (None, None)
    assert inspect(b'{"x": 3}', stream=False, api="count_tokens")[1] == "malformed_response"


def test_cost_prices_cache_reads_writes_and_reasoning_as_output() -> None:
    p = Price(input_per_mtok=3, output_per_mtok=15, cached_input_per_mtok=0.3,
              cache_write_per_mtok=3.75)
    u = Usage(prompt_tokens=1_000_000, completion_tokens=1_000_000, total_tokens=2_000_000,
              cached_tokens=500_000, cache_write_tokens=100_000, reasoning_tokens=600_000)
    assert cost_usd(u, p) == pytest.approx(0.4 * 3 + 0.5 * 0.3 + 0.1 * 3.75 + 15)
    plain = Price(input_per_mtok=3, output_per_mtok=15)
    # defaults: reads at the input price; writes at 1.25 times it (Anthropic's 5-minute
    # rate: at the input price, a run of cache writes passed limit_usd by up to 25%)
    assert cost_usd(u, plain) == pytest.approx(0.9 * 3 + 0.1 * 3.75 + 15)


def test_one_hour_cache_writes_are_priced_and_reserved_at_their_own_rate() -> None:
    """Anthropic bills writes to its 1-hour cache (cache_control ttl 1h, the container's
    choice) at twice the input price: measured at cache_write_1h_per_mtok (default 2x),
    and a request asking for it is reserved at that price."""
    u = {"input_tokens": 10, "output_tokens": 5, "cache_creation_input_tokens": 1000,
         "cache_creation": {"ephemeral_5m_input_tokens": 400,
                            "ephemeral_1h_input_tokens": 600}}
    got, _ = inspect(json.dumps({"type": "message", "content": [], "usage": u}).encode(),
                     stream=False, api="messages")
    assert got is not None and (got.cache_write_tokens, got.cache_write_1h_tokens) == (1000, 600)
    p = Price(input_per_mtok=1, output_per_mtok=1, cache_write_per_mtok=1.25)
    assert cost_usd(got, p) == pytest.approx((10 + 400 * 1.25 + 600 * 2 + 5) / 1e6)
    assert "cache_write_1h_tokens" not in Usage(prompt_tokens=1, completion_tokens=1,
                                                total_tokens=2).model_dump()  # old shape
    rules = RequestRules()
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}]}
    five = vet(json.loads(json.dumps(body)), rules=rules, cap=10, api="messages")
    body["system"] = [{"type": "text", "text": "big", "cache_control": {
        "type": "ephemeral", "ttl": "1h"}}]
    hour = vet(json.loads(json.dumps(body)), rules=rules, cap=10, api="messages")
    assert not five.cache_1h and hour.cache_1h
    assert worst_case_usd(100, five, p, rules) == pytest.approx(((100 + 64) * 1.25 + 10) / 1e6)
    assert worst_case_usd(100, hour, p, rules) == pytest.approx(((100 + 64) * 2 + 10) / 1e6)
    # An OpenAI-compatible router passes cache_control on to Anthropic; its usage says
    # cache_write_tokens, not which cache: every write is then priced at the 1-hour rate.
    chat = vet({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "big", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]},
        rules=rules, cap=10, api="chat")
    assert chat.cache_1h
    w = Usage(prompt_tokens=1000, completion_tokens=0, total_tokens=1000,
              cache_write_tokens=1000)
    assert cost_usd(w, p) == pytest.approx(1000 * 1.25 / 1e6)
    assert cost_usd(w, p, writes_1h=True) == pytest.approx(1000 * 2 / 1e6)


def test_worst_case_uses_the_dearest_input_price_and_output_per_family() -> None:
    rules = RequestRules(allow_tools=True)
    p = Price(input_per_mtok=1, output_per_mtok=10, cache_write_per_mtok=2)
    v = vet({"model": "m", "messages": [{"role": "user", "content": "x"}]}, rules=rules,
            cap=100, api="messages")
    assert v.body["max_tokens"] == 100 and v.max_tokens == 100
    assert worst_case_usd(1000, v, p, rules) == pytest.approx(((1000 + 64) * 2 + 1000) / 1e6)
    e = vet({"model": "m", "input": ["a", "b"]}, rules=rules, cap=100, api="embeddings")
    assert e.max_tokens == 0 and "max_tokens" not in e.body
    r = vet({"model": "m", "input": "x"}, rules=rules, cap=100, api="responses")
    assert r.body["max_output_tokens"] == 100
    t = vet({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 50,
             "thinking": {"type": "enabled", "budget_tokens": 40}}, rules=rules, cap=100,
            api="messages")
    assert t.max_tokens == 50
    with pytest.raises(Refusal, match=r"upstreams\.u\.rules\.max_n in cycle\.yaml"):
        vet({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 3},
            rules=rules, cap=100, where="upstreams.u.rules")


def test_an_inline_pdf_needs_the_policy_and_is_reserved_at_its_page_bound() -> None:
    """A 1 KB PDF of 100 pages is billed per page, not per byte: refused unless
    allow_documents, then reserved at document_token_bound; a text document is text."""
    pdf = {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}
    msg = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "document", "source": pdf}, {"type": "text", "text": "sum up"}]}]}
    resp = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_file", "filename": "a.pdf", "file_data": "data:application/pdf;"
         "base64,JVBERi0="}]}]}
    for api, body in (("messages", msg), ("responses", resp)):
        with pytest.raises(Refusal, match=r"upstreams\.u\.rules\.allow_documents") as exc:
            vet(json.loads(json.dumps(body)), rules=RequestRules(), cap=10, api=api,
                where="upstreams.u.rules")
        assert exc.value.code == "documents_not_allowed"
        rules = RequestRules(allow_documents=True, document_token_bound=5000)
        v = vet(json.loads(json.dumps(body)), rules=rules, cap=10, api=api)
        assert v.documents == 1
        p = Price(input_per_mtok=1, output_per_mtok=1)
        # input tokens at the dearest input price: a cache write's, 1.25 times the input
        assert worst_case_usd(100, v, p, rules) == pytest.approx(
            (100 + 64 + 5000) * 1.25 / 1e6 + 10 / 1e6)
    text_doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                               "data": "plain"}}
    v = vet({"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": [text_doc]}]}, rules=RequestRules(), cap=10,
        api="messages")
    assert v.documents == 0


@pytest.mark.parametrize("url", ["data:application/pdf;base64,JVBERi0=",
                                 "data:;base64,JVBERi0=", "data:,plain", "data:TEXT/html,x"])
def test_a_file_in_an_images_place_is_a_document(url: str) -> None:
    """helper-37: a PDF as a chat ``image_url`` data URL (which some OpenAI-compatible
    routers read as a document, billed by the page) passed with images allowed and
    documents off, reserved as one image. Only an ``image/*`` data URL is an image."""
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}]}]}
    with pytest.raises(Refusal, match="allow_documents") as exc:
        vet(json.loads(json.dumps(body)), rules=RequestRules(allow_images=True), cap=10)
    assert exc.value.code == "documents_not_allowed"
    v = vet(json.loads(json.dumps(body)), cap=10,
            rules=RequestRules(allow_images=True, allow_documents=True))
    assert (v.images, v.documents) == (0, 1)
    png = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}
    body["messages"][0]["content"] = [png]  # type: ignore[index]
    v = vet(body, rules=RequestRules(allow_images=True), cap=10)
    assert (v.images, v.documents) == (1, 0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "application/pdf",
                                         "data": "JVBERi0="}}
    msg = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": [block]}]}
    with pytest.raises(Refusal, match="allow_documents"):
        vet(msg, rules=RequestRules(allow_images=True), cap=10, api="messages")
    block["source"]["media_type"] = "image/png"  # type: ignore[index]
    v = vet(msg, rules=RequestRules(allow_images=True), cap=10, api="messages")
    assert (v.images, v.documents) == (1, 0)


def test_old_call_records_load_with_defaults() -> None:
    old = {"seq": 0, "ts": "2025-01-01T00:00:00.000+00:00", "run_id": "r", "role": "analyst",
           "upstream": "target", "stage": "s", "turn": 0, "provider": "openai", "model": "m",
           "fixture": False, "status": "ok", "latency_s": 0.1, "cost_usd": 0.001,
           "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
           "request_sha256": "0" * 64}
    rec = CallRecord.model_validate(old)
    assert rec.api == "chat" and rec.cost_basis is None
    assert rec.usage is not None and rec.usage.cached_tokens == 0


def test_a_request_offering_tools_is_reserved_with_the_providers_tool_prompt() -> None:
    """Anthropic adds a tool-use system prompt (346 tokens for Claude 4) to a request
    with tools, beyond its bytes: a small request with one tool cost more than the 64
    tokens of margin covered (an attack review)."""
    from runner.gateway.vet import TOOL_PROMPT_TOKENS

    rules = RequestRules(allow_tools=True)
    p = Price(input_per_mtok=1, output_per_mtok=1)
    body: dict[str, Any] = {"model": "m", "max_tokens": 10,
                            "messages": [{"role": "user", "content": "x"}]}
    plain = vet(json.loads(json.dumps(body)), rules=rules, cap=10, api="messages")
    body["tools"] = [{"name": "f", "input_schema": {"type": "object"}}]
    tools = vet(json.loads(json.dumps(body)), rules=rules, cap=10, api="messages")
    assert not plain.tools and tools.tools and TOOL_PROMPT_TOKENS >= 530
    assert worst_case_usd(100, tools, p, rules) - worst_case_usd(100, plain, p, rules) \
        == pytest.approx(TOOL_PROMPT_TOKENS * 1.25 / 1e6)  # at a cache write's price


def test_an_odd_event_type_or_a_usage_sum_past_the_bound_never_raises() -> None:
    """An attack review: a Responses event with ``"type": []`` raised TypeError
    (unhashable) in the parse; Anthropic's input + cache read + cache write summed past
    the record's token bound raised on the record. Neither raises: the stream is still
    measured; the implausible usage is no measurement (charged its worst case)."""
    done = {"type": "response.completed", "response": {"usage": {
        "input_tokens": 3, "output_tokens": 2, "total_tokens": 5}}}
    data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n"
                    for e in ({"type": ["x"]}, {"type": {"a": 1}}, done))
    got, err = inspect(data, stream=True, api="responses")
    assert err is None and got is not None and got.prompt_tokens == 3
    u = {"input_tokens": 10**12, "cache_read_input_tokens": 1, "output_tokens": 1}
    got, err = inspect(json.dumps({"type": "message", "content": [], "usage": u}).encode(),
                       stream=False, api="messages")
    assert got is None and err is None
