"""The agent under test reads the whole ``data_dir`` at /data. Nothing that grades it may
be there: the scenario manifest holds the held-out references, and a run directory holds
a copy of it (``inputs/manifest.json``). A reviewer's agent globbed
``/data/**/inputs/manifest.json`` and answered from the reference of its own case when
``--out`` was inside ``data_dir``, and ``data_dir: .`` beside the manifest froze too.

Also here: every ``--out`` is refused inside a run directory (its receipt binds every
file in it: an export, a packet or a comparison written there made ``receipt verify``
of that run fail), and flags that ``--plan`` would ignore are refused with it."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import yaml

from runner.cycle.plan import freeze
from runner.cycle.run import CycleRunner
from runner.errors import ConfigError
from runner.outdir import refuse_inside_run, run_holding, within
from tests.fixtures.cycle_project import example_agent, project_with_agent, run_cli
from tests.fixtures.fake_sandbox import FakeSandbox

ROLES = ("analyst", "worker", "evaluator", "apply")
IMAGES = {r: "sha256:" + hashlib.sha256(r.encode()).hexdigest() for r in ROLES}


def _cycle(tmp_path: Path, **changes: object) -> Path:
    return project_with_agent(tmp_path / "project", example_agent(), **changes)


def test_a_run_directory_inside_data_dir_is_refused_at_freeze(tmp_path: Path) -> None:
    cycle = _cycle(tmp_path)
    out = cycle.parent / "data" / "run"
    with pytest.raises(ConfigError, match=r"inside data_dir .* would read the run's frozen "
                                          r"manifest") as info:
        freeze(cycle, out, images=IMAGES)
    assert info.value.field == "--out"
    assert not out.exists()
    # the same directory reached through a link is the same directory
    (tmp_path / "via").symlink_to(cycle.parent / "data")
    with pytest.raises(ConfigError, match="inside data_dir"):
        freeze(cycle, tmp_path / "via" / "run", images=IMAGES)


@pytest.mark.parametrize("field", ["scenarios", "policy"])
def test_a_frozen_input_inside_data_dir_is_refused(tmp_path: Path, field: str) -> None:
    cycle = _cycle(tmp_path)
    doc = yaml.safe_load(cycle.read_text())
    src = cycle.parent / doc[field]
    moved = cycle.parent / "data" / src.name
    shutil.copy(src, moved)
    doc[field] = str(moved)
    cycle.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=rf"{field} \(.*\) is inside data_dir") as info:
        freeze(cycle, tmp_path / "run", images=IMAGES)
    assert info.value.field == field


PLAN = '{"hashes": {}, "plan": {}, "plan_hash": "x"}'


def test_data_dir_holding_the_manifest_or_a_run_is_refused(tmp_path: Path) -> None:
    cycle = _cycle(tmp_path)
    data = cycle.parent / "data"
    manifest = cycle.parent / "manifest.json"
    os.link(manifest, data / "copy.json")  # the same file, linked
    with pytest.raises(ConfigError, match=r"copy.json: is the scenario manifest \(the same "
                                          r"file\)") as info:
        freeze(cycle, tmp_path / "run1", images=IMAGES)
    assert info.value.field == "data_dir"
    (data / "copy.json").unlink()
    shutil.copy(manifest, data / "notes.txt")  # a copy, renamed
    with pytest.raises(ConfigError, match=r"notes.txt: is a copy of the scenario manifest"):
        freeze(cycle, tmp_path / "run2", images=IMAGES)
    (data / "notes.txt").unlink()
    old = data / "old-run"
    (old / "inputs").mkdir(parents=True)
    (old / "inputs" / "manifest.json").write_text("{}")  # an older manifest's copy
    with pytest.raises(ConfigError, match=r"old-run/inputs/manifest.json: is a cyclebox "
                                          r"run's frozen manifest"):
        freeze(cycle, tmp_path / "run3", images=IMAGES)
    (old / "inputs" / "manifest.json").unlink()
    (old / "plan.json").write_text(PLAN)
    with pytest.raises(ConfigError, match=r"old-run/plan.json: is a cyclebox run's plan"):
        freeze(cycle, tmp_path / "run4", images=IMAGES)
    (old / "plan.json").write_text("{}")  # a plan.json that is not a run's: data
    freeze(cycle, tmp_path / "run5", images=IMAGES)  # the positive control


def test_the_manifest_in_the_agents_tree_or_a_policy_mount_is_refused(tmp_path: Path) -> None:
    """Two more ways the reviewer's agent read its references: the manifest committed in
    the repository mounted at /src (no project.subdir), and a role policy's mount of the
    project directory."""
    from runner import gitops

    cycle = _cycle(tmp_path)
    doc = yaml.safe_load(cycle.read_text())
    repo = Path(doc["project"]["repo"])
    shutil.copy(cycle.parent / "manifest.json", repo / "cases.json")
    gitops.init_fixed(repo, "with the manifest")
    with pytest.raises(ConfigError, match=r"holds the scenario manifest as cases.json") as info:
        freeze(cycle, tmp_path / "run1", images=IMAGES)
    assert info.value.field == "project.subdir"
    (repo / "cases.json").unlink()
    gitops.init_fixed(repo, "without")
    roles = yaml.safe_load(Path(doc["roles"]).read_text())
    roles["roles"]["analyst"]["mounts"] = [{"source": str(cycle.parent), "target": "/mnt/p"}]
    (tmp_path / "roles.yaml").write_text(yaml.safe_dump(roles))
    doc["roles"] = str(tmp_path / "roles.yaml")
    cycle.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"manifest.json: is the scenario manifest .* at "
                                          r"/mnt/p") as info:
        freeze(cycle, tmp_path / "run2", images=IMAGES)
    assert info.value.field == "roles.analyst.mounts[0].source"


def test_data_dir_changed_after_freeze_is_checked_again_when_the_plan_runs(
        tmp_path: Path) -> None:
    cycle = _cycle(tmp_path)
    freeze(cycle, tmp_path / "run", images=IMAGES)
    shutil.copy(tmp_path / "run" / "inputs" / "manifest.json",
                cycle.parent / "data" / "late.json")
    runner = CycleRunner(tmp_path / "run" / "plan.json",
                         sandbox=FakeSandbox({}, images=IMAGES.values()))
    with pytest.raises(ConfigError, match=r"late\.json: is a copy of the scenario manifest"):
        runner.run()
    assert not (tmp_path / "run" / "stages").exists()


def test_a_plan_whose_directory_is_inside_its_data_dir_is_refused_before_it_runs(
        tmp_path: Path) -> None:
    """Checked again where the plan runs (a data_dir that came to hold the run later, a
    bind mount): here the plan's data_dir is made the directory above the run."""
    cycle = _cycle(tmp_path)
    freeze(cycle, tmp_path / "run", images=IMAGES)
    runner = CycleRunner(tmp_path / "run" / "plan.json",
                         sandbox=FakeSandbox({}, images=IMAGES.values()))
    runner.plan = runner.plan.model_copy(update={"data_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="inside data_dir") as info:
        runner.run()
    assert info.value.field == "--plan"
    assert not (tmp_path / "run" / "stages").exists()


def test_within_and_run_holding(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    assert within(tmp_path / "a" / "b" / "missing", tmp_path / "a")
    assert not within(tmp_path / "ab", tmp_path / "a")
    run = tmp_path / "run"
    (run / "stages").mkdir(parents=True)
    (run / "inputs").mkdir()
    (run / "receipt.json").write_text("{}")  # a name alone decides nothing
    (run / "plan.json").write_text("{}")
    assert run_holding(run / "stages" / "x") is None
    (run / "plan.json").write_text(PLAN)
    assert run_holding(run / "stages" / "x") == run
    assert run_holding(run) is None  # an existing path is refused as taken, not as inside
    with pytest.raises(ConfigError, match=r"inside the cyclebox run .*receipt binds every "
                                          r"file"):
        refuse_inside_run(run / "stages" / "corpus")
    refuse_inside_run(tmp_path / "beside")


def test_outputs_inside_a_run_are_refused_by_every_command(tmp_path: Path) -> None:
    """``export``, ``review packet``, ``review calibrate``, ``compare``, ``freeze`` and
    ``receipt attest`` each once, through the CLI: exit 3 naming --out, nothing written."""
    run = tmp_path / "run"
    (run / "inputs").mkdir(parents=True)
    (run / "stages").mkdir()
    (run / "plan.json").write_text(PLAN)
    (run / "receipt.json").write_text("{}")
    cases = [
        ["export", "--run", str(run), "--calibration", str(tmp_path / "c.json"),
         "--out", str(run / "corpus")],
        ["freeze", str(tmp_path / "cycle.yaml"), "--out", str(run / "again")],
        ["compare", "--policy", str(tmp_path / "p.yaml"), "--baseline", str(tmp_path / "b"),
         "--candidate", str(tmp_path / "k"), "--out", str(run / "cmp")],
        ["receipt", "attest", str(run), "--key", str(tmp_path / "k.pem"),
         "--out", str(run / "stages" / "x.intoto.jsonl")],
    ]
    assert run_cli("receipt", "keygen", "--out", str(tmp_path / "k.pem")).returncode == 0
    for args in cases:
        res = run_cli(*args)
        assert res.returncode == 3, (args, res.stdout, res.stderr)
        assert "--out" in res.stderr and "inside the" in res.stderr, (args, res.stderr)
    assert sorted(p.name for p in run.iterdir()) == ["inputs", "plan.json", "receipt.json",
                                                     "stages"]
    assert not any((run / "stages").iterdir())


def test_flags_a_plan_would_ignore_are_refused_with_it(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    for extra, named in ((["--out", str(tmp_path / "o")], "--out"),
                         (["--prepare-only"], "--prepare-only"),
                         (["--replay", str(tmp_path)], "--replay"),
                         ([str(tmp_path / "cycle.yaml")], "CYCLE")):
        res = run_cli("cycle", "run", "--plan", str(plan), *extra)
        assert res.returncode == 3, (extra, res.stdout, res.stderr)
        assert f"{named} cannot be given with --plan" in res.stderr, res.stderr
    assert not (tmp_path / "o").exists()


def test_more_writers_refuse_a_path_inside_a_run(tmp_path: Path) -> None:
    """helper-45: `train proof --ledger` appended a row to a run's records, `manifest
    rehash` rewrote a run's frozen manifest, and `receipt keygen`, `init`, `sandbox exec
    --out` and an attestation bundle at another run's top level wrote files its receipt
    does not name. Each is refused, naming its field, with nothing written."""
    from runner.attest.bundle import _target
    from runner.train.host import check_ledger

    run = tmp_path / "run"
    (run / "inputs").mkdir(parents=True)
    (run / "stages").mkdir()
    (run / "plan.json").write_text(PLAN)
    (run / "receipt.json").write_text("{}")
    (run / "inputs" / "manifest.json").write_text('{"schema": 1}')
    records = run / "stages" / "records.jsonl"
    records.write_text("")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    with pytest.raises(ConfigError, match="inside the cyclebox run") as exc:
        check_ledger(records)
    assert exc.value.field == "--ledger"
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ConfigError, match="in a run directory would be a file") as exc:
        _target(other, run / "x.jsonl")
    assert _target(other, run / "x.intoto.jsonl") == run / "x.intoto.jsonl"
    cases = [
        (["receipt", "keygen", "--out", str(run / "k")], "--out"),
        (["init", str(run / "proj")], "DIR"),
        (["manifest", "rehash", str(run / "inputs" / "manifest.json"), "--data",
          str(tmp_path)], "MANIFEST"),
        (["sandbox", "exec", "--role", "analyst", "--out", str(run / "sbx"), "--", "true"],
         "--out"),
    ]
    for args, field in cases:
        res = run_cli(*args)
        assert res.returncode == 3, (args, res.stdout, res.stderr)
        assert field in res.stderr and "inside the cyclebox run" in res.stderr, (args,
                                                                                 res.stderr)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    assert records.read_text() == "" and (run / "inputs" / "manifest.json").read_text() == \
        '{"schema": 1}'


def test_gateway_calls_without_a_receipt_says_it_is_not_verified(tmp_path: Path) -> None:
    """helper-47 #6: a run without a receipt (in progress, or its receipt gone) listed
    its calls as if they were what the run made; it says so now, and --json has
    verified: false."""
    import json

    run = tmp_path / "run"
    (run / "gateway").mkdir(parents=True)
    (run / "plan.json").write_text("{}")
    (run / "gateway" / "calls.jsonl").write_text(json.dumps({
        "seq": 0, "ts": "2026-12-07T20:34:46.507+00:00", "run_id": "r", "role": "analyst",
        "upstream": "target", "stage": "baseline", "case": "c1", "trial": 0, "turn": 0,
        "provider": "scripted", "model": "fixture-target", "fixture": True, "stream": False,
        "api": "chat", "status": "ok", "http_status": 200, "latency_s": 0.001,
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        "cost_usd": 0.0, "cost_basis": "measured", "request_sha256": "3" * 64}) + "\n")
    res = run_cli("gateway", "calls", str(run))
    assert res.returncode == 0 and "not verified: the run has no receipt" in res.stdout, res
    res = run_cli("gateway", "calls", str(run), "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["verified"] is False, res
