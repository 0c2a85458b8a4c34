"""Attacks on the apply step: who sets the edit's scope, what the host reads back from the
apply container, and whether the exported candidate is the commit that was verified.

- Standalone `cyclebox apply` takes the path set and allowlist only from the operator
  (--paths/--allowlist or --plan); a proposal carrying its own is refused (exit 3).
- A compromised apply container (simulated by running another command in the real apply
  image, with the real hardening) plants result.json as a symlink to a host file, as a
  FIFO, as a huge file, or claims a commit id that is a git option: each is a recorded
  refusal, read without following, blocking or exhausting anything.
- A `.gitattributes` edit inside the allowlist (export-ignore, ident) changes nothing that
  runs: the candidate is exported as its committed blobs, every file present, `$Id$` as
  written.
- A compromised apply container that renames a file onto the proposal's new path (a
  deletion that git's rename detection would fold into the addition) is refused: the
  host commits the proposal itself, and the container's commit is not that one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

CLI = [str(Path(sys.executable).with_name("cyclebox"))]
if not Path(CLI[0]).exists():  # pragma: no cover - fallback when not installed as a script
    CLI = [sys.executable, "-m", "runner.cli"]

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
SYSTEM = "You are a careful analyst.\n"


def _git(repo: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")} | GIT_ENV
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env=env).stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("operator") / "repo"
    (root / "prompts").mkdir(parents=True)
    (root / "prompts" / "system.md").write_text(SYSTEM)
    (root / "README.md").write_text("# demo\n")
    _git(root, "init", "-q", "-b", "main")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "base")
    return root


def _cli_apply(tmp_path: Path, repo: Path, proposal: dict[str, Any], *flags: str
               ) -> tuple[subprocess.CompletedProcess[str], Path]:
    pfile = tmp_path / "proposal.json"
    pfile.write_text(json.dumps(proposal))
    out = tmp_path / "OUT"
    res = subprocess.run([*CLI, "apply", "--proposal", str(pfile), "--repo", str(repo),
                          "--ref", "main", "--out", str(out), *flags],
                         capture_output=True, text=True, timeout=180, check=False)
    return res, out


def _sha(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


GOOD = {"files": [{"path": "prompts/system.md", "content": "Be concise.\n"}],
        "rationale": "test", "base": {"prompts/system.md": _sha(SYSTEM)}}


# -- who sets the scope -----------------------------------------------------------------

def test_standalone_apply_without_operator_scope_refused(repo: Path, tmp_path: Path) -> None:
    res, out = _cli_apply(tmp_path, repo, GOOD)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "error: --paths: --paths is required" in res.stderr
    res, out = _cli_apply(tmp_path, repo, GOOD, "--paths", "prompts/system.md")
    assert res.returncode == 3, res.stdout + res.stderr
    assert "--allowlist is required" in res.stderr
    assert not out.exists()  # refused before anything ran or was written


@pytest.mark.parametrize("field", ["allowlist", "paths"])
def test_proposal_carrying_its_own_scope_refused(repo: Path, tmp_path: Path,
                                                 field: str) -> None:
    # The worker would love to widen its own allowlist to "*".
    hostile = {**GOOD, field: ["*"] if field == "allowlist" else ["README.md"]}
    res, out = _cli_apply(tmp_path, repo, hostile, "--paths", "prompts/system.md",
                          "--allowlist", "prompts/*")
    assert res.returncode == 3, res.stdout + res.stderr
    assert f"proposal.json: {field}: the proposal carries its own {field!r}" in res.stderr
    assert not out.exists()


# -- a compromised apply container --------------------------------------------------------

def _hostile_apply(tmp_path: Path, repo: Path, script: str, *, timeout: float = 150,
                   proposal: dict[str, Any] | None = None,
                   paths: tuple[str, ...] = ("prompts/system.md",)) -> dict[str, Any]:
    """apply_proposal with the real apply image and hardening, running ``script``
    instead of sandbox.apply_main; fails if the host side blocks."""
    from runner.cycle.apply import apply_proposal
    from runner.gitops import resolve_tree
    from runner.isolation.docker.images import resolve_image
    from runner.isolation.launcher import launch
    from runner.isolation.policy import load_policies
    from runner.isolation.registry import get_sandbox
    from runner.isolation.sandbox import Mount
    from runner.paths import default_policies

    stage = tmp_path / "stage"
    (stage / "in").mkdir(parents=True)
    proposal = proposal or GOOD
    (stage / "in" / "proposal.json").write_text(json.dumps(proposal))
    (stage / "in" / "invocation.json").write_text(json.dumps(
        {"paths": list(paths), "allowlist": ["prompts/*"],
         "base": proposal["base"], "max_file_bytes": 1024}))
    policy = load_policies(default_policies()).roles["apply"]

    def run(work: Path) -> Any:
        return launch(get_sandbox("docker"), policy, role="apply", run_id="test-security-apply",
                      image=resolve_image("apply"), command=["python", "-c", script],
                      output_dir=work, output_target="/work",
                      mounts=[Mount(source=stage / "in", target="/in")])

    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = apply_proposal(stage, repo, resolve_tree(repo, "main"), run=run,
                                           uid=policy.uid,
                                           export_to=stage / "candidate-src")
        except BaseException as exc:  # reported to the test thread
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the host blocked reading the apply container's output"
    if "error" in box:
        raise box["error"]
    result: dict[str, Any] = box["result"].model_dump(mode="json")
    # Fail closed and keep the attempt: the refusal is what the stage recorded.
    assert json.loads((stage / "result.json").read_text()) == result
    assert not (stage / "candidate.patch").exists()
    assert not (stage / "candidate-src").exists()
    return result


@pytest.mark.docker
def test_result_json_symlink_not_followed(repo: Path, tmp_path: Path) -> None:
    # A host file that says "applied": following the link would read it.
    lure = tmp_path / "lure.json"
    lure.write_text(json.dumps({"status": "applied", "commit": "0" * 40}))
    os.chmod(tmp_path, 0o755)
    result = _hostile_apply(tmp_path, repo,
                            f"import os; os.symlink({str(lure)!r}, '/work/out/result.json')")
    assert result["reason"] == "output_refused", result
    # refused at copy-out (never reaches the host) or by the host's reader
    assert "symlink refused" in result["message"], result


@pytest.mark.docker
def test_result_json_fifo_does_not_block(repo: Path, tmp_path: Path) -> None:
    result = _hostile_apply(tmp_path, repo, "import os; os.mkfifo('/work/out/result.json')")
    assert result["reason"] == "output_refused", result
    assert ("not a regular file (fifo)" in result["message"]
            or "fifo" in result["message"].lower()), result


@pytest.mark.docker
def test_result_json_huge_refused(repo: Path, tmp_path: Path) -> None:
    script = ("f = open('/work/out/result.json', 'w'); f.write('{\"status\": \"applied\", "
              "\"pad\": \"' + 'A' * (9 * 1024 * 1024) + '\"}'); f.close()")
    result = _hostile_apply(tmp_path, repo, script)
    assert result["reason"] == "output_refused", result
    assert "size cap" in result["message"]


@pytest.mark.docker
def test_result_commit_that_is_a_git_option_refused(repo: Path, tmp_path: Path) -> None:
    script = ("import json; json.dump({'status': 'applied', 'commit': "
              "'--upload-pack=touch /tmp/pwned'}, open('/work/out/result.json', 'w'))")
    result = _hostile_apply(tmp_path, repo, script)
    assert result["reason"] == "output_refused", result
    assert "not a git object id" in result["message"]


RENAME_ONTO_NEW_PATH = """
import json, subprocess
env = {"GIT_AUTHOR_NAME": "cyclebox", "GIT_AUTHOR_EMAIL": "cyclebox@localhost",
       "GIT_COMMITTER_NAME": "cyclebox", "GIT_COMMITTER_EMAIL": "cyclebox@localhost",
       "GIT_AUTHOR_DATE": "2000-01-01T00:00:01+0000",
       "GIT_COMMITTER_DATE": "2000-01-01T00:00:01+0000",
       "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/tmp", "PATH": "/usr/bin:/bin"}
def g(*args):
    return subprocess.run(["git", "-C", "/work/repo", *args], check=True,
                          capture_output=True, env=env).stdout
base = g("rev-parse", "HEAD").decode().strip()
g("checkout", "-q", "-b", "cyclebox/candidate")
g("mv", "README.md", "prompts/extra.md")  # the proposal's new file, same content
g("commit", "-q", "-m", "cyclebox candidate\\n\\ntest")  # the real identity, dates, message
commit = g("rev-parse", "HEAD").decode().strip()
open("/work/out/candidate.patch", "wb").write(
    g("diff", "--binary", "--no-color", "--no-ext-diff", base, commit))
# a complete claim (as sandbox/apply.py writes it), so that only the host's own commit of
# the proposal stands between the lie and a candidate
json.dump({"status": "applied", "commit": commit, "base_commit": base,
           "branch": "cyclebox/candidate", "changed": ["prompts/extra.md"],
           "tree": g("rev-parse", "HEAD^{tree}").decode().strip()},
          open("/work/out/result.json", "w"))
"""


@pytest.mark.docker
def test_a_deletion_folded_into_a_rename_is_refused(repo: Path, tmp_path: Path) -> None:
    # The proposal adds prompts/extra.md with README.md's content; the container commits
    # it as a rename, deleting README.md. git's default rename detection would report only
    # prompts/extra.md, matching the proposal, and the patch is git's own.
    proposal = {"files": [{"path": "prompts/extra.md", "content": "# demo\n"}],
                "rationale": "test", "base": {"prompts/extra.md": None}}
    result = _hostile_apply(tmp_path, repo, RENAME_ONTO_NEW_PATH, proposal=proposal,
                            paths=("prompts/extra.md",))
    assert result["reason"] == "host_verification_failed", result
    assert "is not the commit the proposal makes" in result["message"]


# -- .gitattributes inside the allowlist ---------------------------------------------------

@pytest.mark.docker
@pytest.mark.parametrize(("attrs", "extra"), [
    ("prompts/system.md export-ignore\n", None),
    # ident would rewrite $Id$ on export (export-subst needs a commit; we export trees)
    ("prompts/stamp.md ident\n", ("prompts/stamp.md", "stamp $Id$\n")),
], ids=["export-ignore", "ident"])
def test_a_gitattributes_edit_changes_no_exported_byte(
        repo: Path, tmp_path: Path, attrs: str, extra: tuple[str, str] | None) -> None:
    """The edit is applied (it is in the allowlist) and the candidate that runs is its
    commit's blobs exactly: the file export-ignore names is there, $Id$ unexpanded. Once
    refused as export_mismatch; before that, exported as git's conversion of it."""
    files = [{"path": "prompts/system.md", "content": "Be concise.\n"},
             {"path": ".gitattributes", "content": attrs}]
    base: dict[str, str | None] = {"prompts/system.md": _sha(SYSTEM), ".gitattributes": None}
    if extra:
        files.append({"path": extra[0], "content": extra[1]})
        base[extra[0]] = None
    proposal = {"files": files, "rationale": "test", "base": base}
    flags = [f"--paths={f['path']}" for f in files] + ["--allowlist=prompts/*",
                                                       "--allowlist=.gitattributes"]
    res, out = _cli_apply(tmp_path, repo, proposal, *flags)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads((out / "result.json").read_text())["status"] == "applied"
    for f in files:
        assert (out / "candidate-src" / f["path"]).read_text() == f["content"], f["path"]


@pytest.mark.docker
def test_plain_edit_still_applies_with_operator_scope(repo: Path, tmp_path: Path) -> None:
    res, out = _cli_apply(tmp_path, repo, GOOD, "--paths", "prompts/system.md",
                          "--allowlist", "prompts/*")
    assert res.returncode == 0, res.stdout + res.stderr
    assert (out / "candidate-src" / "prompts" / "system.md").read_text() == "Be concise.\n"
    assert json.loads((out / "in" / "invocation.json").read_text())["allowlist"] == ["prompts/*"]


@pytest.mark.docker
def test_plan_supplies_the_scope(tmp_path: Path) -> None:
    """--plan: the frozen plan's repository, base tree, path set and allowlist are used;
    adding --paths to it is refused."""
    import hashlib

    from runner.paths import PROJECT_ROOT

    plan = tmp_path / "plan"
    subprocess.run([*CLI, "freeze", str(PROJECT_ROOT / "examples/shop-analyst/cycle.yaml"),
                    "--out", str(plan)], check=True, capture_output=True, timeout=300)
    body = json.loads((plan / "plan.json").read_text())["plan"]
    current = subprocess.run(["git", "-C", body["project"]["repo"], "cat-file", "blob",
                              f"{body['project']['base_tree']}:prompts/system.md"],
                             check=True, capture_output=True).stdout
    proposal = {"files": [{"path": "prompts/system.md",
                           "content": current.decode() + "Be brief.\n"}],
                "rationale": "r", "base": {"prompts/system.md":
                                           hashlib.sha256(current).hexdigest()}}
    pfile = tmp_path / "proposal.json"
    pfile.write_text(json.dumps(proposal))
    res = subprocess.run([*CLI, "apply", "--proposal", str(pfile), "--plan",
                          str(plan / "plan.json"), "--out", str(tmp_path / "o1"),
                          "--paths", "README.md"], capture_output=True, text=True,
                         timeout=180, check=False)
    assert res.returncode == 3 and "--plan" in res.stderr, res.stderr
    res = subprocess.run([*CLI, "apply", "--proposal", str(pfile), "--plan",
                          str(plan / "plan.json"), "--out", str(tmp_path / "o2")],
                         capture_output=True, text=True, timeout=180, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    inv = json.loads((tmp_path / "o2" / "in" / "invocation.json").read_text())
    assert inv["allowlist"] == body["edit"]["allowlist"]
    assert inv["paths"] == body["edit"]["paths"]


@pytest.mark.docker
@pytest.mark.parametrize("fails", ["bound", "interrupt"])
def test_the_containers_applied_is_never_the_record_before_the_host_checked_it(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str) -> None:
    """helper-41 F1: the container's "applied" went into result.json before the host
    checked it, and stayed there when the check ended in an exception it did not catch
    (the export's 2 GiB bound, a signal): the host's record then said applied, with
    fields the container chose. Now the bound is a named refusal, and an interrupted
    check leaves no result at all."""
    from runner import gitops
    from runner.errors import ConfigError

    real_export = gitops.export_tree

    def export_tree(repo_: Path, tree: str, dest: Path, *a: Any, **k: Any) -> Any:
        if dest.name != "candidate-src":  # the base, seeded before the container runs
            return real_export(repo_, tree, dest, *a, **k)
        if fails == "bound":
            raise ConfigError("tree holds more than 2147483648 bytes of files; refused")
        raise KeyboardInterrupt

    monkeypatch.setattr(gitops, "export_tree", export_tree)
    real = "import runpy; runpy.run_module('sandbox.apply_main', run_name='__main__')"
    if fails == "bound":
        result = _hostile_apply(tmp_path, repo, real)
        assert result["status"] == "refused" and result["reason"] == "export_mismatch"
        assert "2147483648 bytes" in result["message"]
    else:
        with pytest.raises(KeyboardInterrupt):
            _hostile_apply(tmp_path, repo, real)
        assert not (tmp_path / "stage" / "result.json").exists()


@pytest.mark.docker
def test_a_path_git_refuses_is_a_named_refusal_with_gits_words(tmp_path: Path) -> None:
    """helper-41 (informational): an operator path inside a submodule (a 160000 gitlink)
    made `git add` fail in the container, which then wrote no result: the host recorded
    output_refused "result.json is missing". Now git's refusal is named, with its stderr."""
    from runner.errors import CycleboxError

    repo = tmp_path / "repo"
    (repo / "prompts").mkdir(parents=True)
    (repo / "prompts" / "system.md").write_text(SYSTEM)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "update-index", "--add", "--cacheinfo",
         f"160000,{'1' * 40},prompts/sub")
    _git(repo, "commit", "-q", "-m", "base with a submodule")
    proposal = {"files": [{"path": "prompts/sub/x.md", "content": "x\n"}], "rationale": "r",
                "base": {"prompts/sub/x.md": None}}
    real = "import runpy; runpy.run_module('sandbox.apply_main', run_name='__main__')"
    try:
        result = _hostile_apply(tmp_path, repo, real, proposal=proposal,
                                paths=("prompts/sub/x.md",))
    except CycleboxError as exc:  # the host refused before the container: also named
        pytest.fail(f"refused before the container ran: {exc}")
    assert result["reason"] == "git_failed", result
    assert "submodule" in result["message"] or "prompts/sub" in result["message"], result
