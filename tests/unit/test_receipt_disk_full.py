"""A full disk while the receipt is written: the run's verdict said accept_for_review with
no receipt beside it, and the error came back as an unexpected one. Now the verdict is
set aside (``verdict.no-receipt.json``) and the command ends exit 9, naming both."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.cycle import receipt
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
        receipt.build_receipt(SimpleNamespace(run_dir=run))  # type: ignore[arg-type]
    assert not (run / "stages" / "compare" / "verdict.json").exists()
    assert (run / "stages" / "compare" / "verdict.no-receipt.json").read_text() == \
        '{"verdict": "accept_for_review"}'


def test_another_os_error_is_not_called_a_full_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run(tmp_path)

    def denied(_outcome: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("runner.cycle.receipt.build", denied)
    with pytest.raises(PermissionError):  # as itself: not an environment failure
        receipt.build_receipt(SimpleNamespace(run_dir=run))  # type: ignore[arg-type]
    # no receipt, so no verdict that claims anything (helper-42 #1: any failure)
    assert not (run / "stages" / "compare" / "verdict.json").exists()
    assert (run / "stages" / "compare" / "verdict.no-receipt.json").is_file()


def test_a_second_signal_while_the_receipt_is_written_sets_the_verdict_aside(
        tmp_path: Path) -> None:
    """The process exits at once on a second signal: while the receipt was built that left
    a verdict (accept_for_review) with no receipt beside it and nothing saying why."""
    import subprocess
    import sys

    run = _run(tmp_path)
    script = f"""
import os, signal, time
from pathlib import Path
from types import SimpleNamespace
from runner import interrupts
from runner.cycle import receipt
interrupts.install()
def slow(_outcome):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(10)
receipt.build = slow
with interrupts.shielded():  # as `cycle run` builds it
    receipt.build_receipt(SimpleNamespace(run_dir=Path({str(run)!r})))
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 130, res.stderr
    assert not (run / "stages" / "compare" / "verdict.json").exists()
    assert (run / "stages" / "compare" / "verdict.no-receipt.json").is_file()
    assert "while the receipt was written" in (run / "cut-short.txt").read_text()


def test_a_second_signal_after_the_receipt_was_written_leaves_the_run_as_is(
        tmp_path: Path) -> None:
    """The note stays registered until the build returns: a second signal just after the
    receipt was renamed into place set a complete run's verdict aside (verify failed)."""
    import subprocess
    import sys

    run = _run(tmp_path)
    script = f"""
import os, signal, time
from pathlib import Path
from types import SimpleNamespace
from runner import interrupts
from runner.cycle import receipt
interrupts.install()
def done(_outcome):
    (Path({str(run)!r}) / "receipt.json").write_text("{{}}")
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(10)
receipt.build = done
with interrupts.shielded():
    receipt.build_receipt(SimpleNamespace(run_dir=Path({str(run)!r})))
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 130, res.stderr
    assert (run / "stages" / "compare" / "verdict.json").is_file()
    assert not (run / "cut-short.txt").exists()
