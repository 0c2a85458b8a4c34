"""The analyst stage's scheduler: cases start in plan order, ``limit`` at once, while the
containers of the next ones are prepared ahead (inputs staged, gateway bound, holder
waiting), each for exactly one case.

Two parts, both thread-safe and knowing nothing of cases or containers:

- :class:`Gate` admits job ``i`` only after job ``i - 1`` and while fewer than ``limit``
  run; the limit may change while jobs run (``concurrency: auto``). A case leaves it when
  its command ended and its output is copied out, so the next case's command starts
  while the last one's container is removed and its record written.
- :class:`Lookahead` prepares jobs in order on one thread, never more than ``depth()``
  prepared and not yet taken. :meth:`Lookahead.take` hands job ``i`` its own prepared
  value (or prepares it on the spot when the preparer has not got there), never another
  job's; :meth:`Lookahead.close` stops the preparer and discards every prepared value no
  job took, on every way out of a stage (interrupt, drift, budget halt, engine error).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

T = TypeVar("T")

_IDLE_WAIT_S = 0.25
"""How often a waiting preparer re-reads a depth that may have changed."""


class Gate:
    """Jobs enter in index order, at most ``limit`` inside at once."""

    def __init__(self, limit: int) -> None:
        self._cond = threading.Condition()
        self._limit = max(1, limit)
        self._next = 0
        self._inside = 0
        self._open = False

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def inside(self) -> int:
        return self._inside

    def set_limit(self, limit: int) -> None:
        """A lower limit lets running jobs finish; a higher one admits the next at once."""
        with self._cond:
            self._limit = max(1, limit)
            self._cond.notify_all()

    def enter(self, index: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._open or (
                self._next == index and self._inside < self._limit))
            self._next = max(self._next, index + 1)
            self._inside += 1

    def leave(self) -> None:
        with self._cond:
            self._inside -= 1
            self._cond.notify_all()

    def open(self) -> None:
        """Let every waiting job through (a stopping stage: each sees the stop itself)."""
        with self._cond:
            self._open = True
            self._cond.notify_all()


@dataclass
class _Slot(Generic[T]):
    state: str = "new"
    """new, preparing, ready, taken (by its job) or discarded (by close)."""
    value: T | None = None
    error: BaseException | None = None
    ready_at: float | None = None


class Lookahead(Generic[T]):
    """Prepares ``n`` jobs ahead of their turn, each value for its own job only."""

    def __init__(self, n: int, *, prepare: Callable[[int], T],
                 discard: Callable[[T], None], depth: Callable[[], int],
                 closed: Callable[[], BaseException]) -> None:
        self._prepare = prepare
        self._discard = discard
        self._depth = depth
        self._closed_error = closed
        self._slots: list[_Slot[T]] = [_Slot() for _ in range(n)]
        self._cond = threading.Condition()
        self._ready = 0
        self._closed = False
        self._own: set[int] = set()
        """Jobs preparing their own value (the preparer was not there yet)."""
        self.waits: dict[int, float] = {}
        """Job -> seconds its prepared value waited before the job took it (0 when the
        job prepared its own)."""
        self._thread = threading.Thread(target=self._loop, name="lookahead", daemon=True)

    def start(self) -> Lookahead[T]:
        self._thread.start()
        return self

    # -- the preparer ------------------------------------------------------------
    def _loop(self) -> None:
        for i, slot in enumerate(self._slots):
            with self._cond:
                # never ahead of a job still preparing its own (earlier) value: on a
                # cluster, a later case's container could take the node slot the
                # earlier one waits for, and wait itself for a turn that never comes
                while not self._closed and (self._ready >= self._depth() or any(
                        k < i for k in self._own)):
                    self._cond.wait(_IDLE_WAIT_S)
                if self._closed:
                    return
                if slot.state != "new":
                    continue  # its job came first and prepares it itself
                slot.state = "preparing"
            value: T | None = None
            error: BaseException | None = None
            try:
                value = self._prepare(i)
            except BaseException as exc:  # the job re-raises it as its own failure
                error = exc
            with self._cond:
                late = self._closed
                if not late:
                    slot.state, slot.value, slot.error = "ready", value, error
                    slot.ready_at = time.monotonic()
                    self._ready += 1
                else:
                    slot.state = "discarded"
                self._cond.notify_all()
            if late and value is not None:
                self._discard(value)

    # -- the jobs ----------------------------------------------------------------
    def take(self, index: int) -> T:
        """Job ``index``'s prepared value, once; prepared here if the preparer is not
        there yet; its prepare's exception raised here; after :meth:`close`, the
        ``closed`` error."""
        slot = self._slots[index]
        with self._cond:
            # closed: a prepare stuck in the engine is not waited for (the preparer
            # discards its late value itself)
            self._cond.wait_for(lambda: slot.state != "preparing" or self._closed)
            if slot.state in ("taken", "discarded") or (
                    self._closed and slot.state in ("new", "preparing")):
                if slot.state == "taken":
                    raise AssertionError(f"job {index} taken twice")
                raise self._closed_error()
            own = slot.state == "new"
            if own:
                self._own.add(index)
            else:
                self._ready -= 1
                self.waits[index] = time.monotonic() - (slot.ready_at or time.monotonic())
            slot.state = "taken"
            value, error = slot.value, slot.error
            slot.value = slot.error = None
            self._cond.notify_all()
        if own:
            self.waits[index] = 0.0
            try:
                return self._prepare(index)
            finally:
                with self._cond:
                    self._own.discard(index)
                    self._cond.notify_all()
        if error is not None:
            raise error
        return cast(T, value)  # a prepare may return None (nothing to run) as its T

    def close(self, *, join_s: float = 30.0) -> None:
        """Stop preparing and discard what no job took; idempotent. A prepare in flight
        is discarded by the preparer itself when it returns (waited for up to
        ``join_s``; the run's leftovers sweep covers a longer one)."""
        with self._cond:
            self._closed = True
            left = [s for s in self._slots if s.state == "ready"]
            for s in left:
                s.state = "discarded"
            self._ready = 0
            self._cond.notify_all()
        first: BaseException | None = None
        for s in left:
            value, s.value, s.error = s.value, None, None
            try:
                if value is not None:
                    self._discard(value)
            except BaseException as exc:  # every other one is still discarded
                first = first or exc
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(join_s)
        if first is not None:
            raise first
