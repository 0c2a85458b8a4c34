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
    saved = (state.signals, state.shield, state.pending, state.redeliver)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    hook = sys.unraisablehook
    state.signals, state.shield, state.pending, state.redeliver = 0, 0, False, False
    interrupts.install()
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        sys.unraisablehook = hook
        state.signals, state.shield, state.pending, state.redeliver = saved


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
