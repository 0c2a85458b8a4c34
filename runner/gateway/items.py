"""Responses API item ids: references resolved from the same container's earlier answers,
and no id of anyone else's sent upstream.

An agent on the Responses API with ``store: true`` (the API's default, and the Vercel AI
SDK's, which then sends its earlier assistant text and reasoning back as
``{"type": "item_reference", "id": ...}``) makes the upstream read items it keeps by id;
so does any input item that carries an ``id`` (the upstream reads a reasoning item's
stored content by it). The gateway cannot bound or replay state an upstream keeps, and it
must not let a role read items of other runs, roles or cases through the provider key it
holds. So:

- a reference is resolved by the gateway itself, and only to an output item of an
  earlier answer to the SAME binding (one container: one case, one trial): the item is
  put in the reference's place, so the request sent upstream is self-contained (it is
  what is recorded, priced and replayed); any other id is refused by name
  (``item_reference_unknown``) before anything is sent. An item written without a
  ``type`` (or with ``type: null``) and without a ``role`` is a reference too, as the
  API reads it;
- any other input item's ``id`` is sent only when this binding was answered with it;
  another id is dropped from the item before it is sent (the record counts it,
  ``dropped_ids``): the item's content goes upstream as written, so nothing stored is
  read by it. Agents resend their own items whole, ids and all, and some (the Codex CLI)
  give their own input messages fresh ids, which no upstream ever stored.

Bounded: per binding the items kept are at most :data:`MAX_ITEMS` and :data:`MAX_BYTES`
(the oldest are forgotten first; a reference to one is refused, naming why), the ids
known as its own at most :data:`MAX_ID_BYTES` of them (oldest first), ids of at most
:data:`MAX_ID` characters, each id resolved once per request
(``item_reference_repeated``), and the request with the items in place at most the
upstream's ``max_request_bytes`` (413 ``request_too_large``). :meth:`measure` checks
every id before any item is parsed and says how many bytes the items add, which the
gateway charges to the socket's byte rate and in-flight bytes, and sizes its offload by,
like the body's own.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from runner.gateway.usage import sse_events
from runner.gateway.vet import Refusal

MAX_ITEMS = 256
MAX_BYTES = 4 * 1024 * 1024
MAX_ID = 256
MAX_ID_BYTES = 1024 * 1024
REFERENCE = "item_reference"


def is_reference(item: object) -> bool:
    """``{"type": "item_reference", "id": ...}``, or an item with neither type nor role."""
    return isinstance(item, dict) and (item.get("type") == REFERENCE or (
        item.get("type") is None and item.get("role") is None and "id" in item))


def _shown(v: object) -> str:
    return ascii(v)[:80]


def _outputs(response: bytes, stream: bool) -> list[Any]:
    """The output items of one answer: its ``output``, or in a stream the completed
    response's (else every ``response.output_item.done`` item, in order)."""
    if not stream:
        obj = json.loads(response)
        out = obj.get("output") if isinstance(obj, dict) else None
        return out if isinstance(out, list) else []
    done: list[Any] = []
    for data in sse_events(response):
        if not data.startswith("{"):
            continue  # "[DONE]" and the like
        ev = json.loads(data)
        if not isinstance(ev, dict):
            continue
        kind = ev.get("type")
        if kind in ("response.completed", "response.incomplete"):
            resp = ev.get("response")
            out = resp.get("output") if isinstance(resp, dict) else None
            if isinstance(out, list) and out:
                return out
        elif kind == "response.output_item.done":
            done.append(ev.get("item"))
    return done


@dataclass(frozen=True)
class Resolution:
    """What :meth:`ResponseItems.measure` found: the referenced items (serialized) by
    their place in ``input``, and the bytes they add."""

    places: tuple[tuple[int, bytes], ...] = ()
    extra: int = 0
    dropped: tuple[int, ...] = ()
    """Places of items whose id is not this binding's: sent without it."""
    stored_tokens: int = 0
    """Most input tokens the upstream may read by the ids sent (its own stored content
    of them: a reasoning item's hidden reasoning): the output tokens of every earlier
    answer one of them came from, each answer once. The worst case reserves them."""

    def apply(self, body: dict[str, Any]) -> int:
        """Put the items in place in ``body["input"]`` and drop the ids not this
        binding's; returns how many items were put in place."""
        if not (self.places or self.dropped):
            return 0
        items: list[Any] = body["input"]  # a list: measure() found these places in it
        for i, data in self.places:
            items[i] = json.loads(data)
        for i in self.dropped:
            items[i] = {k: v for k, v in items[i].items() if k != "id"}
        return len(self.places)


NOTHING = Resolution()


class ResponseItems:
    """The output items of one binding's answers, by id (see the module docstring)."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._own: OrderedDict[str, tuple[int, int]] = OrderedDict()
        """Own id -> (its answer's serial, that answer's output tokens at most)."""
        self._own_bytes = 0
        self._answers = 0
        self._lock = threading.Lock()

    def _know(self, iid: str, answer: tuple[int, int]) -> None:
        if iid in self._own:
            self._own.move_to_end(iid)
            self._own[iid] = answer
            return
        self._own[iid] = answer
        self._own_bytes += len(iid)
        while self._own_bytes > MAX_ID_BYTES:
            old, _ = self._own.popitem(last=False)
            self._own_bytes -= len(old)

    def remember(self, response: bytes, *, stream: bool, tokens: int) -> int:
        """Keep the output items of a successful answer; returns how many. A malformed
        answer keeps nothing (it was already recorded as what it is). ``tokens``: most
        output tokens the answer holds (its usage, else the call's cap): what the
        upstream may read again by its items' ids."""
        try:
            items = _outputs(response, stream)
        except (ValueError, RecursionError):
            return 0
        kept: list[tuple[str, bytes | None]] = []  # serialized outside the lock
        for item in items:
            iid = item.get("id") if isinstance(item, dict) else None
            if not isinstance(iid, str) or not 0 < len(iid) <= MAX_ID:
                continue
            try:
                one = json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode()
            except (ValueError, RecursionError):
                continue  # e.g. a lone surrogate: not an item to send again
            kept.append((iid, one if len(one) <= MAX_BYTES else None))
        with self._lock:  # only to insert and evict: measure never waits on a scan
            self._answers += 1
            answer = (self._answers, max(0, tokens))
            for iid, data in kept:
                self._know(iid, answer)
                old = self._items.pop(iid, None)
                if old is not None:
                    self._bytes -= len(old)
                if data is not None:  # else its own id, but too large to keep
                    self._items[iid] = data
                    self._bytes += len(data)
            while len(self._items) > MAX_ITEMS or self._bytes > MAX_BYTES:
                _, old = self._items.popitem(last=False)
                self._bytes -= len(old)
        return sum(data is not None for _, data in kept)

    def measure(self, body: dict[str, Any], *, body_bytes: int,
                max_bytes: int) -> Resolution:
        """Check every id in ``body["input"]``, find the referenced items (parsing none
        of them) and the ids to drop. Refusal for a reference this binding was not
        answered with (or whose item was forgotten), an id referenced twice, an id not
        a string, or a request that would exceed ``max_bytes`` with the items in
        place."""
        items = body.get("input")
        if not isinstance(items, list):
            return NOTHING
        seen: set[str] = set()
        places: list[tuple[int, bytes]] = []
        dropped: list[int] = []
        answers: dict[int, int] = {}  # serial -> output tokens, of every own id sent
        added = 0
        own, kept = self._own, self._items
        # No lock: remember() changes these under its lock, and a lookup in a dict is
        # atomic; a scan of a large input on the pool never holds up a small request's
        # on the loop (or anything else).
        for i, item in enumerate(items):
            if type(item) is not dict:
                continue
            iid = item.get("id")
            reference = is_reference(item)
            if iid is None and not reference:
                continue
            if type(iid) is not str or not 0 < len(iid) <= MAX_ID:
                raise Refusal(400, "bad_request", f"input[{i}].id: an item id is a string "
                              f"of 1 to {MAX_ID} characters", f"input[{i}].id")
            mine = own.get(iid)
            if mine is not None:  # sent with its id (as is, or the item put in place)
                answers[mine[0]] = mine[1]
            if not reference:
                if mine is None:
                    dropped.append(i)
                continue
            where = f"input[{i}]"
            if set(item) - {"type", "id"}:
                raise Refusal(400, "bad_request", f"{where}: an item reference has only "
                              f"type and id; got {sorted(item)[:8]}", where)
            if iid in seen:
                raise Refusal(400, "item_reference_repeated", f"{where}: item "
                              f"{_shown(iid)} is referenced twice in one request", where)
            seen.add(iid)
            data = kept.get(iid)
            if data is None:
                why = (f"it was forgotten: a container keeps the output items of its "
                       f"latest answers, at most {MAX_ITEMS} items and {MAX_BYTES} bytes"
                       if iid in own else
                       "the gateway resolves a reference only to an output item of an "
                       "earlier answer to this same container (one case, one trial), "
                       "never to state the upstream keeps from elsewhere")
                raise Refusal(400, "item_reference_unknown", f"{where}: item "
                              f"{_shown(iid)} cannot be resolved: {why}; send the item "
                              "itself", where)
            added += len(data)
            if body_bytes + added > max_bytes:
                raise Refusal(413, "request_too_large", f"{where}: with its referenced "
                              f"items in place the request exceeds max_request_bytes "
                              f"({max_bytes}); send fewer or smaller items", where)
            places.append((i, data))
        return Resolution(tuple(places), added, tuple(dropped), sum(answers.values())) \
            if places or dropped or answers else NOTHING

    def resolve(self, body: dict[str, Any], *, body_bytes: int, max_bytes: int) -> int:
        """:meth:`measure`, then the items put in place (in ``body``); how many."""
        return self.measure(body, body_bytes=body_bytes, max_bytes=max_bytes).apply(body)
