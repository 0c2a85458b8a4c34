"""Bad input to `cyclebox model tiny` and `cyclebox train proof|sft` is refused on the host,
before any container starts and before --out exists; a ledger that refuses the proof's
row after the training is a named error, never exit 10, and keeps what was trained.

- Numeric flags (``runner.train.flags``): a seed torch/numpy refuse, a NaN/inf/negative
  learning rate, a negative epoch count used to reach the trainer container (exit 6 after
  minutes, --out left behind). Now exit 3 naming the flag; --out absent; the trainer is
  never even looked up.
- ``--ledger`` (``runner.train.host.check_ledger``): a read-only directory, a directory,
  a FIFO, a symlink to a device... used to end a finished 85 s training with exit 10
  (``OSError: Read-only file system``) and the row lost. Now exit 3 before any training.
- The ledger becoming unappendable *during* the training (``append_ledger_row``): exit 3
  (9 for a full disk) naming the ledger and where the adapter, receipt and row are kept;
  the ledger's earlier rows are unchanged (a partly written line is taken back).

The trainer is the scripted sandbox (``tests/fixtures/fake_sandbox.py``); no engine runs.
The read-only and disk-full cases mount a bind mount / a small tmpfs and need root.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runner.errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, ConfigError
from runner.paths import PROJECT_ROOT
from runner.train.flags import EPOCHS_MAX, LR_MAX, SEED_MAX, check_train_flags
from runner.train.host import Trainer
from sandbox.train.receipt import canonical
from tests.faults.test_bad_inputs import run_cli
from tests.fixtures.fake_sandbox import Call, Result, fake_trainer

PERSONA = PROJECT_ROOT / "examples" / "persona" / "captain.yaml"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")


def _no_trainer() -> Trainer:
    raise AssertionError("the trainer was looked up before the flags were checked")


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path with a model dir and a corpus; the CLI's trainer lookup fails the test."""
    import runner.cli.train

    monkeypatch.setattr(runner.cli.train, "trainer", _no_trainer)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "trajectories.jsonl").write_text("")
    (tmp_path / "state").mkdir()
    return tmp_path


def _env(w: Path) -> dict[str, str]:
    return {"CYCLEBOX_STATE_DIR": str(w / "state")}


def _first_line(err: str) -> str:
    """The error's line (the first line of stderr once the progress bar is left out)."""
    return next((line for line in err.splitlines() if line.startswith("error: ")), "")


# -- numeric flags ----------------------------------------------------------------------------
def _model(w: Path, *flags: str) -> list[str]:
    return ["model", "tiny", "--out", str(w / "out"), *flags]


def _proof(w: Path, *flags: str) -> list[str]:
    return [*_proof_with(w, w / "ledger.jsonl"), *flags]


def _proof_with(w: Path, ledger: Path | None) -> list[str]:
    """`train proof` with ``--ledger LEDGER`` (None: no --ledger, the default one)."""
    return ["train", "proof", "--persona", str(PERSONA), "--base-model", str(w / "model"),
            "--out", str(w / "out"), *(["--ledger", str(ledger)] if ledger else [])]


def _sft(w: Path, *flags: str) -> list[str]:
    return ["train", "sft", "--corpus", str(w / "corpus"), "--base-model", str(w / "model"),
            "--out", str(w / "out"), *flags]


FLAG_CASES = [
    ("model-seed-huge", _model, ("--seed", "99999999999999999999999"), "--seed"),
    ("model-seed-2**32", _model, ("--seed", str(2**32)), "--seed"),
    ("model-seed-negative", _model, ("--seed", "-1"), "--seed"),
    ("proof-lr-nan", _proof, ("--lr", "nan"), "--lr"),
    ("proof-lr-inf", _proof, ("--lr", "inf"), "--lr"),
    ("proof-lr-zero", _proof, ("--lr", "0"), "--lr"),
    ("proof-lr-negative", _proof, ("--lr", "-0.1"), "--lr"),
    ("proof-lr-too-big", _proof, ("--lr", "10"), "--lr"),
    ("proof-seed-huge", _proof, ("--seed", str(2**64)), "--seed"),
    ("sft-epochs-negative", _sft, ("--epochs", "-1"), "--epochs"),
    ("sft-epochs-zero", _sft, ("--epochs", "0"), "--epochs"),
    ("sft-epochs-huge", _sft, ("--epochs", str(10**12)), "--epochs"),
    ("sft-lr-nan", _sft, ("--lr", "nan"), "--lr"),
    ("sft-lr-minus-inf", _sft, ("--lr", "-inf"), "--lr"),
    ("sft-seed-negative", _sft, ("--seed", "-5"), "--seed"),
]


@pytest.mark.parametrize(("build", "flags", "field"),
                         [pytest.param(b, f, x, id=i) for i, b, f, x in FLAG_CASES])
def test_numeric_flag_out_of_range_is_bad_input_before_anything(
        work: Path, build: Any, flags: tuple[str, ...], field: str) -> None:
    code, _, err = run_cli(build(work, *flags), _env(work))
    assert code == EXIT_BAD_INPUT, err
    line = _first_line(err)
    assert field in line and "Fix:" in line, line
    assert "Traceback" not in err
    assert not (work / "out").exists(), "--out made by a refused command"
    assert sorted(p.name for p in work.iterdir()) == ["corpus", "model", "state"], err


def _never(_call: Call) -> Result:
    raise AssertionError("a trainer container ran")


def test_host_functions_check_the_numbers_too(tmp_path: Path) -> None:
    """``make_tiny``/``proof``/``sft`` called as a library refuse before --out is made."""
    from runner.train.host import make_tiny, proof, sft

    trainer, box = fake_trainer(_never)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "out"

    def events(_e: dict[str, Any]) -> None:
        return None

    with pytest.raises(ConfigError, match="--seed"):
        make_tiny(trainer, out, events, seed=2**32)
    with pytest.raises(ConfigError, match="--lr"):
        proof(trainer, PERSONA, model, out, ledger=tmp_path / "l.jsonl", lr=float("nan"),
              seed=0, on_event=events)
    with pytest.raises(ConfigError, match="--epochs"):
        sft(trainer, tmp_path, model, out, lr=5e-3, seed=0, epochs=-1, on_event=events)
    with pytest.raises(ConfigError, match="--seed"):
        sft(trainer, tmp_path, model, out, lr=5e-3, seed=True, epochs=None,  # a bool is not
            on_event=events)                                              # a seed
    assert not out.exists() and box.specs == []


@pytest.mark.parametrize("read_only_fs", [
    False, pytest.param(True, marks=needs_root)], ids=["parent-is-a-file", "read-only"])
def test_host_proof_checks_the_ledger_before_training(tmp_path: Path,
                                                      read_only_fs: bool) -> None:
    """``proof`` called as a library: the ledger is checked before --out or a container."""
    from runner.train.host import proof

    trainer, box = fake_trainer(_never)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "out"
    with contextlib.ExitStack() as stack:
        if read_only_fs:
            ledger = stack.enter_context(read_only(tmp_path / "ro")) / "ledger.jsonl"
        else:
            (tmp_path / "afile").write_text("x")
            ledger = tmp_path / "afile" / "ledger.jsonl"
        with pytest.raises(ConfigError, match="--ledger") as exc:
            proof(trainer, PERSONA, model, out, ledger=ledger, lr=5e-3, seed=0,
                  on_event=lambda _e: None)
    assert str(ledger) in str(exc.value)
    assert not out.exists() and box.specs == []


def test_the_bounds_themselves_are_accepted() -> None:
    for seed in (0, SEED_MAX):
        check_train_flags(seed=seed, lr=LR_MAX, epochs=EPOCHS_MAX)
    check_train_flags(seed=0, lr=1e-12, epochs=1)
    check_train_flags(seed=0, lr=5e-3, epochs=None)


# -- the ledger, before any training ----------------------------------------------------------
@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """``path`` (a directory) as a read-only bind mount onto itself while inside."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _ledger_dir(w: Path) -> Path:
    d = w / "ledgers"
    d.mkdir()
    return d


LEDGER_CASES: dict[str, Any] = {
    "is-a-directory": _ledger_dir,
    "is-a-fifo": lambda w: (os.mkfifo(_ledger_dir(w) / "l.jsonl"), w / "ledgers/l.jsonl")[1],
    "symlink-to-a-device": lambda w: (os.symlink("/dev/null", _ledger_dir(w) / "l.jsonl"),
                                      w / "ledgers/l.jsonl")[1],
    "dangling-symlink": lambda w: (os.symlink(w / "nowhere", _ledger_dir(w) / "l.jsonl"),
                                   w / "ledgers/l.jsonl")[1],
    "parent-is-a-file": lambda w: ((w / "afile").write_text("x"), w / "afile" / "l.jsonl")[1],
}


@pytest.mark.parametrize("make", LEDGER_CASES.values(), ids=LEDGER_CASES.keys())
def test_ledger_that_cannot_take_the_row_is_refused_before_training(work: Path,
                                                                      make: Any) -> None:
    ledger = make(work)
    code, _, err = run_cli(_proof_with(work, ledger), _env(work))
    assert code == EXIT_BAD_INPUT, err
    line = _first_line(err)
    assert "--ledger" in line and str(ledger) in line and "Fix:" in line, line
    assert not (work / "out").exists()


@needs_root
@pytest.mark.parametrize("existing", [False, True], ids=["new-ledger", "existing-ledger"])
def test_ledger_on_a_read_only_file_system_is_refused_before_training(
        work: Path, existing: bool) -> None:
    ro = work / "ro"
    ro.mkdir()
    ledger = ro / "ledger.jsonl"
    if existing:
        ledger.write_text('{"persona": "x"}\n')
    with read_only(ro):
        code, _, err = run_cli(_proof_with(work, ledger), _env(work))
    assert code == EXIT_BAD_INPUT, err
    line = _first_line(err)
    assert "--ledger" in line and str(ledger) in line and "read-only" in line, line
    assert not (work / "out").exists()


@needs_root
def test_default_ledger_in_a_read_only_state_dir_is_refused(work: Path) -> None:
    args = _proof_with(work, None)  # no --ledger: <state dir>/train/ledger.jsonl
    with read_only(work / "state"):
        code, _, err = run_cli(args, _env(work))
    assert code == EXIT_BAD_INPUT, err
    assert "--ledger" in _first_line(err) and "state/train/ledger.jsonl" in _first_line(err)
    assert not (work / "out").exists()


# -- the ledger, after the training ---------------------------------------------------------
ROW = {"persona": "captain", "passed": True, "rows": 1, "epochs": 2, "grad_accum": 1,
       "imprint_delta": 0.7, "recall_before": 0.0, "recall_after": 1.0, "board": "approve"}


def _proof_outputs() -> dict[str, bytes | str]:
    scores = {"similarity_before": 0.2, "similarity_after": 0.9, "imprint_delta": 0.7,
              "changed": 0.8}
    figures = {"steps": 2, "epochs": 2, "grad_accum": 1, "lr": 0.005, "train_tokens": 9,
               "seconds": 1.0, "tokens_per_s": 9.0, "final_loss": 0.4, "peak_rss_mb": 80.0}
    report = {"persona": "captain", "schedule": {"epochs": 2, "grad_accum": 1, "reason": "r"},
              "figures": figures, "probes": ["q"], "references": ["a"], "before": ["x"],
              "after": ["a"], "recall_before": 0.0, "recall_after": 1.0, "scores": scores,
              "classroom_passed": True, "board": {"decision": "approve", "members": {}}}
    weights = b"adapter weights"
    dataset = b'{"messages": []}\n'
    config = {"lr": 0.005, "seed": 0}  # the CLI's defaults, as the host wrote them
    receipt = {"schema": 1, "kind": "proof", "config": config,
               "config_sha256": hashlib.sha256(canonical(config)).hexdigest(),
               "dataset_sha256": hashlib.sha256(dataset).hexdigest(),
               "adapter_files": {"adapter_model.safetensors": hashlib.sha256(weights)
                                 .hexdigest()},
               "base_model_files": {}, "recall_before": 0.0, "recall_after": 1.0,
               "scores": scores, "classroom_passed": True, "board": "approve"}
    return {"adapter/adapter_model.safetensors": weights, "report.json": json.dumps(report),
            "dataset.jsonl": dataset, "train-receipt.json": json.dumps(receipt),
            "ledger-row.json": json.dumps(ROW)}


def _run_proof(work: Path, monkeypatch: pytest.MonkeyPatch, ledger: Path,
               during_training: Any) -> tuple[int | str, str]:
    """`train proof` with a scripted trainer that calls ``during_training()`` while it
    "trains", then writes a consistent adapter, receipt, report and ledger row."""
    import runner.cli.train
    import runner.train.host

    def behaviour(call: Call) -> Result:
        if call.spec.command[-1] == "sandbox.train.verify_adapter":
            return Result(stdout='{"event": "verified", "reproduced": true}\n')
        during_training()
        return Result(files=_proof_outputs())

    trainer, _box = fake_trainer(behaviour)
    monkeypatch.setattr(runner.cli.train, "trainer", lambda: trainer)
    # the scripted answers are not a real imprint: the host's own scoring is another test's
    monkeypatch.setattr(runner.train.host, "settle", lambda *a: a[4])
    code, _, err = run_cli(_proof_with(work, ledger), _env(work))
    return code, err


def _kept(work: Path, err: str) -> None:
    out = work / "out"
    assert "Traceback" not in err
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == b"adapter weights"
    assert (out / "train-receipt.json").is_file()
    assert json.loads((out / "ledger-row.json").read_text()) == ROW  # the row is not lost
    assert str(out) in _first_line(err) and "ledger-row.json" in _first_line(err)
    assert sorted(p.name for p in work.iterdir() if p.name.startswith(".")) == []


def test_ledger_replaced_by_a_directory_during_training(work: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = work / "ledger.jsonl"

    def swap() -> None:
        ledger.mkdir()

    code, err = _run_proof(work, monkeypatch, ledger, swap)
    assert code == EXIT_BAD_INPUT, err
    assert f"{ledger}: --ledger:" in _first_line(err), err
    _kept(work, err)


def test_ledger_replaced_by_a_fifo_during_training_does_not_hang(
        work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = work / "ledger.jsonl"
    ledger.write_text(json.dumps(ROW) + "\n")

    def swap() -> None:
        ledger.unlink()
        os.mkfifo(ledger)

    code, err = _run_proof(work, monkeypatch, ledger, swap)
    assert code == EXIT_BAD_INPUT, err
    assert f"{ledger}: --ledger:" in _first_line(err), err
    _kept(work, err)


@needs_root
def test_ledger_made_read_only_during_training_keeps_adapter_and_rows(
        work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reviewer's M3: exit 10 ``Read-only file system`` after the training, row lost."""
    d = work / "ledgers"
    d.mkdir()
    ledger = d / "ledger.jsonl"
    before = json.dumps({**ROW, "passed": False}) + "\n"
    ledger.write_text(before)
    with contextlib.ExitStack() as stack:
        code, err = _run_proof(work, monkeypatch, ledger,
                               lambda: stack.enter_context(read_only(d)))
    assert code == EXIT_BAD_INPUT, err
    line = _first_line(err)
    assert f"{ledger}: --ledger:" in line and "Read-only file system" in line, line
    assert ledger.read_text() == before
    _kept(work, err)


@needs_root
def test_disk_full_at_the_append_is_environment_failure_and_no_partial_line(
        work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = work / "small"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], check=True)
    try:
        ledger = d / "ledger.jsonl"
        # one earlier row, padded so its last page has a few bytes to spare: the append
        # writes into them, then meets the full disk (a partial line to take back)
        row = json.dumps({**ROW, "pad": ""})
        before = json.dumps({**ROW, "pad": "x" * (4090 - len(row) - 1)}) + "\n"
        assert len(before) == 4090
        ledger.write_text(before)

        def fill() -> None:
            fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                while os.write(fd, b"\0" * 4096):
                    pass
            except OSError:
                pass  # the disk is full
            finally:
                os.close(fd)

        code, err = _run_proof(work, monkeypatch, ledger, fill)
        assert code == EXIT_ENVIRONMENT, err
        line = _first_line(err)
        assert str(ledger) in line and "No space left" in line, line
        assert ledger.read_bytes() == before.encode()  # the partial line was taken back
        _kept(work, err)
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
