"""An interrupted `train sft` leaves nothing at --out: the same command runs again.

The trainer container is the scripted sandbox (``tests/fixtures/fake_sandbox.py``, the
Sandbox seam); its run is interrupted the way the first SIGINT/SIGTERM interrupts the
controller's main thread (``KeyboardInterrupt``, ``runner.interrupts``). Expect exit 130,
no --out and no hidden input directory; the rerun gets past the --out check (here the
scripted trainer then fails: exit 6, never 3 "exists"). `export` is covered in
``test_export_faults.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.test_bad_inputs import run_cli
from tests.fixtures.fake_sandbox import Behaviour, Call, Result, fake_trainer


def _interrupted(_call: Call) -> Result:
    raise KeyboardInterrupt


def _failed(_call: Call) -> Result:
    return Result(exit_code=1, stderr="scripted failure")


def _use(monkeypatch: pytest.MonkeyPatch, behaviour: Behaviour) -> None:
    import runner.cli.train

    trainer, _ = fake_trainer(behaviour)
    monkeypatch.setattr(runner.cli.train, "trainer", lambda: trainer)


def test_interrupted_train_sft_leaves_no_out(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "trajectories.jsonl").write_text("")
    base = tmp_path / "model"
    base.mkdir()
    (base / "config.json").write_text("{}")
    out = tmp_path / "adapters" / "sft"
    (tmp_path / "adapters").mkdir()
    args = ["train", "sft", "--corpus", str(corpus), "--base-model", str(base),
            "--out", str(out)]

    _use(monkeypatch, _interrupted)
    code, _, err = run_cli(args, {})
    assert code == 130, err
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == [], err

    _use(monkeypatch, _failed)
    code, _, err = run_cli(args, {})
    assert code == 6, err  # not 3 "already exists"
    assert "already exists" not in err
