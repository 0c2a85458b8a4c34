"""The improvement cycle end to end through the CLI, on the bundled example (offline).

One accepted demo run is shared by the session (tests/e2e/conftest.py); every test that
must change something works on its own copy (of the example or of the run directory).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.cycle.receipt import verify
from runner.paths import PROJECT_ROOT

pytestmark = [pytest.mark.docker, pytest.mark.slow]
EXAMPLE = PROJECT_ROOT / "examples" / "shop-analyst"
CLI = str(Path(sys.executable).with_name("cyclebox"))


def cyclebox(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


def example_copy(dest: Path, **changes: Any) -> Path:
    """A copy of the example whose cycle.yaml points at absolute paths, with changes."""
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("project"))
    cyc = yaml.safe_load((EXAMPLE / "cycle.yaml").read_text())
    cyc["project"]["repo"] = str(PROJECT_ROOT)
    cyc["roles"] = str(PROJECT_ROOT / "policies" / "roles.yaml")
    cyc["upstreams"]["judge"]["script"] = str(PROJECT_ROOT / "policies/scripts/default.yaml")
    cyc.update(changes)
    (dest / "cycle.yaml").write_text(yaml.safe_dump(cyc))
    return dest / "cycle.yaml"


@pytest.fixture(scope="module")
def demo(shop_demo: tuple[Path, dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    """The session's demo run (tests/e2e/conftest.py), shared with test_attest.py."""
    return shop_demo


def test_demo_accepts_for_review_and_receipt_verifies(demo: tuple[Path, dict[str, Any]]) -> None:
    run, result = demo
    assert result["verdict"] == "accept_for_review"
    improved = json.loads((run / "stages/compare/verdict.json").read_text())["improvements"]
    assert {c["case_id"] for c in improved} == {"d01-revenue-march", "d02-revenue-books",
                                                "a01-revenue-april", "a02-revenue-games",
                                                "a04-aov-january"}
    res = cyclebox("receipt", "verify", str(run))
    assert res.returncode == 0, res.stdout + res.stderr
    receipt = json.loads((run / "receipt.json").read_text())
    assert receipt["fixture"] is True and receipt["leftovers"] == []
    assert receipt["usage"]["total"]["complete"] is True
    assert all(c["cleanup_confirmed"] for c in receipt["containers"])
    assert {c["role"] for c in receipt["containers"]} == {"analyst", "evaluator", "worker",
                                                          "apply"}


def test_flipping_any_named_byte_fails_verify(demo: tuple[Path, dict[str, Any]],
                                              tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(demo[0], copy, symlinks=True)
    files = json.loads((copy / "receipt.json").read_text())["files"]
    assert len(files) > 50
    commit = json.loads((copy / "stages/apply/result.json").read_text())["commit"]
    commit_object = f"stages/apply/candidate.git/objects/{commit[:2]}/{commit[2:]}"
    assert commit_object in files  # bound, and read to recompute the candidate tree
    for rel in files:
        p = copy / rel
        original = p.read_bytes()
        if not original:
            continue
        p.write_bytes(bytes([original[0] ^ 0x01]) + original[1:])
        problems = verify(copy)
        p.write_bytes(original)
        # plan.json, apply's result.json and the candidate's commit object also feed
        # other checks, which then fail too
        assert problems == [f"{rel}: sha256 differs from the receipt"] or (
            rel in ("plan.json", "stages/apply/result.json", commit_object)
            and f"{rel}: sha256 differs from the receipt" in problems), (rel, problems)
    assert verify(copy) == []
    target = copy / "stages/apply/candidate.patch"
    target.write_bytes(target.read_bytes() + b" ")
    res = cyclebox("receipt", "verify", str(copy))
    assert res.returncode == 8
    assert "stages/apply/candidate.patch" in res.stderr


def test_worker_never_sees_acceptance_content(demo: tuple[Path, dict[str, Any]]) -> None:
    run, _ = demo
    manifest = json.loads((EXAMPLE / "manifest.json").read_text())
    request = (run / "stages/propose/in/request.json").read_text()
    calls = [json.loads(line) for line in (run / "gateway/calls.jsonl").read_text().splitlines()]
    worker_bytes = [(run / "gateway/blobs" / c["request_sha256"]).read_text()
                    for c in calls if c["role"] == "worker"]
    assert len(worker_bytes) == 1
    for s in manifest["scenarios"]:
        if s["split"] == "development":
            continue
        for needle in (s["id"], s["input"]["question"]):
            assert needle not in request and needle not in worker_bytes[0], needle
        if s["reference"]["value"] is not None:
            assert json.dumps(s["reference"]["value"]) not in request
    assert "d01-revenue-march" in request  # the brief does carry development failures


def test_negative_control_rejects_naming_the_mandatory_case(tmp_path: Path) -> None:
    res = cyclebox("cycle", "run", str(EXAMPLE / "cycle-negative.yaml"), "--out",
                   str(tmp_path / "neg"), "--json")
    assert res.returncode == 1, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["verdict"] == "reject"
    assert any("mandatory case d05-password failed refusal" in r for r in out["reasons"])
    assert any("mandatory case a05-delete failed refusal" in r for r in out["reasons"])


def test_second_run_into_same_dir_is_refused(demo: tuple[Path, dict[str, Any]]) -> None:
    run, _ = demo
    res = cyclebox("cycle", "run", "--plan", str(run / "plan.json"))
    assert res.returncode == 3 and "already executed" in res.stderr
    res = cyclebox("cycle", "run", str(EXAMPLE / "cycle.yaml"), "--out", str(run))
    assert res.returncode == 3 and "never overwritten" in res.stderr


def test_tampered_plan_refused_before_any_container(tmp_path: Path) -> None:
    d = tmp_path / "prepared"
    res = cyclebox("cycle", "run", str(EXAMPLE / "cycle.yaml"), "--out", str(d),
                   "--prepare-only")
    assert res.returncode == 0, res.stderr
    doc = json.loads((d / "plan.json").read_text())
    doc["plan"]["trials"] = 2
    (d / "plan.json").write_text(json.dumps(doc))
    res = cyclebox("cycle", "run", "--plan", str(d / "plan.json"))
    assert res.returncode == 8
    assert "plan_hash does not match" in res.stderr
    assert not (d / "stages").exists() and not (d / "containers.jsonl").exists()


def test_data_changed_between_freeze_and_run_is_invalid(tmp_path: Path) -> None:
    cycle = example_copy(tmp_path / "ex")
    d = tmp_path / "prepared"
    assert cyclebox("cycle", "run", str(cycle), "--out", str(d), "--prepare-only"
                    ).returncode == 0
    db = tmp_path / "ex" / "data" / "shop.sqlite"
    db.write_bytes(db.read_bytes() + b"\0")
    res = cyclebox("cycle", "run", "--plan", str(d / "plan.json"), "--json")
    assert res.returncode == 2, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["verdict"] == "invalid_comparison"
    assert any("data drift" in r and "store shop" in r for r in out["reasons"])
    assert cyclebox("receipt", "verify", str(d)).returncode == 8  # the store changed


def test_budget_exhaustion_leaves_not_attempted_and_invalid(tmp_path: Path) -> None:
    cycle = example_copy(tmp_path / "ex", budget={
        "limit_usd": 1.0, "max_calls": 200, "reservation_usd": 0.01,
        "per_role_calls": {"analyst": 20}})
    res = cyclebox("cycle", "run", str(cycle), "--out", str(tmp_path / "run"), "--json")
    assert res.returncode == 2, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["verdict"] == "invalid_comparison"
    attempted = [r for r in out["reasons"] if "not_attempted" in r]
    assert len(attempted) == 8, out["reasons"]  # 14 cases: 14 baseline + 6 candidate calls
    records = [json.loads(line) for line in
               (tmp_path / "run/stages/candidate/records.jsonl").read_text().splitlines()]
    assert sum(r["status"] == "not_attempted" for r in records) == 8
    assert all(r["grades"] is None for r in records if r["status"] == "not_attempted")


def test_compare_cli_exit_codes_and_coverage(demo: tuple[Path, dict[str, Any]],
                                             tmp_path: Path) -> None:
    run, _ = demo
    base = run / "stages/baseline/records.jsonl"
    cand_lines = (run / "stages/candidate/records.jsonl").read_text().splitlines()
    policy = run / "inputs/policy.yaml"
    # the frozen policy carries identities; use it as the cycle did
    frozen = json.loads((run / "plan.json").read_text())["plan"]["policy"]
    (tmp_path / "policy.json").write_text(json.dumps(frozen))
    ok = cyclebox("compare", "--baseline", str(base), "--candidate",
                  str(run / "stages/candidate/records.jsonl"), "--policy",
                  str(tmp_path / "policy.json"), "--out", str(tmp_path / "c0"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    cases: dict[str, list[str]] = {
        "missing": cand_lines[1:],
        "duplicated": [*cand_lines, cand_lines[0]],
        "extra": [*cand_lines, cand_lines[0].replace('"trial":0', '"trial":1')],
    }
    for name, lines in cases.items():
        f = tmp_path / f"{name}.jsonl"
        f.write_text("\n".join(lines) + "\n")
        res = cyclebox("compare", "--baseline", str(base), "--candidate", str(f), "--policy",
                       str(tmp_path / "policy.json"), "--out", str(tmp_path / f"c-{name}"))
        assert res.returncode == 2, (name, res.stdout)
        assert name in res.stdout
    assert policy.is_file()


def agree_with_model(packet: Path, labels_out: Path) -> None:
    """Fill the packet's human labels with the model's own ratings (perfect agreement)."""
    labels = json.loads((packet / "human-labels.json").read_text())
    ratings = json.loads((packet / "judge-ratings.json").read_text())["ratings"]
    for item, crit in labels["labels"].items():
        for c in crit:
            crit[c] = ratings[item][c] if ratings[item][c] is not None else 0
    labels["labeled_at"] = "2026-11-29T12:00:00+00:00"
    labels_out.write_text(json.dumps(labels))


def test_review_packet_and_calibration(demo: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    run, _ = demo
    packet = tmp_path / "packet"
    res = cyclebox("review", "packet", "--records", str(run / "stages/baseline/records.jsonl"),
                   "--out", str(packet), "--reviewer", "qa", "--manifest",
                   str(EXAMPLE / "manifest.json"))
    assert res.returncode == 0, res.stderr
    review = (packet / "review.md").read_text()
    assert "What was the total revenue in April 2026?" in review  # the task, for the human
    assert "judge" not in review.lower()
    assert {p.name for p in packet.iterdir()} == {"review.md", "packet.json",
                                                  "human-labels.json", "judge-ratings.json"}
    # unlabelled: coverage fails -> non-zero
    res = cyclebox("review", "calibrate", "--packet", str(packet), "--labels",
                   str(packet / "human-labels.json"), "--judges",
                   str(packet / "judge-ratings.json"), "--out", str(tmp_path / "c0.json"))
    assert res.returncode != 0
    agree_with_model(packet, tmp_path / "labels.json")
    res = cyclebox("review", "calibrate", "--packet", str(packet), "--labels",
                   str(tmp_path / "labels.json"), "--judges", str(packet / "judge-ratings.json"),
                   "--out", str(tmp_path / "cal.json"), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    cal = json.loads(res.stdout)
    assert cal["complete"] is True and cal["coverage"]["overall"] == 1.0
    (packet / "review.md").write_text("tampered")
    res = cyclebox("review", "calibrate", "--packet", str(packet), "--labels",
                   str(tmp_path / "labels.json"), "--judges", str(packet / "judge-ratings.json"),
                   "--out", str(tmp_path / "cal2.json"))
    assert res.returncode == 8 and "review.md" in res.stderr


def test_the_loop_closes_export_then_train(demo: tuple[Path, dict[str, Any]], tmp_path: Path,
                                           tiny_model: Path) -> None:
    run, _ = demo
    corpus = tmp_path / "corpus"
    res = cyclebox("export", "--run", str(run), "--format", "verl", "--out", str(corpus))
    assert res.returncode == 3 and "cyclebox review calibrate" in res.stderr
    packet = tmp_path / "packet"
    assert cyclebox("review", "packet", "--records", str(run / "stages/baseline/records.jsonl"),
                    "--out", str(packet)).returncode == 0
    agree_with_model(packet, tmp_path / "labels.json")
    assert cyclebox("review", "calibrate", "--packet", str(packet), "--labels",
                    str(tmp_path / "labels.json"), "--judges",
                    str(packet / "judge-ratings.json"), "--out",
                    str(tmp_path / "cal.json")).returncode == 0
    res = cyclebox("export", "--run", str(run), "--format", "verl", "--out", str(corpus),
                   "--calibration", str(tmp_path / "cal.json"), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["trajectories"] == 28 and summary["turns"] == 28  # 14 cases x 2 sides
    first = json.loads((corpus / "trajectories.jsonl").read_text().splitlines()[0])
    blob = (run / "gateway/blobs" / first["turns"][0]["prompt_sha256"]).read_bytes()
    assert first["turns"][0]["prompt"].encode("utf-8") == blob
    res = cyclebox("train", "sft", "--corpus", str(corpus), "--base-model", str(tiny_model),
                   "--out", str(tmp_path / "sft"), "--epochs", "1", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    receipt = json.loads(res.stdout)
    # only the 21 trajectories that passed are learned from (7 were graded wrong)
    assert receipt["kind"] == "sft" and receipt["figures"]["steps"] == 21
    assert receipt["corpus_sha256"]


def _small_example(dest: Path, keep: dict[str, str], **changes: Any) -> Path:
    """The example with only the ``keep`` scenarios (id -> split), its policy comparing
    exactly those, so a cycle runs in seconds."""
    from runner.cycle.manifest import reference_hash
    from runner.cycle.models import Scenario

    cycle = example_copy(dest, **changes)
    m = json.loads((dest / "manifest.json").read_text())
    m["scenarios"] = [{**s, "split": keep[s["id"]]} for s in m["scenarios"] if s["id"] in keep]
    m["reference_hash"] = reference_hash([Scenario.model_validate(s) for s in m["scenarios"]])
    (dest / "manifest.json").write_text(json.dumps(m))
    pol = yaml.safe_load((dest / "policy.yaml").read_text())
    pol["cases"] = list(keep)
    pol["mandatory"] = [c for c in pol["mandatory"] if c in keep]
    (dest / "policy.yaml").write_text(yaml.safe_dump(pol))
    return cycle


def test_nothing_to_improve_ends_before_the_worker(tmp_path: Path) -> None:
    """Every development case passes on the baseline: the cycle ends invalid_comparison
    with reason nothing_to_improve, no worker container, no model call by the worker; the
    receipt still verifies. Plain output (a pipe, no COLUMNS) keeps the reason on one line
    and shows pass counts per arm and split."""
    cycle = _small_example(tmp_path / "ex", {"d03-orders-february": "development",
                                             "d05-password": "development",
                                             "a01-revenue-april": "acceptance"})
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    res = subprocess.run([CLI, "cycle", "run", str(cycle), "--out", str(run)],
                         capture_output=True, text=True, timeout=600, check=False, env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    verdict = json.loads((run / "stages/compare/verdict.json").read_text())
    assert verdict["verdict"] == "invalid_comparison"
    reason = verdict["reasons"][0]
    assert reason.startswith("nothing_to_improve: all 2 development run(s) passed"), reason
    assert "the worker was not called" in reason
    assert not (run / "stages/propose").exists() and not (run / "stages/candidate").exists()
    roles = {json.loads(line)["role"] for line in
             (run / "containers.jsonl").read_text().splitlines()}
    assert roles == {"analyst", "evaluator"}
    assert verify(run) == []
    lines = res.stdout.splitlines()
    assert any(reason in line for line in lines), res.stdout  # not folded at 80 columns
    assert any("pass baseline development" in line and "2/2" in line for line in lines)
    assert any("cost analyst" in line and "all fixture" in line for line in lines)
    assert "None" not in res.stdout


CRASHING_AGENT = '''import sys
print("starting", file=sys.stderr)
raise SystemExit("agent crashed: no model configured for CASE")
'''


def test_a_crashing_agent_names_its_stderr_log_and_tail(tmp_path: Path) -> None:
    """A failing case's reason names the log file holding its stderr and quotes the end;
    with no graded development failure the worker is not called (no_failure_to_brief)."""
    from tests.fixtures.cycle_project import project_with_agent

    cycle = project_with_agent(tmp_path / "ex", CRASHING_AGENT)
    keep = {"d01-revenue-march": "development", "a01-revenue-april": "acceptance"}
    _small_example(tmp_path / "small", keep)
    doc = yaml.safe_load(cycle.read_text())
    doc.update(scenarios=str(tmp_path / "small/manifest.json"),
               policy=str(tmp_path / "small/policy.yaml"))
    cycle.write_text(yaml.safe_dump(doc))
    run = tmp_path / "run"
    res = cyclebox("cycle", "run", str(cycle), "--out", str(run), "--json")
    assert res.returncode == 2, res.stdout + res.stderr
    records = [json.loads(line) for line in
               (run / "stages/baseline/records.jsonl").read_text().splitlines()]
    d01 = next(r for r in records if r["case_id"] == "d01-revenue-march")
    log = "stages/baseline/cases/d01-revenue-march__t0/logs/analyst-d01-revenue-march-t0.stderr"
    assert d01["status"] == "infra_invalid"
    assert d01["reason"].startswith("process_failed: exit code 1 (stderr: " + log), d01
    assert d01["reason"].endswith(
        "ends: starting / agent crashed: no model configured for CASE)"), d01
    assert "agent crashed" in (run / log).read_text()
    out = json.loads(res.stdout)
    assert out["reasons"][0].startswith("no_failure_to_brief:"), out["reasons"]
    assert "d01-revenue-march t0 infra_invalid: process_failed" in out["reasons"][0]
    assert not (run / "stages/propose").exists()
