"""The controller's first signal always unwinds it, wherever the main thread was."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator

import pytest

from runner import interrupts


@pytest.fixture
def installed() -> Iterator[None]:
    state = interrupts._state
    saved = (state.signals, state.shield, state.pending, state.redeliver, state.handled)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    hook = sys.unraisablehook
    state.signals, state.shield, state.pending, state.redeliver = 0, 0, False, False
    watch = interrupts._start_watch
    interrupts._start_watch = lambda: None  # process-wide: tried in a subprocess below
    try:
        interrupts.install()
    finally:
        interrupts._start_watch = watch
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        sys.unraisablehook = hook
        state.signals, state.shield, state.pending, state.redeliver, state.handled = saved


class _Finalized:
    def __del__(self) -> None:
        # the first signal's handler runs while the main thread is in a finalizer: its
        # KeyboardInterrupt is swallowed by Python ("Exception ignored in ...")
        interrupts._handler(signal.SIGTERM, None)


def test_a_first_signal_landing_in_a_finalizer_still_unwinds(installed: None) -> None:
    with pytest.raises(KeyboardInterrupt):
        f = _Finalized()
        del f
        for _ in range(2000):  # the main thread goes on; the signal must reach it
            time.sleep(0.001)
    assert interrupts._state.signals == 1  # the same first signal, not a second one


def test_a_redelivered_first_signal_is_held_while_evidence_is_written(
        installed: None) -> None:
    """Redelivered after the main thread entered ``shielded()`` (writing the verdict and
    receipt): held like any first signal, never raised halfway through the receipt."""
    f = _Finalized()
    del f  # swallowed; redelivered REDELIVER_S later
    written = 0
    try:
        with interrupts.shielded():
            for _ in range(200):  # the redelivery lands in here
                time.sleep(0.001)
                written += 1
    except KeyboardInterrupt:
        pytest.fail(f"raised inside shielded() after {written} of 200 steps")
    assert written == 200
    assert interrupts.seen() and interrupts._state.signals == 1


def test_other_unraisable_exceptions_still_reach_the_previous_hook(
        installed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[type[BaseException]] = []
    monkeypatch.setattr(interrupts, "_previous_unraisable",
                        lambda args: seen.append(type(args.exc_value)))

    class Broken:
        def __del__(self) -> None:
            raise ValueError("bug in a finalizer")

    b = Broken()
    del b
    assert seen == [ValueError]


BLOCKED = r"""
import os, signal, sys, threading, time
sys.path.insert(0, {root!r})
from runner import interrupts
interrupts.install()
held = threading.Lock()
held.acquire()

def elsewhere():
    time.sleep(0.3)
    {trigger}
    time.sleep(30)
    print("asleep", flush=True)  # the main thread never unwound: the lock is never freed
    os._exit(3)

threading.Thread(target=elsewhere, daemon=True).start()
t0 = time.monotonic()
try:
    held.acquire()  # the main thread asleep in a wait, as in a future's result()
    print("woke")
except KeyboardInterrupt:
    print("unwound", interrupts._state.signals)
"""


@pytest.mark.parametrize("trigger", [
    # the kernel may hand a process's signal to any thread that does not block it
    "signal.pthread_kill(threading.get_ident(), signal.SIGTERM)",
    # a first signal swallowed in a finalizer, redelivered while the main thread waits
    "interrupts._state.signals = 1; interrupts._state.redeliver = True; "
    "interrupts._redeliver()",
], ids=["signal-to-another-thread", "redelivered"])
def test_a_first_signal_wakes_a_main_thread_asleep_in_a_wait(trigger: str) -> None:
    """Python runs handlers in the main thread only, when it steps; without the wake-up
    watcher this main thread sleeps on in its wait (fails: 'asleep')."""
    import subprocess
    from pathlib import Path

    root = str(Path(interrupts.__file__).resolve().parents[1])
    code = BLOCKED.format(root=root, trigger=trigger)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=60).stdout.split()
    assert out == ["unwound", "1"]  # one signal: the next one would still exit at once
