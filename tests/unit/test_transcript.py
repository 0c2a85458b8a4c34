"""One recorded call per API family as chat messages (runner.gateway.transcript): requests,
replies and streamed replies in each family's exact wire shape (as the openai and
anthropic SDK types define them), tools in chat shape, and hostile or unknown shapes
giving a named reason, never an exception."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runner.gateway.transcript import (
    MAX_BYTES,
    MAX_TOOL_CALLS,
    NOT_TURNS,
    arguments_are_objects,
    transcript,
)

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"]}
CHAT_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER_SCHEMA}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}


def j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def sse(events: list[Any], *, named: bool = False, done: bool = False) -> bytes:
    out = []
    for ev in events:
        head = f"event: {ev['type']}\n" if named else ""
        out.append(f"{head}data: {json.dumps(ev)}\n\n")
    if done:
        out.append("data: [DONE]\n\n")
    return "".join(out).encode()


# -- chat completions ---------------------------------------------------------------------

CHAT_REQUEST = {
    "model": "m", "tools": [CHAT_TOOL], "tool_choice": "auto",
    "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather "},
                                     {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    ]}
CHAT_MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "18C, sunny", "tool_call_id": "call_1"},
]


def chat_completion(message: dict[str, Any]) -> bytes:
    return j({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "message": message, "logprobs": None,
                           "finish_reason": "tool_calls"}],
              "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}})


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish}]}


def test_chat_request_and_tool_call_reply() -> None:
    reply = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}
    t = transcript("chat", j(CHAT_REQUEST), chat_completion(reply))
    assert t.reason is None and t.api == "chat"
    assert t.messages == CHAT_MESSAGES
    assert t.tools == [CHAT_TOOL]
    assert t.reply == {"role": "assistant", "content": "", "tool_calls": reply["tool_calls"]}
    assert arguments_are_objects(t.reply)


def test_old_log_without_api_is_chat() -> None:
    t = transcript(None, j(CHAT_REQUEST), chat_completion({"role": "assistant",
                                                           "content": "hi"}))
    assert t.api == "chat" and t.reason is None
    assert t.reply == {"role": "assistant", "content": "hi"}


def test_chat_stream_reassembles_text_and_tool_call_deltas_by_index() -> None:
    body = sse([
        chunk({"role": "assistant", "content": "Checking"}),
        chunk({"content": " both."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"ci'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": 'ty":"Oslo"}'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Rome"}'}}]}),
        chunk({}, "tool_calls"),
        {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2,
                                  "total_tokens": 3}},
    ], done=True)
    t = transcript("chat", j(CHAT_REQUEST), body, stream=True)
    assert t.reason is None
    assert t.reply == {"role": "assistant", "content": "Checking both.", "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]}


# -- OpenAI Responses ----------------------------------------------------------------------

RESP_TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
             "parameters": WEATHER_SCHEMA, "strict": True}
RESP_REQUEST = {
    "model": "m", "instructions": "be brief", "tools": [RESP_TOOL],
    "input": [
        {"role": "user", "content": "weather in Paris?"},  # EasyInputMessage, no type
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city":"Paris"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C, sunny"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "It is 18C.", "annotations": []}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "and Rome?"}]},
    ]}
RESP_MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "18C, sunny", "tool_call_id": "call_1"},
    {"role": "assistant", "content": "It is 18C."},
    {"role": "user", "content": "and Rome?"},
]
RESP_CALL = {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "get_weather",
             "arguments": '{"city":"Rome"}', "status": "completed"}
RESP_MSG = {"type": "message", "id": "msg_2", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]}
RESP_REPLY = {"role": "assistant", "content": "Looking.", "tool_calls": [
    {"id": "call_2", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]}


def response_obj(output: list[Any]) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "created_at": 1, "model": "m",
            "status": "completed", "output": output, "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [RESP_TOOL],
            "usage": {"input_tokens": 5, "output_tokens": 4, "total_tokens": 9,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def test_responses_request_items_and_output() -> None:
    t = transcript("responses", j(RESP_REQUEST), j(response_obj(
        [{"type": "reasoning", "id": "rs_2", "summary": []}, RESP_MSG, RESP_CALL])))
    assert t.reason is None
    assert t.messages == RESP_MESSAGES
    assert t.tools == [CHAT_TOOL]
    assert t.reply == RESP_REPLY


def test_responses_string_input() -> None:
    t = transcript("responses", j({"model": "m", "input": "hello"}),
                   j(response_obj([RESP_MSG])))
    assert t.messages == [{"role": "user", "content": "hello"}]
    assert t.reply == {"role": "assistant", "content": "Looking."}


def responses_stream(*, completed: bool) -> bytes:
    item = {**RESP_CALL, "arguments": "", "status": "in_progress"}
    msg = {**RESP_MSG, "content": [], "status": "in_progress"}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "sequence_number": 0,
         "response": {**response_obj([]), "status": "in_progress"}},
        {"type": "response.output_item.added", "sequence_number": 1, "output_index": 0,
         "item": msg},
        {"type": "response.content_part.added", "sequence_number": 2, "output_index": 0,
         "item_id": "msg_2", "content_index": 0,
         "part": {"type": "output_text", "text": "", "annotations": []}},
        {"type": "response.output_text.delta", "sequence_number": 3, "output_index": 0,
         "item_id": "msg_2", "content_index": 0, "delta": "Look", "logprobs": []},
        {"type": "response.output_text.delta", "sequence_number": 4, "output_index": 0,
         "item_id": "msg_2", "content_index": 0, "delta": "ing.", "logprobs": []},
        {"type": "response.output_item.added", "sequence_number": 5, "output_index": 1,
         "item": item},
        {"type": "response.function_call_arguments.delta", "sequence_number": 6,
         "output_index": 1, "item_id": "fc_2", "delta": '{"city":'},
        {"type": "response.function_call_arguments.delta", "sequence_number": 7,
         "output_index": 1, "item_id": "fc_2", "delta": '"Rome"}'},
    ]
    if completed:
        events.append({"type": "response.completed", "sequence_number": 8,
                       "response": response_obj([RESP_MSG, RESP_CALL])})
    return sse(events, named=True)


@pytest.mark.parametrize("completed", [True, False], ids=["completed", "reassembled"])
def test_responses_stream(completed: bool) -> None:
    t = transcript("responses", j(RESP_REQUEST), responses_stream(completed=completed),
                   stream=True)
    assert t.reason is None
    assert t.reply == RESP_REPLY


def test_responses_stream_parts_switch_and_a_done_item_replaces_its_deltas() -> None:
    """Deltas gather as pieces joined at the end: a text part, a refusal part, text
    again each stay their own part in order; an item's done event is the whole item."""
    msg = {"type": "message", "role": "assistant", "content": []}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": ""}
    ev = [{"type": "response.output_item.added", "output_index": 0, "item": msg},
          *({"type": f"response.{k}.delta", "output_index": 0, "delta": d}
            for k, d in (("output_text", "A"), ("output_text", "b"), ("refusal", "R"),
                         ("output_text", "c"))),
          {"type": "response.output_item.added", "output_index": 1, "item": call},
          {"type": "response.function_call_arguments.delta", "output_index": 1,
           "delta": '{"city": "Pa'},
          {"type": "response.output_item.done", "output_index": 1,
           "item": {**call, "arguments": '{"city":"Rome"}'}},
          {"type": "response.function_call_arguments.delta", "output_index": 0,
           "delta": "ignored: not a call"}]
    body = sse(ev[:-1], named=True)
    t = transcript("responses", j(RESP_REQUEST), body, stream=True)
    assert t.reason is None
    assert t.reply == {"role": "assistant", "content": "AbRc", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]}


def test_responses_completed_is_the_reply_not_the_deltas() -> None:
    body = responses_stream(completed=False) + sse([{
        "type": "response.completed", "sequence_number": 9,
        "response": response_obj([{**RESP_MSG, "content": [
            {"type": "output_text", "text": "Final.", "annotations": []}]}])}], named=True)
    t = transcript("responses", j(RESP_REQUEST), body, stream=True)
    assert t.reply == {"role": "assistant", "content": "Final."}


# -- Anthropic Messages --------------------------------------------------------------------

MSG_TOOL = {"name": "get_weather", "description": "Weather of a city",
            "input_schema": WEATHER_SCHEMA}
MSG_REQUEST = {
    "model": "claude-x", "max_tokens": 256, "tools": [MSG_TOOL],
    "system": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
    "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "need a tool", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "18C, sunny"}]},
            {"type": "text", "text": "and Rome?"}]},
    ]}
MSG_MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "toolu_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "content": "18C, sunny", "tool_call_id": "toolu_1"},
    {"role": "user", "content": "and Rome?"},
]
MSG_REPLY = {"role": "assistant", "content": "Then Rome.", "tool_calls": [
    {"id": "toolu_2", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]}


def message_obj(content: list[Any]) -> dict[str, Any]:
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
            "content": content, "stop_reason": "tool_use", "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 5}}


def test_messages_request_and_reply() -> None:
    t = transcript("messages", j(MSG_REQUEST), j(message_obj([
        {"type": "text", "text": "Then Rome."},
        {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
         "input": {"city": "Rome"}}])))
    assert t.reason is None
    assert t.messages == MSG_MESSAGES
    assert t.tools == [CHAT_TOOL]
    assert t.reply == MSG_REPLY


def test_messages_string_tool_result_and_plain_system() -> None:
    req = {"model": "c", "max_tokens": 5, "system": "sys", "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "ok", "is_error": False}]}]}
    t = transcript("messages", j(req), j(message_obj([{"type": "text", "text": "done"}])))
    assert t.messages == [{"role": "system", "content": "sys"},
                          {"role": "tool", "content": "ok", "tool_call_id": "t1"}]


def test_messages_stream() -> None:
    events = [
        {"type": "message_start", "message": {**message_obj([]), "stop_reason": None}},
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "text_delta", "text": "Then "}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "text_delta", "text": "Rome."}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {
            "type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "input_json_delta", "partial_json": ""}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "input_json_delta", "partial_json": '{"city": "Ro'}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "input_json_delta", "partial_json": 'me"}'}},
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
         "usage": {"output_tokens": 9}},
        {"type": "message_stop"},
    ]
    t = transcript("messages", j(MSG_REQUEST), sse(events, named=True), stream=True)
    assert t.reason is None
    assert t.reply == MSG_REPLY


# -- not turns, hostile and unknown shapes -------------------------------------------------


@pytest.mark.parametrize("api", sorted(NOT_TURNS))
def test_embeddings_and_count_tokens_are_not_turns(api: str) -> None:
    with pytest.raises(ValueError, match="not conversation turns"):
        transcript(api, b"{}", b"{}")


@pytest.mark.parametrize(("api", "request_", "response", "reason"), [
    pytest.param("chat", b"not json", None, "request_not_json", id="request-garbage"),
    pytest.param("chat", b'{"messages": []}', None, "request.messages: empty", id="empty"),
    pytest.param("chat", b'{"a": 1, "a": 2}', None, "request_not_json", id="duplicate-keys"),
    pytest.param("chat", b'{"messages": ' + b"[" * 200 + b"]" * 200 + b"}", None,
                 "request_not_json", id="too-deep"),
    pytest.param("chat", j({"messages": [{"role": "function", "content": "x"}]}), None,
                 "role 'function' unsupported", id="legacy-function-role"),
    pytest.param("chat", j({"messages": [{"role": "tool", "content": "x"}]}), None,
                 "tool_call_id: expected a string", id="tool-without-id"),
    pytest.param("chat", j(CHAT_REQUEST), b"NaN", "response_not_json", id="nan-response"),
    pytest.param("chat", j(CHAT_REQUEST), j({"choices": []}), "response.choices: empty",
                 id="no-choice"),
    pytest.param("chat", j(CHAT_REQUEST), b"data: {\"choices\": [{\"delta\": {\"tool_calls\":"
                 b" [{\"index\": 99999999}]}}]}\n\n", "index 99999999 is not 0..",
                 id="stream-index-out-of-range"),
    pytest.param("chat", j(CHAT_REQUEST), b"data: {oops\n\n", "stream_event_not_json",
                 id="stream-garbage"),
    pytest.param("chat", j(CHAT_REQUEST), b"data: [DONE]\n\n", "stream_without_events",
                 id="stream-empty"),
    pytest.param("responses", j({"input": [{"type": "item_reference", "id": "x"}]}), None,
                 "type 'item_reference' unsupported", id="responses-item-reference"),
    pytest.param("responses", j({"input": "x", "tools": [{"type": "web_search"}]}), None,
                 "is not a function tool", id="responses-builtin-tool"),
    pytest.param("responses", j({"input": "x"}), sse([{"type": "response.failed"}]),
                 "response.failed", id="responses-failed-stream"),
    pytest.param("messages", j({"messages": [{"role": "robot", "content": "x"}]}), None,
                 "role 'robot' unsupported", id="messages-unknown-role"),
    pytest.param("messages", j({"messages": [{"role": "user", "content": "x"}],
                                "tools": [{"type": "bash_20250124", "name": "bash"}]}), None,
                 "is not a client tool", id="messages-server-tool"),
    pytest.param("messages", j(MSG_REQUEST), sse([
        {"type": "content_block_start", "index": 0, "content_block": {
            "type": "tool_use", "id": "t", "name": "n", "input": {}}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "input_json_delta", "partial_json": '{"a":'}},
        {"type": "content_block_stop", "index": 0}]), "is not JSON",
                 id="messages-truncated-tool-input"),
    pytest.param("messages", j(MSG_REQUEST), sse([
        {"type": "content_block_delta", "index": 3,
         "delta": {"type": "text_delta", "text": "x"}}]), "before its start",
                 id="messages-delta-before-start"),
    pytest.param("messages", j(MSG_REQUEST), j({"type": "error", "error": {
        "type": "overloaded_error", "message": "busy"}}), "response is an error",
                 id="messages-error"),
    pytest.param("grpc", b"{}", None, "unknown_api", id="unknown-api"),
])
def test_unknown_or_hostile_shapes_give_a_named_reason(api: str, request_: bytes,
                                                       response: bytes | None,
                                                       reason: str) -> None:
    t = transcript(api, request_, response, stream=response is not None
                   and response.startswith(b"data:"))
    assert t.reason is not None and reason in t.reason, t.reason
    assert t.reply is None


def test_no_response_is_a_named_reason() -> None:
    t = transcript("chat", j(CHAT_REQUEST), None)
    assert t.reason == "no_response" and t.messages == CHAT_MESSAGES


def test_oversized_and_wrongly_typed_values_never_raise() -> None:
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * MAX_BYTES + b'"}]}'
    assert "request_too_large" in (transcript("chat", big, None).reason or "")
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
             for i in range(MAX_TOOL_CALLS + 1)]
    t = transcript("chat", j(CHAT_REQUEST),
                   chat_completion({"role": "assistant", "content": None, "tool_calls": calls}))
    assert "over" in (t.reason or "")
    for hostile in ([1], {"messages": [1]}, {"messages": [{"role": "user", "content": 5}]},
                    {"messages": [{"role": "assistant", "tool_calls": [{"function": 1}]}]},
                    {"input": [{"type": "function_call", "name": None}]},
                    {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}):
        for api in ("chat", "responses", "messages"):
            assert transcript(api, j(hostile), None).reason is not None


def test_arguments_are_objects() -> None:
    def msg(args: str) -> dict[str, Any]:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]}

    assert arguments_are_objects(msg('{"a": 1}'))
    assert not arguments_are_objects(msg("[1]"))
    assert not arguments_are_objects(msg('{"a": '))
    assert arguments_are_objects({"role": "assistant", "content": "x"})
