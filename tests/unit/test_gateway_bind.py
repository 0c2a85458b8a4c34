"""A gateway binding never outlives a failed or interrupted bind (no stray socket dir)."""

from __future__ import annotations

import os
import signal
import tempfile
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
