"""A prepared container's ``ended`` callback (issue 23): called once the command ended
and its output is copied out, while the container still exists (its removal overlaps
the next case), never for a case that did not run; the record still waits for the
removal and says so truthfully."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runner.errors import SandboxError
from runner.isolation.docker.images import resolve_image
from runner.isolation.policy import RolePolicies
from runner.isolation.roles import role_spec
from runner.isolation.sandbox import RunSpec, StopReason


def _spec(policies: RolePolicies, command: list[str], out: Path) -> RunSpec:
    out.mkdir()
    return role_spec(policies.roles["analyst"], role="analyst", run_id="test-ended",
                     image=resolve_image("analyst"), command=command, output_dir=out)


def _known(backend: Any, name: str) -> bool:
    return name in [n for _, n, _ in backend.managed_containers()]


def test_ended_comes_after_the_copy_out_and_before_the_removal(
        backend: Any, policies: RolePolicies, tmp_path: Path) -> None:
    out = tmp_path / "o"
    prepared = backend.prepare(_spec(policies, ["sh", "-c", "echo done > /out/answer"], out))
    name = str(prepared.kwargs["name"])
    seen: list[tuple[bool, str]] = []

    def ended() -> None:
        seen.append((_known(backend, name), (out / "answer").read_text()))

    rec = prepared.run(ended=ended)
    assert seen == [(True, "done\n")]  # the output is in; the container not yet removed
    assert rec.stop_reason is StopReason.OK and rec.cleanup_confirmed, rec
    assert not _known(backend, name)  # run returned only after the confirmed removal


def test_ended_is_called_for_a_failed_command_too(
        backend: Any, policies: RolePolicies, tmp_path: Path) -> None:
    prepared = backend.prepare(_spec(policies, ["sh", "-c", "exit 3"], tmp_path / "o"))
    calls: list[int] = []
    rec = prepared.run(ended=lambda: calls.append(1))
    assert calls == [1]
    assert rec.exit_code == 3 and rec.stop_reason is StopReason.PROCESS_FAILED
    assert rec.cleanup_confirmed


def test_ended_is_never_called_for_a_case_that_did_not_run(
        backend: Any, policies: RolePolicies, tmp_path: Path) -> None:
    import threading

    prepared = backend.prepare(_spec(policies, ["true"], tmp_path / "o"))
    name = str(prepared.kwargs["name"])
    stop = threading.Event()
    stop.set()
    calls: list[int] = []
    with pytest.raises(SandboxError, match="stopping"):
        prepared.run(cancel=stop, ended=lambda: calls.append(1))
    assert calls == []
    assert not _known(backend, name)
