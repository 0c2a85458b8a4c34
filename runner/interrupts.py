"""SIGTERM/SIGINT for the controller: the first signal unwinds, a second exits at once.

The first signal raises ``KeyboardInterrupt`` in the main thread so that every
``finally`` kills and removes its container and the cycle runner writes its verdict
and receipt; inside :func:`shielded` (writing the verdict and receipt) it is only
noted, so that those files are whole. A second signal ends the process immediately
with 130: the operator asked twice, and ``cyclebox gc`` sweeps what is left.

Python runs a signal's handler only in the main thread, and only once that thread
steps: a signal the kernel hands to another thread (the controller runs many) leaves a
main thread blocked in a wait (a future's result, a lock) asleep until the wait ends,
which for a slow case is minutes. So every signal is also written to a wake-up pipe
(:func:`signal.set_wakeup_fd`), and a watcher thread, reading it, knocks on the main
thread with a no-op signal aimed at it (:data:`NUDGE`) until the handler has run: the
wait is interrupted and the handler runs at once.

CPython itself can swallow the first signal's ``KeyboardInterrupt`` without a word: when
the handler runs inside an io object's finalizer (``IOBase`` evaluating ``closed`` or
calling ``close()`` as the object is freed, e.g. a urllib3 response), the finalizer
clears whatever was raised, and unlike ``__del__`` it does not report it to
``sys.unraisablehook``. The controller then went on waiting for cases that sleep. So the
places where the main thread waits or moves on to new work call :func:`check` (or wait
with :func:`result`): a first signal that has come and is not held unwinds there.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from types import FrameType
from typing import Any, TypeVar

from runner.errors import EXIT_INTERRUPTED
from runner.failures import one_line

T = TypeVar("T")

REDELIVER_S = 0.01
"""How soon a swallowed first signal is delivered again."""

NUDGE = signal.SIGURG
"""Aimed at the main thread to interrupt its wait; its handler does nothing (the
signal is otherwise unused: no out-of-band socket data anywhere in the controller)."""
NUDGE_EVERY_S = 0.05
NUDGE_FOR_S = 2.0
"""How often, and at most how long, the watcher knocks after a signal."""
CHECK_EVERY_S = 0.25
"""How often :func:`result` looks for a first signal that did not unwind."""


class _State:
    signals = 0
    shield = 0
    pending = False
    redeliver = False
    """Set while a first signal's KeyboardInterrupt, swallowed, is delivered again."""
    handled = 0
    """Runs of the handler (the watcher knocks until this moves)."""
    watching = False


_state = _State()
_on_exit: list[Callable[[], None]] = []
"""What a second signal runs before the process exits at once (:func:`on_exit`)."""
_on_first: list[Callable[[], None]] = []
"""What a first signal runs before it unwinds or is held (:func:`on_first`)."""


@contextlib.contextmanager
def _registered(hooks: list[Callable[[], None]], hook: Callable[[], None]) -> Iterator[None]:
    hooks.append(hook)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            hooks.remove(hook)


def on_exit(note: Callable[[], None]) -> contextlib.AbstractContextManager[None]:
    """While the block runs, a second signal calls ``note`` (quick, never blocking: e.g.
    a one-line file saying the run was cut short) before the process exits."""
    return _registered(_on_exit, note)


def on_first(hook: Callable[[], None]) -> contextlib.AbstractContextManager[None]:
    """While the block runs, a first signal calls ``hook`` (quick, never blocking: e.g.
    putting the engine client on short waits) before it unwinds or is held, so that
    what runs on the way out (a container's removal) already has it."""
    return _registered(_on_first, hook)


def _handler(_sig: int, _frame: FrameType | None) -> None:
    _state.handled += 1
    if _state.redeliver:  # the same first signal again (see _unraisable), not a second
        _state.redeliver = False
    else:
        _state.signals += 1
        if _state.signals == 1:
            for hook in list(_on_first):
                with contextlib.suppress(Exception):
                    hook()
        if _state.signals > 1:
            for note in list(_on_exit):  # a line of evidence, then out at once
                with contextlib.suppress(BaseException):
                    note()
            os._exit(EXIT_INTERRUPTED)
    if _state.shield:  # held while evidence is written, redelivered or not
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
        timer = threading.Timer(REDELIVER_S, _redeliver)
        timer.daemon = True
        try:
            timer.start()
        except RuntimeError:  # no new thread (the interpreter is shutting down)
            _state.redeliver = False
        return
    if _state.signals and not isinstance(args.exc_value, KeyboardInterrupt):
        # Unwinding from the operator's signal: a library object the signal cut in half
        # (in its __init__) can fail again in its __del__. Named in one line, not a
        # traceback on the terminal of an operator who asked the run to stop.
        obj = getattr(args.object, "__qualname__", None) or type(args.object).__name__
        with contextlib.suppress(Exception):  # stderr closed, or str() of it fails
            sys.stderr.write(one_line(
                f"cyclebox: while stopping, a finalizer failed (ignored): {obj}: "
                f"{type(args.exc_value).__name__}: {args.exc_value}", 300) + "\n")
        return
    _previous_unraisable(args)


_previous_unraisable = sys.unraisablehook


def _redeliver() -> None:
    seen = _state.handled
    _thread.interrupt_main(signal.SIGINT)  # runs the handler at the main thread's next step
    _knock(seen)  # which, blocked in a wait, it takes only when woken


def _knock(seen: int) -> None:
    """Interrupt the main thread's wait until the handler ran (``handled`` moved past
    ``seen``), for at most :data:`NUDGE_FOR_S`."""
    main = threading.main_thread().ident
    if main is None:
        return
    deadline = time.monotonic() + NUDGE_FOR_S
    while _state.handled <= seen and time.monotonic() < deadline:
        try:
            signal.pthread_kill(main, NUDGE)
        except (OSError, ValueError):
            return  # the main thread is gone: the process is ending
        time.sleep(NUDGE_EVERY_S)


def _watch(rfd: int) -> None:
    """The watcher thread: every SIGINT/SIGTERM byte on the wake-up pipe is a signal
    the handler must run for."""
    wanted = {int(signal.SIGINT), int(signal.SIGTERM)}
    read = 0
    while True:
        try:
            data = os.read(rfd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        # only signals this module handles (a caller may have put another handler back)
        read += sum(1 for b in data if b in wanted and signal.getsignal(b) is _handler)
        if _state.handled < read:  # a signal whose handler has not run yet
            _knock(read - 1)
        read = min(read, _state.handled)  # signals that arrived together ran it once


def _start_watch() -> None:
    if _state.watching:
        return
    if signal.getsignal(NUDGE) not in (signal.SIG_DFL, signal.SIG_IGN, None):
        return  # someone else's handler: do not take the signal over
    rfd, wfd = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(wfd, False)  # the C handler must never block writing it
    try:
        previous = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        os.close(rfd)
        os.close(wfd)
        return
    if previous != -1:  # someone else's wake-up fd (an event loop): leave it theirs
        signal.set_wakeup_fd(previous)
        os.close(rfd)
        os.close(wfd)
        return
    signal.signal(NUDGE, lambda _sig, _frame: None)
    _state.watching = True
    threading.Thread(target=_watch, args=(rfd,), name="cyclebox-signal-watch",
                     daemon=True).start()


def install() -> None:
    """Route SIGTERM and SIGINT to the handler above (main thread only), and make sure a
    first signal unwinds the main thread wherever it is: inside a finalizer
    (:func:`_unraisable`) or asleep in a wait while another thread took the signal
    (:func:`_watch`)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _handler)
        signal.signal(signal.SIGINT, _handler)
        sys.unraisablehook = _unraisable
        _start_watch()


def seen() -> bool:
    """True once a first signal arrived (whether it unwound or was held)."""
    return _state.signals > 0


def check() -> None:
    """Unwind now (``KeyboardInterrupt``) if a first signal came and nothing holds it.

    For points on the main thread's normal path, where it waits or starts new work: a
    signal that reached the handler has unwound by then, unless something swallowed its
    ``KeyboardInterrupt`` (see the module's docstring). While an exception is being
    handled (an ``except`` or ``finally`` on the way out, which is where an unwinding
    signal is) and inside :func:`shielded`/:func:`deferred` it does nothing; elsewhere
    than the main thread too (only the main thread is ever interrupted)."""
    if (_state.signals and not _state.shield and sys.exc_info()[1] is None
            and threading.current_thread() is threading.main_thread()):
        raise KeyboardInterrupt


def result(fut: Future[T]) -> T:
    """``fut.result()`` that unwinds within :data:`CHECK_EVERY_S` of a first signal,
    even one whose ``KeyboardInterrupt`` was swallowed (:func:`check`)."""
    while True:
        try:
            return fut.result(timeout=CHECK_EVERY_S)
        except TimeoutError:
            pass
        check()  # outside the except: there it would see an exception being handled


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
