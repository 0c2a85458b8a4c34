"""A full disk while the receipt is written: the run's verdict said accept_for_review with
no receipt beside it, and the error came back as an unexpected one. Now the verdict is
set aside (``verdict.no-receipt.json``) and the command ends exit 9, naming both."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.cli import cycle as cli_cycle
from runner.errors import EnvironmentFailure


def _run(tmp_path: Path) -> Path:
    d = tmp_path / "run" / "stages" / "compare"
    d.mkdir(parents=True)
    (d / "verdict.json").write_text('{"verdict": "accept_for_review"}')
    return tmp_path / "run"


def test_a_full_disk_at_the_receipt_sets_the_verdict_aside(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run(tmp_path)

    def full(_outcome: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("runner.cycle.receipt.build", full)
    with pytest.raises(EnvironmentFailure, match=r"receipt could not be written \(No space "
                                                 r"left on device\).*verdict.no-receipt.json"):
        cli_cycle.build_receipt(SimpleNamespace(run_dir=run))  # type: ignore[arg-type]
    assert not (run / "stages" / "compare" / "verdict.json").exists()
    assert (run / "stages" / "compare" / "verdict.no-receipt.json").read_text() == \
        '{"verdict": "accept_for_review"}'


def test_another_os_error_is_not_called_a_full_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run(tmp_path)

    def denied(_outcome: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("runner.cycle.receipt.build", denied)
    with pytest.raises(PermissionError):
        cli_cycle.build_receipt(SimpleNamespace(run_dir=run))  # type: ignore[arg-type]
    assert (run / "stages" / "compare" / "verdict.json").is_file()
