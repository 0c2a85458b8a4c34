"""What a trainer container writes is read as `collect` reads any role's output: a
symlink anywhere in ``--out`` is refused by name, never followed (helper-40: an
``adapter`` symlink to ``/usr`` made ``train sft`` hash 134,000 host files, and a
symlinked weights file or receipt was left out of the check or read from the host).

The real backend's copy-out already refuses symlinks; these runs write them through the
scripted sandbox (the Sandbox seam), as a backend that kept them would.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from runner.errors import OutputRejected
from runner.train.host import Trainer, make_tiny, sft
from tests.fixtures.fake_sandbox import Call, Result, fake_trainer


def _trainer(result: Result) -> Trainer:
    def behaviour(_call: Call) -> Result:
        return result

    return fake_trainer(behaviour)[0]


def _inputs(tmp_path: Path) -> tuple[Path, Path]:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "trajectories.jsonl").write_text("")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return corpus, model


def _events(_e: dict[str, Any]) -> None:
    return None


@pytest.fixture
def host_tree(tmp_path: Path) -> Path:
    """A host directory a link points at: many files, one of them 'weights'."""
    d = tmp_path / "host"
    for i in range(200):
        (d / f"d{i}").mkdir(parents=True)
        (d / f"d{i}" / "f").write_text(str(i))
    (d / "weights").write_bytes(b"host weights")
    return d


@pytest.mark.parametrize("case", ["adapter-dir", "weights-file", "receipt"])
def test_sft_refuses_a_symlink_in_the_trainers_output(tmp_path: Path, host_tree: Path,
                                                      case: str) -> None:
    corpus, model = _inputs(tmp_path)
    files: dict[str, bytes | str] = {"adapter/adapter_config.json": "{}",
                                     "train-receipt.json": "{}"}
    links = {"adapter-dir": {"adapter": str(host_tree)},
             "weights-file": {"adapter/adapter_model.safetensors": str(host_tree / "weights")},
             "receipt": {"train-receipt.json": str(host_tree / "weights")}}[case]
    if case == "adapter-dir":
        files.pop("adapter/adapter_config.json")
    if case == "receipt":
        files.pop("train-receipt.json")
    out = tmp_path / "out"
    t = time.monotonic()
    with pytest.raises(OutputRejected, match="symlink refused") as got:
        sft(_trainer(Result(files=files, symlinks=links)), corpus, model, out, lr=5e-3,
            seed=0, epochs=None, on_event=_events)
    assert next(iter(links)) in str(got.value)
    assert time.monotonic() - t < 10
    assert (host_tree / "weights").read_bytes() == b"host weights"


def test_make_tiny_refuses_a_symlinked_description(tmp_path: Path, host_tree: Path) -> None:
    with pytest.raises(OutputRejected, match=r"cyclebox-tiny\.json: symlink refused"):
        make_tiny(_trainer(Result(symlinks={"cyclebox-tiny.json": str(host_tree / "weights")})),
                  tmp_path / "tiny", _events)
