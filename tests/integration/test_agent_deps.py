"""A project's own requirements (project.requirements): freezing derives an analyst image
offline with them, reuses it while nothing changed, freezes its id in the plan, and the
agent imports the package in a real cycle. Uses a small pure-Python wheel from PyPI
(humanize), downloaded on the host once."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.errors import ConfigError
from tests.fixtures.cycle_project import cli_env, example_agent, project_with_agent, run_cli

REQUIREMENT = "humanize==4.12.3"
AGENT_PRELUDE = '''
import humanize  # the project's own dependency, from requirements.txt

Path("/out/deps.txt").write_text(humanize.intcomma(1234567))
'''
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}


def _agent() -> str:
    anchor = "from openai import OpenAI\n"
    src = example_agent()
    assert anchor in src
    return src.replace(anchor, anchor + AGENT_PRELUDE, 1)


def project(dest: Path, requirements: str | None = REQUIREMENT + "\n",
            **project_changes: Any) -> Path:
    """The example with an agent that imports humanize, its requirements.txt committed
    and named by project.requirements; returns the cycle file."""
    cycle = project_with_agent(dest, _agent())
    repo = dest / "repo"
    if requirements is not None:
        (repo / "requirements.txt").write_text(requirements)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")} | GIT_ENV
        for args in (["add", "-A"], ["commit", "-q", "-m", "requirements"]):
            subprocess.run(["git", "-C", str(repo), *args], check=True, env=env,
                           capture_output=True)
    cyc = yaml.safe_load(cycle.read_text())
    cyc["project"]["requirements"] = "requirements.txt"
    cyc["project"].update(project_changes)
    cycle.write_text(yaml.safe_dump(cyc))
    return cycle


def _freeze(cycle: Path, out: Path) -> tuple[dict[str, Any], list[str]]:
    from runner.cycle.plan import CYCLE_ROLES, freeze
    from runner.isolation.docker.agent_image import ensure_agent_image
    from runner.isolation.docker.images import resolve_image

    lines: list[str] = []
    freeze(cycle, out, images=lambda: {r: resolve_image(r) for r in CYCLE_ROLES},
           check_credentials=False,
           derive_analyst=lambda a, req: ensure_agent_image(a, req, lines.append).derived())
    return json.loads((out / "plan.json").read_text())["plan"], lines


# -- no Docker: the checks freeze makes --------------------------------------------------

def test_requirements_must_be_committed_plain_and_outside_the_allowlist(
        tmp_path: Path) -> None:
    from runner.cycle.plan import check_cycle

    cycle = project(tmp_path / "missing", requirements=None)
    with pytest.raises(ConfigError, match=r"project\.requirements: requirements\.txt is not "
                                          r"a file in the base tree"):
        check_cycle(cycle, check_credentials=False)
    cycle = project(tmp_path / "option", requirements="--index-url https://x.invalid/\n")
    with pytest.raises(ConfigError, match=r"project\.requirements: requirements\.txt line 1"):
        check_cycle(cycle, check_credentials=False)
    cycle = project(tmp_path / "edited")
    cyc = yaml.safe_load(cycle.read_text())
    cyc["edit"]["allowlist"] = [*cyc["edit"]["allowlist"], "*.txt"]
    cycle.write_text(yaml.safe_dump(cyc))
    with pytest.raises(ConfigError, match=r"project\.requirements: requirements\.txt matches "
                                          r"edit\.allowlist"):
        check_cycle(cycle, check_credentials=False)
    cycle = project(tmp_path / "dotdot", requirements=None)
    cyc = yaml.safe_load(cycle.read_text())
    cyc["project"]["requirements"] = "../outside.txt"
    cycle.write_text(yaml.safe_dump(cyc))
    with pytest.raises(ConfigError, match=r"project\.requirements: .*escapes"):
        check_cycle(cycle, check_credentials=False)


def test_unpinned_requirement_lines_warn_by_name(tmp_path: Path) -> None:
    from runner.cycle.plan import check_cycle

    checked = check_cycle(project(tmp_path / "loose", requirements="humanize>=4\n"),
                          check_credentials=False)
    assert any("project.requirements" in w and "'humanize>=4'" in w and "pin no version" in w
               for w in checked.warnings), checked.warnings
    pinned = check_cycle(project(tmp_path / "pinned"), check_credentials=False)
    assert not [w for w in pinned.warnings if "pin no version" in w]


# -- Docker -------------------------------------------------------------------------------

@pytest.mark.docker
def test_freeze_derives_the_analyst_image_and_reuses_it(tmp_path: Path) -> None:
    from runner.isolation.docker.backend import DockerSandbox
    from runner.isolation.docker.images import resolve_image

    cycle = project(tmp_path / "p")
    plan, _ = _freeze(cycle, tmp_path / "one")
    analyst = plan["images"]["analyst"]
    assert analyst != resolve_image("analyst")
    assert {r: i for r, i in plan["images"].items() if r != "analyst"} == {
        r: resolve_image(r) for r in ("worker", "evaluator", "apply")}
    labels = DockerSandbox().client.api.inspect_image(analyst)["Config"]["Labels"]
    assert labels["io.cyclebox.base"] == resolve_image("analyst")
    assert labels["io.cyclebox.role"] == "analyst"
    assert (tmp_path / "one" / "inputs" / "agent-requirements.txt").read_text() == (
        REQUIREMENT + "\n")
    assert "agent-requirements.txt" in plan["inputs"]
    assert plan["project"]["spec"]["requirements"] == "requirements.txt"
    # the wheel it was built from, bound like every input (issue 24's provenance)
    listed = tmp_path / "one" / "inputs" / "agent-artifacts.json"
    assert plan["inputs"]["agent-artifacts.json"] == hashlib.sha256(
        listed.read_bytes()).hexdigest()
    arts = json.loads(listed.read_bytes())["artifacts"]
    assert [(a["ecosystem"], a["name"], a["version"]) for a in arts] == [
        ("pypi", "humanize", "4.12.3")]
    assert arts[0]["sha256"] == _wheel_sha256(arts[0]["filename"])
    # unchanged inputs: the same image, nothing downloaded or built, the same list
    again, lines = _freeze(cycle, tmp_path / "two")
    assert again["images"]["analyst"] == analyst
    assert not [ln for ln in lines if "downloading" in ln or "building" in ln], lines
    assert (tmp_path / "two" / "inputs" / "agent-artifacts.json").read_bytes() == (
        listed.read_bytes())


def _wheel_sha256(filename: str) -> str:
    """The wheel's sha256, hashed here from the agent wheel cache the freeze filled."""
    from runner.paths import state_dir

    found = sorted((state_dir() / "wheels" / "agent").glob(f"*/{filename}"))
    assert found, filename
    return hashlib.sha256(found[0].read_bytes()).hexdigest()


@pytest.mark.docker
def test_the_derived_image_is_the_hardened_analyst_plus_the_package(tmp_path: Path) -> None:
    from runner.isolation.docker.agent_image import ensure_agent_image
    from runner.isolation.docker.backend import DockerSandbox
    from runner.isolation.docker.images import resolve_image
    from runner.isolation.policy import load_policies
    from runner.isolation.roles import role_spec
    from runner.isolation.sandbox import StopReason
    from runner.paths import default_policies

    agent = ensure_agent_image(resolve_image("analyst"), REQUIREMENT + "\n", print)
    policy = load_policies(default_policies()).roles["analyst"]
    code = ("import json, humanize, openai, sandbox.probe as p\n"
            "f = p.facts('analyst', ['127.0.0.1:9'])\n"
            "f['intcomma'] = humanize.intcomma(1234567); f['openai'] = openai.__version__\n"
            "print(json.dumps(f))")
    spec = role_spec(policy, role="analyst", run_id="test-agent-deps", image=agent.id,
                     command=["python", "-c", code])
    rec = DockerSandbox().run(spec)
    assert rec.stop_reason is StopReason.OK, rec.stderr_tail
    facts = json.loads(rec.stdout_tail)
    assert facts["intcomma"] == "1,234,567"
    # the analyst's own pins are untouched (images/analyst/requirements.txt)
    assert facts["openai"] == "3.63.0"
    assert facts["interfaces"] == ["lo"] and facts["uid"] != 0


@pytest.mark.docker
def test_a_requirement_that_would_move_the_analysts_packages_is_refused(
        tmp_path: Path) -> None:
    from runner.isolation.docker.agent_image import ensure_agent_image
    from runner.isolation.docker.images import resolve_image

    with pytest.raises(ConfigError, match=r"project\.requirements: the agent's requirements "
                                          r"do not install offline"):
        ensure_agent_image(resolve_image("analyst"), "typing_extensions==4.0.0\n", print)


@pytest.mark.docker
@pytest.mark.slow
def test_the_agent_imports_its_dependency_in_a_cycle(tmp_path: Path) -> None:
    cycle = project(tmp_path / "p")
    run = tmp_path / "run"
    res = run_cli("cycle", "run", str(cycle), "--out", str(run), "--json",
                  env=cli_env(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    marks = sorted((run / "stages").rglob("deps.txt"))
    assert marks, "no analyst case ran the agent"
    assert {m.read_text() for m in marks} == {"1,234,567"}
    plan = json.loads((run / "plan.json").read_text())["plan"]
    rows = [json.loads(ln) for ln in (run / "containers.jsonl").read_text().splitlines()]
    analyst = [r for r in rows if r["role"] == "analyst"]
    assert analyst and {r["image_id"] for r in analyst} == {plan["images"]["analyst"]}
    # the run's SLSA provenance lists the wheel by sha256 and package URL (issue 24)
    key = tmp_path / "key"
    assert run_cli("receipt", "keygen", "--out", str(key), env=cli_env(tmp_path)
                   ).returncode == 0
    bundle = tmp_path / "b.intoto.jsonl"
    res = run_cli("receipt", "attest", str(run), "--key", str(key), "--out", str(bundle),
                  env=cli_env(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    statements = [json.loads(base64.b64decode(json.loads(ln)["payload"]))
                  for ln in bundle.read_text().splitlines()]
    prov = next(s for s in statements if s["predicateType"].startswith("https://slsa.dev"))
    deps = prov["predicate"]["buildDefinition"]["resolvedDependencies"]
    wheel = [d for d in deps if d.get("uri") == "pkg:pypi/humanize@4.12.3"]
    assert wheel == [{"name": wheel[0]["name"], "uri": "pkg:pypi/humanize@4.12.3",
                      "digest": {"sha256": _wheel_sha256(wheel[0]["name"])},
                      "annotations": {"kind": "pypi-artifact"}}], deps


@pytest.mark.docker
def test_derived_images_are_listed_and_gc_removes_only_unused_ones(tmp_path: Path) -> None:
    """Issue 20 item 6: derived analyst images did not appear in `images list`, and
    nothing removed them. Uses a tiny image of its own (labelled as a derived image of
    this test's state directory); other derived images in the shared engine belong to
    another state directory and are kept."""
    import secrets
    import sys

    from runner.isolation.docker.agent_image import REQUIREMENTS_LABEL, STATE_LABEL, TAG_REPO
    from runner.isolation.docker.backend import DockerSandbox

    state = tmp_path / "state"
    state.mkdir()
    backend = DockerSandbox()
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM scratch\nCOPY f /f\n")
    (ctx / "f").write_text(secrets.token_hex(8))  # a new image id each run
    input_hash = secrets.token_hex(32)  # cyclebox's own: tagged with its input hash
    tag = f"{TAG_REPO}:{input_hash[:16]}"
    list(backend.build(ctx, tag, buildargs={}, labels={
        REQUIREMENTS_LABEL: "0" * 64, "io.cyclebox.base": "sha256:" + "1" * 64,
        "io.cyclebox.input_hash": input_hash,
        "io.cyclebox.role": "analyst", STATE_LABEL: str(state.resolve())}))
    image = backend.image_id(tag)
    assert image is not None
    env = cli_env(tmp_path, CYCLEBOX_STATE_DIR=str(state))
    try:
        listed = json.loads(run_cli("images", "list", "--json", env=env).stdout)
        assert [r for r in listed if r.get("id") == image and r["tag"] == tag]
        text = run_cli("images", "list", env=env).stdout
        assert tag in text and "derived analyst images" in text

        def gc_row() -> dict[str, Any]:
            res = run_cli("images", "gc", "--json", env=env)
            assert res.returncode == 0, res.stderr
            return next(r for r in json.loads(res.stdout) if r["id"] == image)

        # a live process that froze or runs with it (holds its use lock): kept
        holder = subprocess.Popen(
            [sys.executable, "-c", "import sys, time\nfrom runner.isolation import image_use\n"
             f"image_use.hold([{image!r}])\nprint('held', flush=True)\ntime.sleep(60)"],
            env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            row = gc_row()
            assert not row["removed"] and "live cyclebox process" in row["reason"]
        finally:
            holder.kill()
            holder.wait()
        # a container created from it (even stopped): kept
        cid = backend.client.api.create_container(image, command=["/f"],
                                                  labels={"test": "images-gc"})["Id"]
        try:
            row = gc_row()
            assert not row["removed"] and "used by container" in row["reason"]
        finally:
            backend.client.api.remove_container(cid, force=True)
        dry = run_cli("images", "gc", "--dry-run", env=env)
        assert f"would remove {tag}" in dry.stdout and backend.image_id(tag) == image
        # unused: removed; every other derived image (another state dir) kept
        rows = json.loads(run_cli("images", "gc", "--json", env=env).stdout)
        mine = [r for r in rows if r["id"] == image]
        assert mine and mine[0]["removed"], rows
        assert all(not r["removed"] for r in rows if r["id"] != image)
        assert backend.image_id(tag) is None
    finally:
        if backend.image_id(tag) is not None:
            backend.client.api.remove_image(tag, force=True)
