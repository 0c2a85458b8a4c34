"""Engine JSON -> stop reason, on ``docker inspect`` output captured from the local engine
(tests/fixtures/inspect/capture.py regenerates it): exit 0, exit 3, a role command
OOM-killed under the holder, the same allocation as PID 1, and ``docker kill``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runner.isolation.docker.backend import flags_from_inspect
from runner.isolation.sandbox import StopReason, classify_stop

CAPTURED = Path(__file__).parents[1] / "fixtures" / "inspect"


def captured(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((CAPTURED / f"{name}.json").read_text())
    assert doc["case"] == name
    return doc


def exit_code(doc: dict[str, Any]) -> int | None:
    """The role command's exit code as the holder's exit frame reports it. The captures
    were taken when the command ran through exec; its record holds the same wait status."""
    return None if doc["exec"] is None else int(doc["exec"]["ExitCode"])


def stop(name: str, **seen: Any) -> tuple[StopReason, str]:
    doc = captured(name)
    return classify_stop(flags_from_inspect(doc["container"], exit_code(doc), **seen))


@pytest.mark.parametrize(("name", "reason", "detail"), [
    ("exit0", StopReason.OK, ""),
    ("exit3", StopReason.PROCESS_FAILED, "exit code 3"),
    # The engine flags OOM only for PID 1: a role command killed under the holder shows
    # as a bare 137 until the holder's cgroup count says otherwise (next test).
    ("oom", StopReason.PROCESS_FAILED, "exit 137 (SIGKILL) without an OOM flag"),
    ("oom_pid1", StopReason.OOM, "killed by the kernel OOM killer at the memory limit"),
    ("killed", StopReason.PROCESS_FAILED, "exit 137 (SIGKILL) without an OOM flag"),
])
def test_captured_engine_json(name: str, reason: StopReason, detail: str) -> None:
    assert stop(name) == (reason, detail)


def test_the_captures_are_what_they_claim() -> None:
    """Guards the fixtures themselves (a recapture must still show these facts)."""
    assert captured("oom")["container"]["State"]["OOMKilled"] is False
    assert captured("oom")["exec"]["ExitCode"] == 137
    assert captured("oom_pid1")["container"]["State"]["OOMKilled"] is True
    assert captured("oom_pid1")["exec"] is None
    killed = captured("killed")["container"]["State"]
    assert (killed["Status"], killed["ExitCode"], killed["OOMKilled"]) == ("exited", 137, False)


def test_holder_oom_count_names_an_oom_killed_role_command() -> None:
    assert stop("oom", oom_kills=1)[0] is StopReason.OOM
    assert stop("exit0", oom_kills=1)[0] is StopReason.OOM  # a killed child, exit 0 anyway


def test_our_own_kill_is_not_read_as_oom_or_failure() -> None:
    assert stop("killed", timed_out=True)[0] is StopReason.TIMEOUT
    assert stop("killed", stream_exceeded=True)[0] is StopReason.OUTPUT_LIMIT
    assert stop("oom_pid1", timed_out=True)[0] is StopReason.TIMEOUT


def test_what_the_controller_saw_is_carried_through() -> None:
    assert stop("exit0", cleanup_confirmed=False)[0] is StopReason.CLEANUP_UNCONFIRMED
    assert stop("exit0", output_invalid=True, output_detail="link x") == (
        StopReason.INVALID_OUTPUT, "output refused: link x")
    assert stop("exit3", output_dir_exceeded=True, output_detail="full")[0] is (
        StopReason.OUTPUT_LIMIT)


def test_no_exit_frame_means_no_exit_code() -> None:
    exit0 = captured("exit0")
    assert classify_stop(flags_from_inspect(exit0["container"], None)) == (
        StopReason.PROCESS_FAILED, "engine reported no exit code")
    assert flags_from_inspect({}, None).oom_killed is False  # no State at all
