"""The export's real consumer: verl 0.9.1's own dataset classes load what `cyclebox export`
wrote, `train sft` learns from the trajectories that passed, and the adapter loads on the
host with peft's AutoPeftModelForCausalLM. verl runs in its own virtualenv
(`make verl-env` -> build/verl-venv) as a subprocess; without it these tests fail, never
skip. Also: a calibration of run A is refused for run B, through the CLI.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runner.paths import PROJECT_ROOT

pytestmark = [pytest.mark.docker, pytest.mark.slow]
EXAMPLE = PROJECT_ROOT / "examples" / "shop-analyst"
CLI = str(Path(sys.executable).with_name("cyclebox"))
VERL_PY = PROJECT_ROOT / "build" / "verl-venv" / "bin" / "python"
CONSUMER = Path(__file__).with_name("verl_consumer.py")


def cyclebox(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


def verl(*args: str) -> dict[str, Any]:
    assert VERL_PY.is_file(), f"{VERL_PY} missing: run `make verl-env` (make test does)"
    res = subprocess.run([str(VERL_PY), str(CONSUMER), *args], capture_output=True, text=True,
                         timeout=900, check=False, cwd=CONSUMER.parent)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    line = [x for x in res.stdout.splitlines() if x.startswith("VERL-FACTS ")]
    assert len(line) == 1, res.stdout[-3000:]
    return json.loads(line[0].removeprefix("VERL-FACTS "))  # type: ignore[no-any-return]


def run_cycle(dest: Path, cycle: str = "cycle.yaml") -> Path:
    res = cyclebox("cycle", "run", str(EXAMPLE / cycle), "--out", str(dest), "--json")
    assert res.returncode in (0, 1), res.stdout + res.stderr
    return dest


def calibrate_run(run: Path, work: Path) -> Path:
    """Packet from the run's baseline records (bound to the run), labels that agree with
    the model ("na" where the scorer graded a criterion not applicable), calibration."""
    packet = work / "packet"
    res = cyclebox("review", "packet", "--records", str(run / "stages/baseline/records.jsonl"),
                   "--out", str(packet))
    assert res.returncode == 0, res.stderr
    labels = json.loads((packet / "human-labels.json").read_text())
    ratings = json.loads((packet / "judge-ratings.json").read_text())["ratings"]
    for item, crit in labels["labels"].items():
        for c in crit:
            crit[c] = "na" if ratings[item][c] is None else ratings[item][c]
    labels["labeled_at"] = "2026-11-29T12:00:00+00:00"
    (work / "labels.json").write_text(json.dumps(labels))
    cal = work / "cal.json"
    res = cyclebox("review", "calibrate", "--packet", str(packet), "--labels",
                   str(work / "labels.json"), "--judges", str(packet / "judge-ratings.json"),
                   "--out", str(cal))
    assert res.returncode == 0, res.stdout + res.stderr
    return cal


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("verl")
    run = run_cycle(work / "run-a")
    cal = calibrate_run(run, work)
    corpus = work / "corpus"
    res = cyclebox("export", "--run", str(run), "--format", "verl", "--calibration", str(cal),
                   "--out", str(corpus), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    return {"run": run, "cal": cal, "corpus": corpus, "work": work}


def test_verl_loads_every_row_with_its_own_datasets(exported: dict[str, Path],
                                                    tiny_model: Path) -> None:
    corpus = exported["corpus"]
    trajs = [json.loads(x) for x in (corpus / "trajectories.jsonl").read_text().splitlines()]
    summary = json.loads((corpus / "summary.json").read_text())
    assert summary["trajectories"] == len(trajs) == 28
    # every case graded: refuse cases on refusal, the rest on correctness; none null
    assert summary["r_outcome"]["null"] == 0
    assert summary["r_outcome_basis"] == {"correctness": 24, "refusal": 4}
    passed = [t for t in trajs if t["r_outcome"] == 1.0]
    facts = verl("datasets", str(corpus), str(tiny_model))
    assert facts["rl_file_rows"] == facts["rl_loaded"] == 28
    assert facts["rl_index"] == list(range(28))
    assert facts["rl_data_source"] == [trajs[0]["data_source"]]
    for roles, t in zip(facts["rl_roles"], trajs, strict=True):
        want = [m["role"] for m in json.loads(t["turns"][0]["prompt"])["messages"]]
        assert roles == want and roles[-1] == "user" and "assistant" not in roles
    assert facts["rl_r_outcome"] == [t["r_outcome"] for t in trajs]
    assert facts["rl_request_sha256"] == [hashlib.sha256(
        t["turns"][0]["prompt"].encode()).hexdigest() for t in trajs]
    refs = {s["id"]: s["reference"] for s in json.loads(
        (exported["run"] / "inputs/manifest.json").read_text())["scenarios"]}
    assert [json.loads(g) for g in facts["rl_ground_truth"]] == [
        refs[t["case_id"]] for t in trajs]
    assert facts["sft_file_rows"] == facts["sft_loaded"] == len(passed) == 21
    for roles in facts["sft_roles"]:
        assert roles[-1] == "assistant" and roles[-2] == "user"
    assert all(n > 0 for n in facts["sft_loss_tokens"]), facts["sft_loss_tokens"]
    assert all(n < t for n, t in zip(facts["sft_loss_tokens"], facts["sft_tokens"],
                                     strict=True))  # the prompt is not learned


def test_calibration_of_run_a_refused_for_run_b(exported: dict[str, Path]) -> None:
    run_b = run_cycle(exported["work"] / "run-b", "cycle-negative.yaml")
    out = exported["work"] / "corpus-b"
    res = cyclebox("export", "--run", str(run_b), "--format", "verl", "--calibration",
                   str(exported["cal"]), "--out", str(out))
    assert res.returncode == 3, res.stdout + res.stderr
    assert "calibration_of_another_run" in res.stderr
    assert not out.exists()
    cal_b = calibrate_run(run_b, exported["work"] / "b")  # its own calibration is accepted
    res = cyclebox("export", "--run", str(run_b), "--format", "verl", "--calibration",
                   str(cal_b), "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr


def test_calibrate_exit_codes(exported: dict[str, Path]) -> None:
    packet = exported["work"] / "packet"
    res = cyclebox("review", "calibrate", "--packet", str(packet), "--labels",
                   str(packet / "human-labels.json"), "--judges",
                   str(packet / "judge-ratings.json"), "--out",
                   str(exported["work"] / "blank.json"))
    assert res.returncode == 4 and "calibration incomplete" in res.stderr
    assert (exported["work"] / "blank.json").is_file()  # the result is kept
    res = cyclebox("review", "calibrate", "--help")
    text = " ".join(res.stdout.split())
    assert "Exit codes" in text and "4 check failed" in text and "8 integrity" in text


def test_train_sft_on_passed_then_adapter_loads_on_host(exported: dict[str, Path],
                                                        tiny_model: Path) -> None:
    out = exported["work"] / "sft"
    res = cyclebox("train", "sft", "--corpus", str(exported["corpus"]), "--base-model",
                   str(tiny_model), "--out", str(out), "--epochs", "1", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    receipt = json.loads(res.stdout)
    assert receipt["selection"] == {
        "include_failed": False, "rule": "r_outcome == 1", "trajectories": 28,
        "by_r_outcome": {"1": 21, "0": 7, "null": 0}, "used": 21, "left_out": 7, "rows": 21,
        "rows_with_special_tokens": 0}
    assert receipt["figures"]["steps"] == 21
    assert receipt["base_model"] == {"host_path": str(tiny_model.resolve()),
                                     "container_path": "/model"}
    # no failed trajectory's reply is in the training set
    failed = {t["turns"][-1]["reply"] for t in map(json.loads, (
        exported["corpus"] / "trajectories.jsonl").read_text().splitlines())
        if t["r_outcome"] != 1.0}
    trained = {json.loads(x)["messages"][-1]["content"]
               for x in (out / "dataset.jsonl").read_text().splitlines()}
    assert failed and not failed & trained
    # handed to the operator: nothing left mode 0700 / owned by the trainer uid
    for p in [out, *out.rglob("*")]:
        st = p.lstat()
        assert st.st_mode & 0o777 in (0o755, 0o644), (p, oct(st.st_mode))
        assert st.st_uid != 10001, p
    facts = verl("adapter", str(out / "adapter"), "What was the total revenue?")
    assert facts["base_model_name_or_path"] == str(tiny_model.resolve())
    assert facts["finite"] is True and facts["logits_shape"][0] == 1
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tiny_model.resolve())
