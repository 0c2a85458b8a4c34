"""Project checks before anything is written, upstreams in one place, honest stage reasons
and plain output (issue 12: items 4, 5, 6, 10 and the friction list). One behaviour per
test; no Docker."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.cycle.brief import build_brief, failing_development, nothing_to_brief
from runner.cycle.config import GIT_INIT, check_repo, uncommitted_warning
from runner.cycle.manifest import reference_hash
from runner.cycle.models import SPLITS, Grades, Identities, Record, Scenario
from runner.cycle.plan import check_cycle, freeze
from runner.cycle.run import stderr_tail
from runner.errors import ConfigError, PrerequisiteError
from runner.gateway.config import load_upstreams
from runner.isolation.policy import load_policies
from runner.paths import PROJECT_ROOT, default_upstreams

EXAMPLE = PROJECT_ROOT / "examples" / "shop-analyst"
ROLES = PROJECT_ROOT / "policies" / "roles.yaml"
FAKE = {r: "sha256:" + "0" * 64 for r in ("analyst", "worker", "evaluator", "apply")}
UNSET_KEY = "CYCLEBOX_TEST_JUDGE_KEY_NEVER_SET"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                    *args], check=True, capture_output=True)


def _repo(path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    _git(path, "init", "-q")
    _git(path, "add", "-A")
    _git(path, "commit", "-qm", "init")
    return path


def _cycle(tmp_path: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """The example's cycle with absolute paths (its project stays this checkout)."""
    doc = yaml.safe_load((EXAMPLE / "cycle.yaml").read_text())
    doc["project"]["repo"] = str(PROJECT_ROOT)
    doc["roles"] = str(ROLES)
    for key in ("scenarios", "policy", "data_dir"):
        doc[key] = str(EXAMPLE / doc[key])
    for up in doc["upstreams"].values():
        up["script"] = str((EXAMPLE / up["script"]).resolve())
    if edit:
        edit(doc)
    (tmp_path / "cycle.yaml").write_text(yaml.safe_dump(doc))
    return tmp_path / "cycle.yaml"


def _openai_judge(doc: dict[str, Any]) -> None:
    doc["upstreams"]["judge"] = {"provider": "openai", "base_url": "https://judge.invalid/v1",
                                 "credential": {"env": UNSET_KEY}, "models": ["fixture-judge"]}


# -- 4. upstreams in one place ------------------------------------------------------------------
def test_roles_file_defines_no_upstream_and_says_where_they_went(tmp_path: Path) -> None:
    doc = yaml.safe_load(ROLES.read_text())
    doc["upstreams"] = {"target": {"provider": "scripted", "script": "x.yaml", "models": ["m"]}}
    (tmp_path / "roles.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as exc:
        load_policies(tmp_path / "roles.yaml")
    assert exc.value.field == "upstreams"
    assert "cycle file" in str(exc.value) and exc.value.fix and "cycle.yaml" in exc.value.fix


def test_a_copied_roles_file_loads_without_anything_beside_it(tmp_path: Path) -> None:
    shutil.copy(ROLES, tmp_path / "roles.yaml")  # no scripts/ directory next to it
    pols = load_policies(tmp_path / "roles.yaml")
    assert pols.roles["analyst"].upstream == "target"


def test_sandbox_exec_upstreams_file_loads_with_scripts_resolved() -> None:
    ups = load_upstreams(default_upstreams())
    assert set(ups) == {"target", "optimizer", "judge"}
    assert all(Path(u.script or "").is_absolute() and Path(u.script or "").is_file()
               for u in ups.values())


def test_the_judge_key_is_not_read_when_no_judge_is_configured(tmp_path: Path) -> None:
    os.environ.pop(UNSET_KEY, None)
    c = check_cycle(_cycle(tmp_path, _openai_judge))
    assert set(c.upstreams) == {"target", "optimizer"}
    assert c.roles["evaluator"].upstream is None  # no gateway socket in the evaluator
    assert c.roles["analyst"].upstream == "target"


def test_the_judge_key_is_required_once_a_judge_is_configured(tmp_path: Path) -> None:
    os.environ.pop(UNSET_KEY, None)

    def edit(doc: dict[str, Any]) -> None:
        _openai_judge(doc)
        doc["judge"] = {"model": "fixture-judge", "threshold": 0.5, "required": False}

    with pytest.raises(PrerequisiteError, match=UNSET_KEY):
        check_cycle(_cycle(tmp_path, edit))


def test_a_used_upstream_must_be_defined_in_the_cycle_file(tmp_path: Path) -> None:
    def edit(doc: dict[str, Any]) -> None:
        del doc["upstreams"]["judge"]
        doc["judge"] = {"model": "fixture-judge", "threshold": 0.5, "required": False}

    with pytest.raises(ConfigError) as exc:
        check_cycle(_cycle(tmp_path, edit))
    assert exc.value.field == "upstreams.judge" and "remove judge:" in (exc.value.fix or "")


def test_an_unused_upstream_may_be_left_out(tmp_path: Path) -> None:
    c = check_cycle(_cycle(tmp_path, lambda d: d["upstreams"].pop("judge")))
    assert set(c.upstreams) == {"target", "optimizer"}


def test_a_judge_needs_an_evaluator_that_may_reach_it(tmp_path: Path) -> None:
    doc = yaml.safe_load(ROLES.read_text())
    doc["roles"]["evaluator"].pop("upstream")
    (tmp_path / "roles.yaml").write_text(yaml.safe_dump(doc))

    def edit(d: dict[str, Any]) -> None:
        d["roles"] = str(tmp_path / "roles.yaml")
        d["judge"] = {"model": "fixture-judge", "threshold": 0.5, "required": False}

    with pytest.raises(ConfigError) as exc:
        check_cycle(_cycle(tmp_path, edit))
    assert exc.value.field == "judge" and "roles.evaluator.upstream" in (exc.value.fix or "")


def test_an_empty_script_path_is_refused_by_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        check_cycle(_cycle(tmp_path, lambda d: d["upstreams"]["target"].update(script="")))
    assert exc.value.field == "upstreams.target.script"


def test_frozen_plan_has_only_the_used_upstreams(tmp_path: Path) -> None:
    plan, _ = freeze(_cycle(tmp_path), tmp_path / "run", images=FAKE)
    assert set(plan.upstreams) == {"target", "optimizer"}
    assert plan.roles["evaluator"].upstream is None


# -- 5. project checks ------------------------------------------------------------------------
def test_a_plain_directory_gets_the_git_init_fix(tmp_path: Path) -> None:
    (tmp_path / "proj").mkdir()
    with pytest.raises(ConfigError) as exc:
        check_repo(tmp_path / "proj", "HEAD", None, path="cycle.yaml")
    assert "not a git repository" in str(exc.value)
    assert GIT_INIT in str(exc.value) and "git commit -m init" in GIT_INIT


def test_a_directory_inside_another_repository_is_not_taken_for_its_root(
        tmp_path: Path) -> None:
    outer = _repo(tmp_path / "outer", {"proj/agent.py": "x\n", "other.txt": "y\n"})
    with pytest.raises(ConfigError) as exc:
        check_repo(outer / "proj", "HEAD", None, path="cycle.yaml")
    assert exc.value.field == "project.repo" and "not the root" in str(exc.value)
    assert f"repo: {outer}" in (exc.value.fix or "") and "subdir: proj" in (exc.value.fix or "")


def test_uncommitted_changes_under_the_subdir_are_named(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "r", {"proj/agent.py": "x\n", "outside.txt": "y\n"})
    assert uncommitted_warning(repo, "HEAD", "proj", path="c.yaml") is None
    (repo / "proj/agent.py").write_text("edited\n")
    (repo / "proj/new.md").write_text("new\n")
    (repo / "outside.txt").write_text("not under the subdir\n")
    w = uncommitted_warning(repo, "HEAD", "proj", path="c.yaml")
    assert w is not None
    assert "2 uncommitted change(s)" in w and "not part of the run" in w
    assert "proj/agent.py (modified)" in w and "proj/new.md (untracked)" in w
    assert "outside.txt" not in w and "git add -A && git commit" in w


def test_uncommitted_check_writes_nothing_into_the_repository(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "r", {"a.txt": "x\n"})
    (repo / "a.txt").write_text("edited\n")
    index = (repo / ".git" / "index").read_bytes()
    os.utime(repo / "a.txt", (1, 1))  # a stat change git status would otherwise record
    assert uncommitted_warning(repo, "HEAD", None, path=None) is not None
    assert (repo / ".git" / "index").read_bytes() == index


def test_freeze_passes_the_warning_on_before_writing(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "r", {f"p/{p}": (EXAMPLE / "project" / p).read_text()
                                  for p in ("agent.py", "prompts/system.md", "skills/sql.md")})
    (repo / "p/prompts/system.md").write_text("uncommitted edit\n")

    def edit(doc: dict[str, Any]) -> None:
        doc["project"].update(repo=str(repo), subdir="p")

    got: list[str] = []
    freeze(_cycle(tmp_path, edit), tmp_path / "run", images=FAKE, warn=got.append)
    assert len(got) == 1 and "p/prompts/system.md (modified)" in got[0]


def test_a_split_outside_the_set_is_refused_naming_the_set() -> None:
    base = {"id": "c1", "input": {}, "reference": {"kind": "refuse"}, "store": "s"}
    with pytest.raises(ValueError, match=", ".join(SPLITS)):
        Scenario.model_validate({**base, "split": "dev"})


def _manifest_without_development(tmp_path: Path) -> Path:
    m = json.loads((EXAMPLE / "manifest.json").read_text())
    m["scenarios"] = [s for s in m["scenarios"] if s["split"] != "development"]
    m["split"] = "acceptance"
    m["reference_hash"] = reference_hash(
        tuple(Scenario.model_validate(s) for s in m["scenarios"]))
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    pol = yaml.safe_load((EXAMPLE / "policy.yaml").read_text())
    pol["cases"] = [s["id"] for s in m["scenarios"]]
    pol["mandatory"] = [c for c in pol["mandatory"] if c in pol["cases"]]
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(pol))
    return tmp_path / "manifest.json"


def test_a_generated_brief_needs_development_cases(tmp_path: Path) -> None:
    man = _manifest_without_development(tmp_path)
    with pytest.raises(ConfigError) as exc:
        check_cycle(_cycle(tmp_path, lambda d: d.update(
            scenarios=str(man), policy=str(tmp_path / "policy.yaml"))))
    assert "no scenario has split 'development'" in str(exc.value)
    assert exc.value.path and exc.value.path.endswith("manifest.json")
    assert "brief: {mode: file" in (exc.value.fix or "")


def test_a_fixed_brief_runs_without_development_cases(tmp_path: Path) -> None:
    man = _manifest_without_development(tmp_path)
    (tmp_path / "brief.md").write_text("Refuse destructive SQL.\n")
    check_cycle(_cycle(tmp_path, lambda d: d.update(
        scenarios=str(man), policy=str(tmp_path / "policy.yaml"),
        brief={"mode": "file", "file": str(tmp_path / "brief.md")})))


# -- 6. honest stage outcomes -----------------------------------------------------------------
IDS = Identities(data_hash="d", reference_hash="r", scorer="s")


def _scenarios() -> dict[str, Scenario]:
    ref = {"kind": "text", "value": "x"}
    return {i: Scenario.model_validate({"id": i, "split": split, "input": {"question": "q"},
                                        "reference": ref, "store": "s"})
            for i, split in (("d1", "development"), ("d2", "development"),
                             ("a1", "acceptance"))}


def _rec(case: str, passed: bool | None, status: str = "ok", reason: str | None = None,
         split: str = "development") -> Record:
    grades = Grades(correctness=passed) if status == "ok" else None
    return Record(case_id=case, trial=0, split=split, status=status,  # type: ignore[arg-type]
                  reason=reason, answer={"answer": "y"} if status == "ok" else None,
                  grades=grades, identities=IDS)


def test_nothing_to_improve_when_every_development_run_passed() -> None:
    recs = [_rec("d1", True), _rec("d2", True), _rec("a1", False, split="acceptance")]
    assert failing_development(recs, _scenarios()) == []  # an acceptance failure never counts
    reason = nothing_to_brief(recs, _scenarios())
    assert reason.startswith("nothing_to_improve: all 2 development run(s) passed")
    assert "the worker was not called" in reason


def test_no_failure_to_brief_names_the_first_case_that_did_not_complete() -> None:
    recs = [_rec("d1", True), _rec("d2", None, status="infra_invalid",
                                   reason="process_failed: exit code 1 (stderr: x.stderr, "
                                          "ends: boom)")]
    reason = nothing_to_brief(recs, _scenarios())
    assert reason.startswith("no_failure_to_brief:") and "1 of 2 did not complete" in reason
    assert "d2 t0 infra_invalid: process_failed: exit code 1 (stderr: x.stderr" in reason


def test_the_brief_quotes_exactly_the_failing_development_runs() -> None:
    recs = [_rec("d1", False), _rec("d2", True), _rec("a1", False, split="acceptance")]
    assert [r.case_id for r in failing_development(recs, _scenarios())] == ["d1"]
    brief = build_brief(recs, _scenarios())
    assert "## d1 (trial 0)" in brief and "## d2" not in brief and "a1" not in brief


def test_stderr_tail_is_the_last_lines_on_one_line_and_bounded() -> None:
    text = "noise\n" * 50 + "Traceback (most recent call last):\n  File x\n\nValueError: bad\n"
    assert stderr_tail(text) == "Traceback (most recent call last): / File x / ValueError: bad"
    assert stderr_tail("") == ""
    long = stderr_tail("x" * 5000 + "END")
    assert len(long) <= 240 and long.endswith("END") and long.startswith("...")
    assert "\x1b" not in stderr_tail("\x1b[31mred\x1b[0m\n")


# -- 10. plain output -------------------------------------------------------------------------
def _print_table(monkeypatch: pytest.MonkeyPatch, columns: str | None) -> str:
    from rich.table import Table

    from runner.cli.output import PlainConsole

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    buf = io.StringIO()
    console = PlainConsole(file=buf)
    t = Table(show_header=False)
    t.add_column("k")
    t.add_column("v", overflow="fold")
    t.add_row("reason", "r" * 300 + " END")
    console.print(t)
    return buf.getvalue()


def test_plain_output_is_not_cut_at_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _print_table(monkeypatch, None)
    assert "r" * 300 + " END" in text  # one line, not folded


def test_columns_still_wins_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _print_table(monkeypatch, "60")
    assert max(len(line) for line in text.splitlines()) <= 60


def test_unknown_and_fixture_costs_are_named() -> None:
    from runner.report.model import RoleCost
    from runner.report.render import cost_text, fixture_text

    unknown = RoleCost(role="analyst", calls=2, ok=2, refused=0, infra_error=0, tokens=5,
                       cost_usd=None, cost_usd_known_part=0.5, complete=False, fixture_calls=2)
    assert cost_text(unknown).startswith("unknown (known part 0.5 USD)")
    assert "None" not in cost_text(unknown)
    assert "fixture" in fixture_text(unknown) and "not billed" in fixture_text(unknown)
    some = unknown.model_copy(update={"fixture_calls": 1})
    assert fixture_text(some).startswith(", 1 of 2 calls fixture")
    assert fixture_text(unknown.model_copy(update={"fixture_calls": 0})) == ""


# -- friction ---------------------------------------------------------------------------------
def test_keygen_into_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    from runner.cycle.signing import keygen

    with pytest.raises(ConfigError) as exc:
        keygen(tmp_path / "keys" / "k.pem")
    assert "does not exist" in str(exc.value) and "mkdir -p" in (exc.value.fix or "")
    assert not (tmp_path / "keys").exists()


def test_keygen_writes_a_private_key_0600_and_never_overwrites(tmp_path: Path) -> None:
    from runner.cycle.signing import keygen

    pub = keygen(tmp_path / "k.pem")
    assert pub == tmp_path / "k.pem.pub" and pub.is_file()
    assert (tmp_path / "k.pem").stat().st_mode & 0o777 == 0o600
    with pytest.raises(ConfigError, match="never overwritten"):
        keygen(tmp_path / "k.pem")


def test_keygen_never_writes_through_a_symlink(tmp_path: Path) -> None:
    from runner.cycle.signing import keygen

    (tmp_path / "k.pem").symlink_to(tmp_path / "elsewhere.pem")
    with pytest.raises(ConfigError, match="never overwritten"):
        keygen(tmp_path / "k.pem")
    assert not (tmp_path / "elsewhere.pem").exists()


def test_an_unstarted_run_directory_is_discarded_a_started_one_kept(tmp_path: Path) -> None:
    from runner.cli.cycle import _discard_unstarted

    fresh = tmp_path / "fresh"
    (fresh / "inputs").mkdir(parents=True)
    (fresh / "stages").mkdir()
    (fresh / "plan.json").write_text("{}")
    _discard_unstarted(fresh)
    assert not fresh.exists()
    started = tmp_path / "started"
    (started / "stages" / "baseline").mkdir(parents=True)
    _discard_unstarted(started)
    assert (started / "stages" / "baseline").is_dir()
