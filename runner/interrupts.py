"""SIGTERM/SIGINT for the controller: the first signal unwinds, a second exits at once.

The first signal raises ``KeyboardInterrupt`` in the main thread so that every
``finally`` kills and removes its container and the cycle runner writes its verdict
and receipt; inside :func:`shielded` (writing the verdict and receipt) it is only
noted, so that those files are whole. A second signal ends the process immediately
with 130: the operator asked twice, and ``cyclebox gc`` sweeps what is left.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from runner.errors import EXIT_INTERRUPTED

REDELIVER_S = 0.01
"""How soon a swallowed first signal is delivered again."""


class _State:
    signals = 0
    shield = 0
    pending = False
    redeliver = False
    """Set while a first signal's KeyboardInterrupt, swallowed, is delivered again."""


_state = _State()


def _handler(_sig: int, _frame: FrameType | None) -> None:
    if _state.redeliver:  # the same first signal again (see _unraisable), not a second
        _state.redeliver = False
        raise KeyboardInterrupt
    _state.signals += 1
    if _state.signals > 1:
        os._exit(EXIT_INTERRUPTED)
    if _state.shield:
        _state.pending = True
        return
    raise KeyboardInterrupt


def _unraisable(args: Any) -> None:
    """A KeyboardInterrupt raised while the main thread ran a finalizer (``__del__``, a
    weakref or GC callback) is swallowed by Python ("Exception ignored in ..."): the
    first signal would be lost and the controller would go on as if none came. Deliver
    it again, at the main thread's next step outside the finalizer."""
    if (isinstance(args.exc_value, KeyboardInterrupt) and _state.signals == 1
            and threading.current_thread() is threading.main_thread()):
        # From another thread, a moment later: delivered now, it would run inside this
        # hook (still the finalizer's context) and be swallowed again.
        _state.redeliver = True
        timer = threading.Timer(REDELIVER_S, _thread.interrupt_main, (signal.SIGINT,))
        timer.daemon = True
        timer.start()
        return
    _previous_unraisable(args)


_previous_unraisable = sys.unraisablehook


def install() -> None:
    """Route SIGTERM and SIGINT to the handler above (main thread only), and make sure a
    first signal that lands inside a finalizer still unwinds (:func:`_unraisable`)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _handler)
        signal.signal(signal.SIGINT, _handler)
        sys.unraisablehook = _unraisable


def seen() -> bool:
    """True once a first signal arrived (whether it unwound or was held)."""
    return _state.signals > 0


@contextmanager
def shielded() -> Iterator[None]:
    """Hold a first signal while evidence is written; a second still exits at once."""
    _state.shield += 1
    try:
        yield
    finally:
        _state.shield -= 1


@contextmanager
def deferred() -> Iterator[None]:
    """Hold a first signal across a few steps that must not be cut in half (making a
    staging copy and handing it to the code that removes it); it unwinds right after,
    as ``KeyboardInterrupt``, if it arrived meanwhile. Only the main thread is ever
    interrupted, so elsewhere this holds nothing (a worker thread must not shield the
    main thread's unwinding)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = _state.pending
    _state.shield += 1
    try:
        yield
    finally:
        _state.shield -= 1
    if _state.pending and not before and not _state.shield:
        _state.pending = False
        raise KeyboardInterrupt
