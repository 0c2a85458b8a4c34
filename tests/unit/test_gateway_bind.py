"""A gateway binding never outlives a failed or interrupted bind (no stray socket dir)."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from runner import interrupts
from runner.gateway.server import SOCKET_DIR_PREFIX, Gateway, GatewayClosed


@pytest.fixture
def tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "t"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _left(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith(SOCKET_DIR_PREFIX))


def test_a_signal_mid_bind_is_held_until_the_binding_is_registered(
        tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = interrupts._state
    saved = (state.signals, state.shield, state.pending)
    make = Gateway._make_binding

    def signalled(self: Gateway, *a: Any, **k: Any) -> Any:
        got = make(self, *a, **k)
        interrupts._handler(signal.SIGTERM, None)  # the signal lands mid-bind
        return got

    monkeypatch.setattr(Gateway, "_make_binding", signalled)
    try:
        state.signals, state.shield, state.pending = 0, 0, False
        gw = Gateway(tmp_path / "run", "bindtest", {}, {}).start()
        try:
            with pytest.raises(KeyboardInterrupt):
                gw.bind("analyst", stage="baseline", uid=os.getuid())
            assert len(_left(tmp)) == 1  # registered: the gateway's close removes it
        finally:
            gw.close()
        assert _left(tmp) == []
    finally:
        state.signals, state.shield, state.pending = saved


def test_a_failed_bind_removes_what_it_made(tmp: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Gateway, outer: Path, *a: Any, **k: Any) -> Any:
        (outer / "owner.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(Gateway, "_make_binding", broken)
    with Gateway(tmp_path / "run", "bindtest", {}, {}) as gw, pytest.raises(OSError):
        gw.bind("analyst", stage="baseline", uid=os.getuid())
    assert _left(tmp) == []


def test_no_binding_after_close(tmp: Path, tmp_path: Path) -> None:
    gw = Gateway(tmp_path / "run", "bindtest", {}, {}).start()
    gw.close()
    with pytest.raises(GatewayClosed, match="analyst container: the gateway is closed"):
        gw.bind("analyst", stage="baseline", uid=os.getuid())
    assert _left(tmp) == []


def test_a_bind_that_loses_the_race_with_close_is_undone(
        tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() lists the bindings while a bind is starting its socket: that binding is
    never registered (it would outlive close), and its own thread removes it."""
    gw = Gateway(tmp_path / "run", "bindtest", {}, {}).start()
    start = Gateway._start

    async def closing_meanwhile(self: Gateway, b: Any) -> None:
        await start(self, b)
        with self._bind_lock:
            self._closed = True  # as close() does first, from another thread

    monkeypatch.setattr(Gateway, "_start", closing_meanwhile)
    try:
        with pytest.raises(GatewayClosed, match="the gateway closed"):
            gw.bind("analyst", stage="baseline", uid=os.getuid())
        assert gw._bindings == []
        assert _left(tmp) == []
    finally:
        gw.close()


def test_a_bind_under_way_when_close_starts_ends_before_the_loop_stops(
        tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() on one thread while another binds: the bind finishes on the running loop
    and is refused by name (never an error from a stopped or closed loop, never a
    30 s wait), and nothing of it is left."""
    gw = Gateway(tmp_path / "run", "bindtest", {}, {}).start()
    start = Gateway._start
    entered = threading.Event()

    async def slow(self: Gateway, b: Any) -> None:
        entered.set()
        await asyncio.sleep(0.3)
        await start(self, b)

    monkeypatch.setattr(Gateway, "_start", slow)
    got: list[BaseException] = []

    def bind() -> None:
        try:
            gw.bind("analyst", stage="baseline", uid=os.getuid())
        except BaseException as exc:
            got.append(exc)

    t = threading.Thread(target=bind)
    t.start()
    assert entered.wait(5)
    t0 = time.monotonic()
    gw.close()
    t.join(5)
    assert not t.is_alive()
    assert [type(e) for e in got] == [GatewayClosed], got
    assert time.monotonic() - t0 < 2.0
    assert _left(tmp) == []


def test_a_binding_is_unbound_once(tmp: Path, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """close() and the container's own unbind may both reach a binding: the second
    finds it gone and does nothing (no second close, no second record)."""
    with Gateway(tmp_path / "run", "bindtest", {}, {}) as gw:
        b = gw.bind("analyst", stage="baseline", uid=os.getuid())
        b.not_itemized = 3
        recorded: list[Any] = []
        monkeypatch.setattr(gw, "_record", lambda *a, **k: recorded.append(k))
        gw.unbind(b, grace_s=0)

        async def closed_twice(_grace_s: float) -> None:
            raise AssertionError("the listener was closed a second time")

        assert b.listener is not None
        monkeypatch.setattr(b.listener, "close", closed_twice)
        gw.unbind(b, grace_s=0)
        assert [k["not_itemized"] for k in recorded] == [3]
    assert _left(tmp) == []


def test_an_unbind_cut_short_by_a_signal_leaves_the_binding_to_close(
        tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gw = Gateway(tmp_path / "run", "bindtest", {}, {}).start()
    try:
        b = gw.bind("analyst", stage="baseline", uid=os.getuid())
        b.not_itemized = 1
        calls: list[int] = []

        def record(*_a: Any, **_k: Any) -> None:
            calls.append(1)
            if len(calls) == 1:
                raise KeyboardInterrupt  # the signal lands mid-unbind

        monkeypatch.setattr(gw, "_record", record)
        with pytest.raises(KeyboardInterrupt):
            gw.unbind(b, grace_s=0)
        assert gw._bindings == [b]
        assert len(_left(tmp)) == 1
    finally:
        gw.close()
    assert _left(tmp) == []
    assert gw._bindings == [] and gw._busy == 0
