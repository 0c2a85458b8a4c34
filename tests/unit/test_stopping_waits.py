"""How a stopping run treats the engine, and which cause a stop is named by (no Docker:
a scripted engine client).

- one slow removal in the stopping sweep ended the whole sweep (the other containers were
  left) and put every later engine call on 0.05 s waits; now it is named and the sweep
  goes on, and only a second one counts the engine as hung;
- an exception raised while a signal unwound (a removal that timed out on a hung engine
  on the way out) was named ``engine_error`` (exit 6), not the signal (exit 130);
- a first signal puts the engine on short waits before anything on the way out asks it.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import docker.errors
import pytest
import requests.exceptions

from runner import interrupts
from runner.failures import classify
from runner.isolation.docker.backend import SILENT_TIMEOUT_S, DockerSandbox
from runner.isolation.sandbox import LABEL_PREFIX


class _Api:
    def __init__(self, slow: set[str]) -> None:
        self.slow = slow
        self.timeout: float = 60
        self.removed: list[str] = []
        self.rows = [{"Id": cid, "Names": [f"/c-{cid}"],
                      "Labels": {f"{LABEL_PREFIX}.run_id": "r1", "cyclebox": "1"}}
                     for cid in ("a", "b", "c", "d")]

    def containers(self, **_kw: Any) -> list[dict[str, Any]]:
        return self.rows

    def remove_container(self, cid: str, **_kw: Any) -> None:
        if cid in self.slow:
            raise requests.exceptions.ReadTimeout(f"read timed out ({self.timeout})")
        self.removed.append(cid)

    def inspect_container(self, cid: str) -> dict[str, Any]:
        raise docker.errors.NotFound(f"no such container {cid}")


class _Client:
    def __init__(self, slow: set[str]) -> None:
        self.api = _Api(slow)


def _sandbox(slow: set[str]) -> tuple[DockerSandbox, _Api]:
    client = _Client(slow)
    box = DockerSandbox(client=client)
    return box, client.api


def test_one_slow_removal_is_named_and_the_sweep_goes_on() -> None:
    box, api = _sandbox({"b"})
    box.stopping()
    got = box.leftovers("r1")
    assert api.removed == ["a", "c", "d"]
    assert got[0] == "c-a" and got[2:] == ["c-c", "c-d"]
    assert got[1].startswith("c-b (removal not confirmed: the engine did not answer within 5 s")
    assert api.timeout == 5.0  # not silenced by one slow removal


def test_a_second_slow_removal_counts_the_engine_as_hung() -> None:
    box, api = _sandbox({"a", "b"})
    box.stopping()
    got = box.leftovers("r1")
    assert api.removed == []  # asked no more after the second
    assert [g.split(" ")[0] for g in got] == ["c-a", "c-b", "c-c", "c-d"]
    assert got[2].endswith("(not removed: the engine stopped answering; `cyclebox gc` "
                           "removes it)")
    assert api.timeout == SILENT_TIMEOUT_S


def test_a_slow_removal_outside_a_stop_still_raises() -> None:
    box, _ = _sandbox({"a"})
    with pytest.raises(requests.exceptions.ReadTimeout):
        box.leftovers("r1")


def test_an_error_raised_while_a_signal_unwound_is_named_the_signal() -> None:
    try:
        try:
            raise KeyboardInterrupt
        finally:
            raise requests.exceptions.ReadTimeout("engine did not answer")
    except BaseException as exc:
        got = classify(exc)
    assert (got.reason, got.exit_code) == ("interrupted", 130)
    try:
        raise requests.exceptions.ReadTimeout("engine did not answer")
    except BaseException as exc:
        assert classify(exc).reason == "engine_error"


@pytest.fixture
def fresh_state() -> Iterator[None]:
    state = interrupts._state
    saved = (state.signals, state.shield, state.pending, state.redeliver, state.handled)
    state.signals, state.shield, state.pending, state.redeliver = 0, 0, False, False
    try:
        yield
    finally:
        state.signals, state.shield, state.pending, state.redeliver, state.handled = saved


def test_a_first_signal_runs_its_hooks_before_it_unwinds(fresh_state: None) -> None:
    box, api = _sandbox(set())
    with interrupts.on_first(box.stopping), pytest.raises(KeyboardInterrupt):
        interrupts._handler(signal.SIGINT, None)
    assert api.timeout == 5.0
    box2, api2 = _sandbox(set())
    with interrupts.on_first(box2.stopping):
        pass
    interrupts._state.signals = 0
    with pytest.raises(KeyboardInterrupt):
        interrupts._handler(signal.SIGINT, None)  # the hook is gone with its block
    assert api2.timeout == 60
