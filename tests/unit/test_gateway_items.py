"""Item references resolve only to this binding's own answers, within bounds."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runner.gateway import items as items_mod
from runner.gateway.items import ResponseItems, is_reference
from runner.gateway.vet import Refusal


def answer(*ids: str, text: str = "x") -> bytes:
    return json.dumps({"output": [{"id": i, "type": "message", "role": "assistant",
                                   "content": [{"type": "output_text", "text": text}]}
                                  for i in ids]}).encode()


def sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"event: e\ndata: " + json.dumps(e).encode() + b"\n\n" for e in events)


def resolve(store: ResponseItems, *inputs: Any, max_bytes: int = 1 << 20) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "input": list(inputs)}
    store.resolve(body, body_bytes=len(json.dumps(body)), max_bytes=max_bytes)
    return body


def refused(store: ResponseItems, *inputs: Any, max_bytes: int = 1 << 20) -> Refusal:
    with pytest.raises(Refusal) as exc:
        resolve(store, *inputs, max_bytes=max_bytes)
    return exc.value


def test_a_reference_is_replaced_by_the_item_and_other_items_are_untouched() -> None:
    s = ResponseItems()
    assert s.remember(answer("msg_1"), stream=False, tokens=0) == 1
    user = {"role": "user", "content": "hi"}
    body = resolve(s, user, {"type": "item_reference", "id": "msg_1"})
    assert body["input"][1]["id"] == "msg_1" and body["input"][1]["role"] == "assistant"
    assert body["input"][0] is user


def test_streamed_answers_are_remembered_from_the_completed_response_or_the_items() -> None:
    s = ResponseItems()
    item = {"id": "rs_1", "type": "reasoning", "summary": []}
    assert s.remember(sse({"type": "response.output_item.done", "item": item},
                          {"type": "response.completed", "response": {"output": [item]}}),
                      stream=True, tokens=0) == 1
    assert s.remember(sse({"type": "response.output_item.done",  # cut short
                           "item": {**item, "id": "rs_2"}}), stream=True, tokens=0) == 1
    assert resolve(s, {"id": "rs_2"})["input"] == [{**item, "id": "rs_2"}]


@pytest.mark.parametrize("bad", [b"{", b"[]", b'{"output": 3}', b"\xff",
                                 b"[" * 100_000 + b"]" * 100_000])
def test_a_malformed_answer_keeps_nothing_and_never_raises(bad: bytes) -> None:
    s = ResponseItems()
    assert s.remember(bad, stream=False, tokens=0) == 0
    assert s.remember(bad, stream=True, tokens=0) == 0


def test_unknown_repeated_and_malformed_references_are_refused_by_name() -> None:
    s = ResponseItems()
    s.remember(answer("msg_1"), stream=False, tokens=0)
    assert refused(s, {"type": "item_reference", "id": "msg_9"}).code == "item_reference_unknown"
    assert refused(s, {"id": "msg_9"}).code == "item_reference_unknown"  # no type, no role
    r = refused(s, {"id": "msg_1"}, {"type": "item_reference", "id": "msg_1"})
    assert (r.code, r.param) == ("item_reference_repeated", "input[1]")
    assert refused(s, {"type": "item_reference", "id": 7}).code == "bad_request"
    assert refused(s, {"type": "item_reference", "id": "msg_1", "role": "x"}).code == (
        "bad_request")
    assert not is_reference({"id": "m", "role": "user", "content": "hi"})  # a message


def test_the_items_in_place_may_not_exceed_the_request_cap() -> None:
    s = ResponseItems()
    s.remember(answer("msg_1", text="y" * 5000), stream=False, tokens=0)
    r = refused(s, {"id": "msg_1"}, max_bytes=4000)
    assert (r.status, r.code) == (413, "request_too_large")


def test_the_oldest_items_are_forgotten_past_the_cap_and_a_reference_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(items_mod, "MAX_ITEMS", 2)
    s = ResponseItems()
    for n in range(3):
        s.remember(answer(f"msg_{n}"), stream=False, tokens=0)
    r = refused(s, {"id": "msg_0"})
    assert r.code == "item_reference_unknown" and "forgotten" in r.message
    assert resolve(s, {"id": "msg_1"}, {"id": "msg_2"})["input"][1]["id"] == "msg_2"
    monkeypatch.setattr(items_mod, "MAX_BYTES", 10)  # an item over the cap is never kept
    s.remember(answer("msg_big"), stream=False, tokens=0)
    assert "forgotten" in refused(s, {"id": "msg_big"}).message


def test_an_id_not_this_bindings_own_is_dropped_from_its_item() -> None:
    s = ResponseItems()
    s.remember(answer("msg_1"), stream=False, tokens=0)
    own = {"type": "message", "id": "msg_1", "role": "assistant", "content": "x"}
    assert resolve(s, own)["input"] == [own]  # resent whole, id and all: forwarded
    other = {"type": "reasoning", "id": "rs_other", "summary": []}
    found = s.measure({"input": [own, other]}, body_bytes=10, max_bytes=1 << 20)
    assert (found.places, found.dropped, found.extra) == ((), (1,), 0)
    assert resolve(s, own, other)["input"] == [own, {"type": "reasoning", "summary": []}]
    assert other["id"] == "rs_other"  # the container's own object is not changed
    r = refused(s, {"type": "reasoning", "id": 7})
    assert (r.code, r.param) == ("bad_request", "input[0].id")
    no_id = {"type": "message", "id": None, "role": "user", "content": "x"}
    assert resolve(s, no_id)["input"] == [no_id]


def test_a_reference_with_type_null_is_one() -> None:
    s = ResponseItems()
    s.remember(answer("msg_1"), stream=False, tokens=0)
    assert resolve(s, {"type": None, "id": "msg_1"})["input"][0]["role"] == "assistant"


def test_every_id_is_checked_before_any_item_is_put_in_place() -> None:
    s = ResponseItems()
    s.remember(answer("msg_1", "msg_2"), stream=False, tokens=0)
    body: dict[str, Any] = {"input": [{"id": "msg_1"}, {"id": "msg_2"}, {"id": "nope"}]}
    with pytest.raises(Refusal):
        s.measure(body, body_bytes=10, max_bytes=1 << 20)
    assert body["input"][0] == {"id": "msg_1"}  # nothing parsed, nothing changed
    found = s.measure({"input": [{"id": "msg_1"}, {"id": "msg_2"}]}, body_bytes=10,
                      max_bytes=1 << 20)
    assert [i for i, _ in found.places] == [0, 1]
    assert found.extra == sum(len(d) for _, d in found.places) > 0


def test_the_ids_known_as_its_own_are_bounded_oldest_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(items_mod, "MAX_ID_BYTES", 10)  # two 5-character ids
    s = ResponseItems()
    for n in range(3):
        s.remember(answer(f"msg_{n}"), stream=False, tokens=0)
    assert s.measure({"input": [{"type": "message", "id": "msg_0", "role": "user",
                                 "content": "x"}]}, body_bytes=1, max_bytes=99).dropped == (0,)
    assert resolve(s, {"id": "msg_2"})["input"][0]["id"] == "msg_2"


def test_measuring_never_waits_on_the_lock_that_remembering_takes() -> None:
    """A large input is measured on the pool while a small request of the same container
    is measured on the event loop: neither may wait on the other, or on remember()."""
    import threading

    s = ResponseItems()
    s.remember(answer("msg_1"), stream=False, tokens=0)
    done = threading.Event()

    def measure() -> None:
        resolve(s, {"id": "msg_1"})
        done.set()

    with s._lock:  # as remember() holds it while it inserts
        t = threading.Thread(target=measure)
        t.start()
        assert done.wait(5), "measure waited on the lock"
    t.join()


def test_an_answer_item_that_cannot_be_serialized_is_not_kept() -> None:
    s = ResponseItems()
    bad = json.dumps({"output": [{"id": "msg_1", "type": "message", "text": "\ud800"},
                                 {"id": "msg_2", "type": "message"}]}).encode()
    assert s.remember(bad, stream=False, tokens=0) == 1
    assert refused(s, {"id": "msg_1"}).code == "item_reference_unknown"


def test_ids_sent_again_carry_their_answers_output_tokens_once_per_answer() -> None:
    """What the upstream may read by the ids sent: each answer they came from counts its
    output tokens once (two items of one answer are one answer's tokens); a reference put
    in place carries its id too; an id that is not this binding's counts nothing."""
    s = ResponseItems()
    s.remember(answer("rs_1", "msg_1"), stream=False, tokens=700)
    s.remember(answer("rs_2"), stream=False, tokens=50)

    def stored(*inputs: Any) -> int:
        body: dict[str, Any] = {"model": "m", "input": list(inputs)}
        return s.measure(body, body_bytes=100, max_bytes=1 << 20).stored_tokens

    assert stored({"type": "reasoning", "id": "rs_1", "summary": []}) == 700
    assert stored({"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "item_reference", "id": "msg_1"}) == 700
    assert stored({"type": "item_reference", "id": "msg_1"},
                  {"type": "reasoning", "id": "rs_2", "summary": []}) == 750
    assert stored({"type": "reasoning", "id": "rs_other", "summary": []}) == 0
    assert stored({"role": "user", "content": "hi"}) == 0
