"""What the engine's inspect JSON says about how a role container ended; pure, tested on
captured ``docker inspect`` output (``tests/fixtures/inspect/``)."""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

from runner.isolation.sandbox import RunFlags


def killed_from_outside(container: Mapping[str, Any], *, ours: bool) -> str | None:
    """A detail naming an outside kill when the container itself (the holder, PID 1)
    stopped with a signal we did not send: e.g. ``docker kill`` (137, SIGKILL). The
    holder exits 0 after a copy-out; only our own last-resort kill (``ours``) or the
    kernel's OOM killer (flagged) would also stop it by a signal."""
    state = container.get("State")
    if ours or not isinstance(state, Mapping) or state.get("Running") \
            or state.get("OOMKilled"):
        return None
    code = state.get("ExitCode")
    if not isinstance(code, int) or code <= 128:
        return None
    try:
        name = signal.Signals(code - 128).name
    except ValueError:
        name = f"signal {code - 128}"
    return (f"the container was killed from outside the controller (exit {code}, {name}; "
            "e.g. docker kill)")


def flags_from_inspect(container: Mapping[str, Any], exit_code: int | None, *,
                       oom_kills: int = 0, timed_out: bool = False,
                       stream_exceeded: bool = False, output_dir_exceeded: bool = False,
                       output_invalid: bool = False, output_detail: str = "",
                       cleanup_confirmed: bool = True) -> RunFlags:
    """What :func:`runner.isolation.sandbox.classify_stop` decides on, from the engine's
    JSON (``container``: container inspect), the role command's exit code (the holder's
    exit-status frame; None when none came) and what the controller saw itself.

    The exit code is the command's (the container's own is the holder's). The engine sets
    ``State.OOMKilled`` only when the kernel killed PID 1, so an OOM-killed role command
    is known by the ``oom_kill`` count the holder read from the cgroup (``oom_kills``).
    Pure; tested on captured ``docker inspect`` output (``tests/fixtures/inspect/``).
    """
    state = container.get("State")
    engine_oom = bool(state.get("OOMKilled")) if isinstance(state, Mapping) else False
    return RunFlags(exit_code=exit_code, oom_killed=engine_oom or oom_kills > 0,
                    timed_out=timed_out, stream_exceeded=stream_exceeded,
                    output_dir_exceeded=output_dir_exceeded, output_detail=output_detail,
                    output_invalid=output_invalid, cleanup_confirmed=cleanup_confirmed)
