"""Responses API item references, resolved from the same container's earlier answers.

An agent on the Responses API with ``store: true`` (the API's default, and the Vercel AI
SDK's, which then sends its earlier assistant text and reasoning back as
``{"type": "item_reference", "id": ...}``) makes the upstream read items it keeps. The
gateway cannot bound or replay state an upstream keeps, and it must not let a role read
items of other runs, roles or cases through the provider key it holds. So it resolves
a reference itself, and only to an output item of an earlier answer to the SAME binding
(one container: one case, one trial): the item is put in the reference's place, the
request sent upstream is self-contained (it is what is recorded, priced and replayed),
and any other id is refused by name (``item_reference_unknown``), before anything is
sent. An item written without a ``type`` and without a ``role`` (``{"id": ...}``) is a
reference too, as the API reads it.

Bounded: per binding at most :data:`MAX_ITEMS` items and :data:`MAX_BYTES` of them
(the oldest are forgotten first; a reference to one is refused, naming why), ids of at
most :data:`MAX_ID` characters, each id resolved once per request
(``item_reference_repeated``), and the request with the items in place at most the
upstream's ``max_request_bytes`` (413 ``request_too_large``).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from runner.gateway.usage import sse_events
from runner.gateway.vet import Refusal

MAX_ITEMS = 256
MAX_BYTES = 4 * 1024 * 1024
MAX_ID = 256
REFERENCE = "item_reference"


def is_reference(item: object) -> bool:
    """``{"type": "item_reference", "id": ...}``, or an item with neither type nor role."""
    return isinstance(item, dict) and (item.get("type") == REFERENCE or (
        "type" not in item and "role" not in item and "id" in item))


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


class ResponseItems:
    """The output items of one binding's answers, by id (see the module docstring)."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        self._bytes = 0
        self._forgotten: set[str] = set()
        self._lock = threading.Lock()

    def remember(self, response: bytes, *, stream: bool) -> int:
        """Keep the output items of a successful answer; returns how many. A malformed
        answer keeps nothing (it was already recorded as what it is)."""
        try:
            items = _outputs(response, stream)
        except (ValueError, RecursionError):
            return 0
        kept = 0
        with self._lock:
            for item in items:
                iid = item.get("id") if isinstance(item, dict) else None
                if not isinstance(iid, str) or not 0 < len(iid) <= MAX_ID:
                    continue
                data = json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode()
                if len(data) > MAX_BYTES:
                    self._forgotten.add(iid)
                    continue
                old = self._items.pop(iid, None)
                if old is not None:
                    self._bytes -= old[1]
                self._items[iid] = (data, len(data))
                self._bytes += len(data)
                self._forgotten.discard(iid)
                kept += 1
            while len(self._items) > MAX_ITEMS or self._bytes > MAX_BYTES:
                iid, (_, size) = self._items.popitem(last=False)
                self._bytes -= size
                if len(self._forgotten) < 4 * MAX_ITEMS:
                    self._forgotten.add(iid)
        return kept

    def resolve(self, body: dict[str, Any], *, body_bytes: int, max_bytes: int) -> int:
        """Put each referenced item in place in ``body["input"]`` (in place); returns how
        many were resolved. Refusal for an id this binding was not answered with, an id
        referenced twice, or a request that would exceed ``max_bytes``."""
        items = body.get("input")
        if not isinstance(items, list):
            return 0
        seen: set[str] = set()
        added = 0
        for i, item in enumerate(items):
            if not is_reference(item):
                continue
            where = f"input[{i}]"
            iid = item.get("id")
            if not isinstance(iid, str) or not 0 < len(iid) <= MAX_ID:
                raise Refusal(400, "bad_request", f"{where}: an item reference needs an id "
                              f"(a string of at most {MAX_ID} characters)", where)
            if set(item) - {"type", "id"}:
                raise Refusal(400, "bad_request", f"{where}: an item reference has only "
                              f"type and id; got {sorted(item)[:8]}", where)
            if iid in seen:
                raise Refusal(400, "item_reference_repeated", f"{where}: item {_shown(iid)} "
                              "is referenced twice in one request", where)
            seen.add(iid)
            with self._lock:
                found = self._items.get(iid)
                forgotten = iid in self._forgotten
            if found is None:
                why = (f"it was forgotten: a container keeps the output items of its "
                       f"latest answers, at most {MAX_ITEMS} items and {MAX_BYTES} bytes"
                       if forgotten else
                       "the gateway resolves a reference only to an output item of an "
                       "earlier answer to this same container (one case, one trial), "
                       "never to state the upstream keeps from elsewhere")
                raise Refusal(400, "item_reference_unknown", f"{where}: item {_shown(iid)} "
                              f"cannot be resolved: {why}; send the item itself", where)
            data, size = found
            added += size
            if body_bytes + added > max_bytes:
                raise Refusal(413, "request_too_large", f"{where}: with its referenced "
                              f"items in place the request exceeds max_request_bytes "
                              f"({max_bytes}); send fewer or smaller items", where)
            items[i] = json.loads(data)
        return len(seen)
