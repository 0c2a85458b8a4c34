"""Training in the trainer image on a real engine: isolation, the proof loop, the adapter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runner.paths import PROJECT_ROOT
from sandbox.train.receipt import tree_sha
from tests.conftest import RunFn

pytestmark = [pytest.mark.docker, pytest.mark.slow]
CLI = str(Path(sys.executable).with_name("cyclebox"))
PERSONA = PROJECT_ROOT / "examples" / "persona" / "captain.yaml"


def test_tiny_model_is_a_transformers_model(tiny_model: Path) -> None:
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= {
        p.name for p in tiny_model.iterdir()}


def test_trainer_container_isolation(run_role: RunFn, tiny_model: Path) -> None:
    from runner.isolation.sandbox import Mount

    rec = run_role(["python", "-c",
                    "import json, os, sandbox.probe as p\n"
                    "f = p.facts('trainer', ['127.0.0.1:9'])\n"
                    "try:\n    open('/model/x', 'w'); f['model_writable'] = True\n"
                    "except OSError as e:\n    f['model_writable'] = e.strerror\n"
                    "print(json.dumps(f))"],
                   role="trainer", mounts=[Mount(source=tiny_model, target="/model")])
    assert rec.stop_reason.value == "ok", rec.stderr_tail
    facts = json.loads(rec.stdout_tail)
    assert facts["interfaces"] == ["lo"]
    assert facts["uid"] != 0 and facts["cap_eff"] == "0000000000000000"
    assert facts["model_writable"] == "Read-only file system"
    assert facts["rootfs_writable"] is False


def test_proof_loop_imprints_and_reproduces(tiny_model: Path, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.jsonl"
    out = tmp_path / "proof"
    res = subprocess.run([CLI, "train", "proof", "--persona", str(PERSONA), "--base-model",
                          str(tiny_model), "--out", str(out), "--ledger", str(ledger), "--json"],
                         capture_output=True, text=True, check=False, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads(res.stdout)
    report = summary["report"]
    assert report["recall_before"] <= 0.2
    assert report["recall_after"] >= 0.75
    assert report["classroom_passed"] is True
    assert report["board"]["decision"] == "approve"
    assert summary["reproduced_in_fresh_process"] is True
    receipt = json.loads((out / "train-receipt.json").read_text())
    assert receipt["adapter_files"] == tree_sha(out / "adapter")
    assert "adapter_model.safetensors" in receipt["adapter_files"]
    assert receipt["config"]["lora"] == {"r": 16, "alpha": 32, "target_modules": [
        "q_proj", "k_proj", "v_proj", "o_proj"]}
    rows = [json.loads(x) for x in ledger.read_text().splitlines()]
    assert rows == [summary["ledger_row"]] and rows[0]["passed"] is True
    assert rows[0]["epochs"] == 24  # 7 rows -> 24 epochs, no ledger history yet
