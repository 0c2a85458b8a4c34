"""`cyclebox init`: the scaffold is complete, consistent and refuses to overwrite; its
scripted models turn the baseline's development failures into a passing candidate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from runner import gitops
from runner.cycle.brief import build_brief
from runner.cycle.config import load_cycle
from runner.cycle.models import Grades, Identities, Record
from runner.cycle.plan import check_cycle
from runner.cycle.scoring import evaluator_scoring, resolved_reference
from runner.errors import ConfigError
from runner.gateway.providers import load_script
from runner.paths import default_policies
from runner.project import manifest_tools as mt
from runner.project.init import scaffold
from sandbox import evaluator, worker
from sandbox.proposal import check_changes, parse_reply


@pytest.fixture
def project(tmp_path: Path) -> Path:
    dest = tmp_path / "Team Handbook!"
    made = scaffold(dest)
    assert made.name == "Team-Handbook"
    return dest


def test_the_scaffold_holds_every_part_of_a_project(project: Path) -> None:
    for rel in ("cycle.yaml", "policy.yaml", "scenarios.yaml", "manifest.json", ".gitignore",
                "README.md", "project/agent.py", "project/prompts/system.md",
                "project/skills/answering.md", "data/facts.json", "scripts/target.yaml",
                "scripts/optimizer.yaml"):
        assert (project / rel).is_file(), rel
    assert "__NAME__" not in (project / "cycle.yaml").read_text()
    assert not list(project.rglob("__pycache__"))
    m = mt.check(project / "manifest.json", project / "data")
    assert {s.split for s in m.scenarios} == {"development", "acceptance"}
    assert m.dataset == "Team-Handbook"


def test_the_cycle_file_checks_out_once_committed_and_uses_the_shipped_roles(
        project: Path) -> None:
    cycle, _ = load_cycle(project / "cycle.yaml")
    assert cycle.roles is None
    raw = (project / "cycle.yaml").read_text()
    assert "/work" not in raw and "policies/" not in raw  # nothing points into cyclebox
    with pytest.raises(ConfigError, match="git init"):
        check_cycle(project / "cycle.yaml")
    gitops.init_fixed(project, "base")
    checked = check_cycle(project / "cycle.yaml")
    assert checked.inputs.roles == default_policies()
    # only the upstreams a role of this cycle uses; no judge is configured
    assert set(checked.upstreams) == {"target", "optimizer"}
    assert set(checked.policy.cases) == {s.id for s in checked.manifest.scenarios}


def _reply(rules_path: Path, *, role: str, model: str, text: str, last_user: str) -> str:
    rules, default = load_script(rules_path)
    reply = next((r.reply for r in rules if r.matches(role, model, text, last_user)), default)
    assert reply is not None
    return reply


def _records(project: Path, system: str) -> list[Record]:
    """Each case graded as if the agent's system prompt were ``system`` (the agent's
    message shape, the scripted target and the real scorer)."""
    m = mt.check(project / "manifest.json", project / "data")
    ids = Identities(data_hash=m.data_hash, reference_hash=m.reference_hash, scorer="s")
    out = []
    for s in m.scenarios:
        question = str(s.input["question"])
        reply = _reply(project / "scripts/target.yaml", role="analyst", model="fixture-target",
                       text=f"{system}\n{question}", last_user=question)
        parsed = json.loads(reply)
        answer = ({"refused": True, "answer": None, "evidence": []} if "refuse" in parsed else
                  {"refused": False, "answer": parsed["answer"], "evidence": parsed["evidence"]})
        grades = evaluator.score(answer, resolved_reference(s.reference, m),
                                 evaluator_scoring(m))
        out.append(Record(case_id=s.id, trial=0, split=s.split, status="ok", answer=answer,
                          grades=Grades.model_validate(grades), identities=ids))
    return out


def _passed(records: list[Record]) -> dict[str, bool]:
    return {r.case_id: r.grades is not None and r.grades.passed() for r in records}


def test_the_scripted_optimizer_fixes_what_the_baseline_fails(project: Path) -> None:
    prompt_dir = project / "project"
    base_system = "\n\n".join([(prompt_dir / "prompts/system.md").read_text(),
                               (prompt_dir / "skills/answering.md").read_text()])
    baseline = _records(project, base_system)
    before = _passed(baseline)
    assert not all(before.values())
    m = mt.check(project / "manifest.json", project / "data")
    brief = build_brief(baseline, {s.id: s for s in m.scenarios})  # the real brief
    assert "d01-leave-days" in brief and "a01" not in brief
    cycle = yaml.safe_load((project / "cycle.yaml").read_text())
    req = {"brief": brief, "paths": cycle["edit"]["paths"], "files": [
        {"path": p, "content": (prompt_dir / p).read_text(), "sha256": None}
        for p in cycle["edit"]["paths"]]}
    reply = _reply(project / "scripts/optimizer.yaml", role="worker", model="fixture-optimizer",
                   text=f"{worker.SYSTEM}\n{worker.prompt(req)}", last_user=worker.prompt(req))
    changes, _ = parse_reply(reply)
    check_changes(changes, paths=set(cycle["edit"]["paths"]),
                  allowlist=cycle["edit"]["allowlist"])
    new = {c.path: c.content for c in changes}
    cand_system = "\n\n".join([new.get("prompts/system.md",
                                       (prompt_dir / "prompts/system.md").read_text()),
                               new.get("skills/answering.md",
                                       (prompt_dir / "skills/answering.md").read_text())])
    after = _passed(_records(project, cand_system))
    assert all(after.values()), after
    policy = yaml.safe_load((project / "policy.yaml").read_text())
    assert all(after[c] for c in policy["mandatory"]) and all(before[c] for c in
                                                              policy["mandatory"])


def test_init_refuses_a_directory_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError) as exc:
        scaffold(tmp_path / "taken")
    assert "not empty" in str(exc.value) and "Fix:" in str(exc.value)
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        scaffold(tmp_path / "file")


def test_init_fills_an_empty_directory_and_takes_a_name(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    made = scaffold(tmp_path / "empty", name="unit-convert")
    assert "name: unit-convert" in (tmp_path / "empty" / "cycle.yaml").read_text()
    assert "manifest.json" in made.files
    with pytest.raises(ConfigError, match="--name"):
        scaffold(tmp_path / "other", name="bad name")
    assert not (tmp_path / "other").exists()


def test_a_failure_part_way_leaves_nothing_behind(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: object, **_k: object) -> None:
        raise ConfigError("simulated")

    monkeypatch.setattr(mt, "build", boom)
    with pytest.raises(ConfigError, match="simulated"):
        scaffold(tmp_path / "new")
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="simulated"):
        scaffold(tmp_path / "empty")
    assert list((tmp_path / "empty").iterdir()) == []


@pytest.mark.parametrize("name", ["demo\n", "demo\nschema: 2"])
def test_a_name_with_a_newline_is_refused(tmp_path: Path, name: str) -> None:
    """``$`` matches before a trailing newline: ``demo\\n`` passed the name check and was
    written into the template's YAML."""
    with pytest.raises(ConfigError, match="--name"):
        scaffold(tmp_path / "p", name=name)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("clash", [False, True])
def test_a_dir_with_dotdot_never_writes_into_or_empties_an_existing_directory(
        tmp_path: Path, clash: bool) -> None:
    """An attack review: ``init X/new/..`` passed the absent-or-empty check (the path
    did not exist while ``new`` was missing), wrote the template into the non-empty X,
    and on a clash with one of X's files its rollback removed X's own files too."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("mine\n")
    if clash:
        (victim / "README.md").write_text("also mine\n")
    before = sorted(p.name for p in victim.iterdir())
    with pytest.raises(ConfigError, match=r"'\.\.' part"):
        scaffold(victim / "new" / "..")
    assert sorted(p.name for p in victim.iterdir()) == before
    assert (victim / "precious.txt").read_text() == "mine\n"


def test_a_failed_init_into_an_existing_empty_directory_leaves_the_directory(
        tmp_path: Path) -> None:
    """Only what the call wrote is undone: a directory it did not make stays."""
    dest = tmp_path / "empty"
    dest.mkdir()
    from runner.project import init as init_mod

    def boom(*_a: object, **_k: object) -> None:
        raise OSError(28, "No space left on device")

    import unittest.mock as um
    with um.patch.object(init_mod.manifest_tools, "build", boom), \
            pytest.raises(OSError):
        scaffold(dest)
    assert dest.is_dir() and list(dest.iterdir()) == []



def test_a_dir_under_a_loop_of_links_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(ConfigError, match="cannot be used"):
        scaffold(tmp_path / "loop" / "new")
