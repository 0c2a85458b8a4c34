"""The controller's first signal always unwinds it, wherever the main thread was."""

from __future__ import annotations

import gc
import io
import os
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

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


class _ClosedAsked(io.RawIOBase):
    """An io object whose finalizer (``IOBase``'s, in C) asks ``closed``, as a urllib3
    response's does: the first signal's handler runs right there."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    @property
    def closed(self) -> bool:
        self.asked += 1
        if self.asked == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next step
            for _ in range(1000):
                pass
        return False


def _swallow_a_first_signal() -> None:
    got: list[BaseException] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda args: got.append(args.exc_value)  # type: ignore[assignment]
    try:
        f = _ClosedAsked()
        del f
    finally:
        sys.unraisablehook = hook
    # CPython's IOBase finalizer clears what ``closed`` raised, reported to no hook: the
    # first signal came (and its handler ran) but nothing unwinds
    assert interrupts.seen() and got == []


def test_a_first_signal_swallowed_by_an_io_finalizer_unwinds_the_next_wait(
        installed: None) -> None:
    """The controller waited on for cases that sleep (fresh-clone CI, 1 run in 16): its
    main thread's ``result()`` must see the signal whose KeyboardInterrupt was lost."""
    _swallow_a_first_signal()
    never: Future[int] = Future()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        interrupts.result(never)
    assert time.monotonic() - t0 < 5 * interrupts.CHECK_EVERY_S
    assert interrupts._state.signals == 1  # still the first signal


def test_check_unwinds_a_swallowed_signal_but_not_while_held_or_unwinding(
        installed: None) -> None:
    _swallow_a_first_signal()
    with interrupts.shielded():
        interrupts.check()  # held while evidence is written
    try:
        raise ValueError("on the way out")
    except ValueError:
        interrupts.check()  # an exception is being handled: where an unwinding signal is
    with pytest.raises(KeyboardInterrupt):
        interrupts.check()


def test_result_returns_a_done_future_and_check_is_quiet_without_a_signal(
        installed: None) -> None:
    done: Future[int] = Future()
    done.set_result(7)
    assert interrupts.result(done) == 7
    interrupts.check()


def test_a_first_signal_while_git_opens_a_reader_unwinds_after_it_without_a_traceback(
        installed: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal landing inside GitPython's GitConfigParser.__init__ (the controller's
    apply stage, reading the base tree) left a half-built parser whose ``__del__``
    printed an AttributeError traceback on the operator's terminal. Opening a reader is
    held whole; the signal unwinds right after it."""
    import git

    from runner import gitops

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "a.txt").write_text("a\n")
    gitops.init_fixed(repo, "base")
    gitops.close_readers()
    unraisable: list[BaseException | None] = []
    monkeypatch.setattr(interrupts, "_previous_unraisable",
                        lambda args: unraisable.append(args.exc_value))
    real_init = git.config.GitConfigParser.__init__
    fired: list[bool] = []

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if not fired:  # before any attribute is set, as the signal came in CI
            fired.append(True)
            interrupts._handler(signal.SIGINT, None)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(git.config.GitConfigParser, "__init__", init)
    try:
        with pytest.raises(KeyboardInterrupt):
            gitops.head_tree(repo)
        gc.collect()
        assert fired and unraisable == []
        assert interrupts._state.signals == 1 and not interrupts._state.pending
    finally:
        gitops.close_readers()


def test_after_a_first_signal_a_failing_finalizer_is_one_line_not_a_traceback(
        installed: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Whatever library object a signal cuts in half: its failing ``__del__`` is named in
    one escaped line while the controller stops, never a traceback."""
    seen: list[type[BaseException]] = []
    monkeypatch.setattr(interrupts, "_previous_unraisable",
                        lambda args: seen.append(type(args.exc_value)))

    class HalfBuilt:
        def __del__(self) -> None:
            raise AttributeError("no attribute '_read_only'\x1b[2J")

    interrupts._state.signals = 1
    b = HalfBuilt()
    del b
    err = capsys.readouterr().err
    assert seen == []
    assert err.count("\n") == 1 and "Traceback" not in err and "\x1b" not in err
    assert "HalfBuilt.__del__" in err and "AttributeError" in err and "\\x1b[2J" in err
