"""`cyclebox export` when the run or the disk lets it down.

- records files cut mid-line, gone, or added after the run: refused naming the file
  (8 when the run no longer matches its receipt, 3 for a line that is not a record);
- a full disk under --out: exit 9 and no partial corpus left (written under a hidden
  name, renamed into place only whole);
- a signal mid-write: nothing left at --out, so the same command runs again.

The run is the hand-built one of ``tests/unit/test_export.py`` (a sealed receipt and a
calibration bound to it). The CLI cases go through ``runner.cli.main``.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.errors import EXIT_ENVIRONMENT, EXIT_INTEGRITY, IntegrityError
from runner.gateway.calllog import CallLog, CallRecord
from runner.hashing import sha256_bytes
from runner.train.export import export
from tests.faults.test_bad_inputs import run_cli
from tests.unit.test_export import (
    BASELINE,
    CALLS,
    CANDIDATE,
    POLICY,
    _calibration,
    manifest_bytes,
    record,
    request_bytes,
    response_bytes,
    seal,
)


def make_run(d: Path) -> Path:
    """The unit tests' run directory (call log, blobs, records, receipt) at ``d``."""
    (d / "inputs").mkdir(parents=True)
    (d / "inputs" / "manifest.json").write_bytes(manifest_bytes())
    (d / "plan.json").write_text(json.dumps({"plan": {
        "dataset": "fx", "manifest_sha256": sha256_bytes(manifest_bytes())}}))
    log = CallLog(d / "gateway")
    for c in CALLS:
        seq = log.next_seq()
        resp = response_bytes(seq, c)
        log.append(CallRecord(
            seq=seq, ts=CallLog.now(), run_id="run-fx", role=c.role,
            upstream=None if c.status == "refused" else "target", stage=c.stage, case=c.case,
            trial=c.trial, turn=c.turn, provider=None if c.status == "refused" else "scripted",
            model="analyst-m", fixture=c.fixture, status=c.status,
            error="budget" if c.status == "refused" else None, latency_s=0.01,
            request_sha256=log.put_blob(request_bytes(seq, c)),
            response_sha256=None if resp is None else log.put_blob(resp)))
    log.sync()
    for side, rows in (("baseline", BASELINE), ("candidate", CANDIDATE)):
        f = d / "stages" / side / "records.jsonl"
        f.parent.mkdir(parents=True)
        f.write_text("".join(record(*r).model_dump_json() + "\n" for r in rows))
    return seal(d)


def _export_cli(run: Path, out: Path, cal: Path) -> tuple[int | str, str]:
    code, _, err = run_cli(["export", "--run", str(run), "--out", str(out),
                            "--calibration", str(cal)], {})
    return code, err


def _cut(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: data.index(b"\n") + 40])  # the second line, cut mid-way


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return make_run(tmp_path / "run")


@pytest.fixture
def calibration(tmp_path: Path, run: Path) -> Path:
    return _calibration(tmp_path, "agree", lambda v: v, run)


def test_records_cut_after_the_run_fail_the_receipt_naming_the_file(
        run: Path, calibration: Path, tmp_path: Path) -> None:
    _cut(run / "stages" / "candidate" / "records.jsonl")
    code, err = _export_cli(run, tmp_path / "out", calibration)
    assert code == EXIT_INTEGRITY, err
    first = err.splitlines()[0]
    assert "stages/candidate/records.jsonl" in first and "receipt" in first, first
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_records_sealed_with_a_cut_line_are_bad_input_naming_the_line(
        run: Path, tmp_path: Path) -> None:
    _cut(run / "stages" / "candidate" / "records.jsonl")
    seal(run)  # the receipt itself names the cut file: its line is what is wrong
    cal = _calibration(tmp_path, "sealed", lambda v: v, run)
    code, err = _export_cli(run, tmp_path / "out", cal)
    assert code == 3, err
    first = err.splitlines()[0]
    assert "stages/candidate/records.jsonl:2" in first, first
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("side", ["baseline", "candidate"])
def test_records_gone_are_refused_naming_the_file(side: str, run: Path, calibration: Path,
                                                  tmp_path: Path) -> None:
    (run / "stages" / side / "records.jsonl").unlink()
    code, err = _export_cli(run, tmp_path / "out", calibration)
    assert code == EXIT_INTEGRITY, err
    first = err.splitlines()[0]
    assert f"stages/{side}/records.jsonl: missing" in first and "receipt" in first, first
    assert not (tmp_path / "out").exists()


def test_records_added_after_the_run_are_refused(run: Path, tmp_path: Path) -> None:
    f = run / "stages" / "candidate" / "records.jsonl"
    data = f.read_bytes()
    f.unlink()
    seal(run)  # a run whose receipt names no candidate records
    f.write_bytes(data)
    cal = _calibration(tmp_path, "nocand", lambda v: v, run)
    with pytest.raises(IntegrityError, match=r"run_altered: .*stages/candidate/records\.jsonl: "
                       r"present in the run directory but not named by the receipt"):
        export(run, tmp_path / "out", calibration=cal, policy=POLICY)


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_signal_mid_write_leaves_nothing_and_the_rerun_works(
        run: Path, calibration: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import runner.train.verl_parquet as vp

    real = vp.write_sft

    def interrupted(*_a: object, **_k: object) -> None:
        raise KeyboardInterrupt  # what the first SIGINT/SIGTERM raises in the main thread

    parent = tmp_path / "exports"
    out = parent / "corpus"
    monkeypatch.setattr(vp, "write_sft", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export(run, out, calibration=calibration, policy=POLICY)
    assert not out.exists()
    assert not parent.exists(), _leftovers(parent)  # the parent it made is gone too
    monkeypatch.setattr(vp, "write_sft", real)
    code, err = _export_cli(run, out, calibration)
    assert code == 0, err
    assert (out / "export-receipt.json").is_file()
    assert _leftovers(parent) == ["corpus"]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(mnt)],
                   check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_exits_9_and_leaves_no_partial_corpus(run: Path, calibration: Path,
                                                        small_disk: Path) -> None:
    # leave a few KB: the trajectories fit, the parquet files do not
    (small_disk / "filler").write_bytes(b"\0" * (56 << 10))
    code, err = _export_cli(run, small_disk / "out", calibration)
    assert code == EXIT_ENVIRONMENT, err
    assert "No space left on device" in err or "environment_failure" in err, err
    assert "Traceback" not in err
    assert _leftovers(small_disk) == ["filler"]

