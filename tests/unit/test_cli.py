"""The CLI package's shape and its one error boundary, without an engine.

The boundary is exercised on a throwaway command group built with the real
:class:`~runner.cli.boundary.Boundary`; the package rules (import direction, no literal
exit codes, every command documented) are checked on the real ``cyclebox`` app.
"""

from __future__ import annotations

import ast
import errno
from pathlib import Path
from typing import Any, ClassVar

import pytest
import typer

from runner.cli import app
from runner.cli.boundary import Boundary
from runner.errors import (
    EXIT_BAD_INPUT,
    EXIT_CHECK_FAILED,
    EXIT_CODES,
    EXIT_ENGINE,
    EXIT_ENVIRONMENT,
    EXIT_INTEGRITY,
    EXIT_INTERRUPTED,
    EXIT_OUTPUT_REFUSED,
    EXIT_PREREQUISITE,
    EXIT_TABLE,
    EXIT_UNEXPECTED,
    CheckFailed,
    ConfigError,
    CycleboxError,
    IntegrityError,
    OutputRejected,
    PrerequisiteError,
    SandboxError,
)

CLI_DIR = Path(__file__).resolve().parents[2] / "runner" / "cli"


@pytest.fixture(autouse=True)
def _state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Error logs (engine, environment, unexpected) go to a private state directory."""
    monkeypatch.setenv("CYCLEBOX_STATE_DIR", str(tmp_path / "state"))


def _raising(exc: BaseException) -> int:
    """Exit code of a one-command app (root group: Boundary) whose command raises ``exc``."""
    probe = typer.Typer(cls=Boundary)

    @probe.command()
    def boom() -> None:
        raise exc

    @probe.command()
    def other() -> None:  # a second command keeps `boom` a sub-command
        """Unused."""

    code: int = probe(["boom"], standalone_mode=False)
    return code


@pytest.mark.parametrize(("exc", "code"), [
    (ConfigError("bad", field="--x"), EXIT_BAD_INPUT),
    (CheckFailed("kappa low"), EXIT_CHECK_FAILED),
    (PrerequisiteError("no image"), EXIT_PREREQUISITE),
    (SandboxError("engine gone"), EXIT_ENGINE),
    (OutputRejected("symlink"), EXIT_OUTPUT_REFUSED),
    (IntegrityError("hash"), EXIT_INTEGRITY),
    (OSError(errno.ENOSPC, "No space left on device"), EXIT_ENVIRONMENT),
    (BrokenPipeError(errno.EPIPE, "Broken pipe"), EXIT_ENVIRONMENT),
    (KeyboardInterrupt(), EXIT_INTERRUPTED),
])
def test_boundary_maps_each_error_to_its_code(exc: BaseException, code: int,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert _raising(exc) == code
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err
    if isinstance(exc, CycleboxError):
        assert str(exc) in err


def test_boundary_unexpected_error_names_a_log(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert _raising(ZeroDivisionError("planted")) == EXIT_UNEXPECTED
    err = capsys.readouterr().err
    logs = list((tmp_path / "state" / "logs").glob("error-*.log"))
    assert len(logs) == 1 and logs[0].name in err.replace("\n", "")
    assert "Traceback" in logs[0].read_text() and "Traceback" not in err


def test_boundary_usage_error_is_bad_input_and_help_is_zero(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert app(["cycle", "run", "--no-such-flag"], standalone_mode=False) == EXIT_BAD_INPUT
    assert "No such option" in capsys.readouterr().err
    assert app(["gateway", "calls"], standalone_mode=False) == EXIT_BAD_INPUT  # missing arg
    assert app(["cycle"], standalone_mode=False) == 0  # no args: help
    assert app(["--help"], standalone_mode=False) == 0


def test_exit_table_gives_each_code_one_meaning() -> None:
    codes = [code for code, _ in EXIT_TABLE]
    assert len(codes) == len(set(codes))
    assert set(EXIT_CODES.values()) <= set(codes)


def _commands(group: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    found = []
    ctx = type(group).context_class(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        found.append(((*path, name), cmd))
        if hasattr(cmd, "list_commands"):
            found += _commands(cmd, (*path, name))
    return found


def test_every_command_has_help_and_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    commands = _commands(typer.main.get_command(app))
    names = {" ".join(p) for p, _ in commands}
    assert {"cycle run", "apply", "compare", "train proof", "sandbox exec", "receipt verify",
            "review calibrate", "gc", "doctor", "images build", "export"} <= names
    for path, cmd in commands:
        assert (cmd.help or "").strip(), f"{' '.join(path)} has no help text"
        assert app([*path, "--help"], standalone_mode=False) == 0, path
        capsys.readouterr()


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "runner.cli":
            found.update(f"runner.cli.{a.name}" for a in node.names)  # a module or `app`
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_imports_go_one_way_app_to_areas_to_shared() -> None:
    shared = {"runner.cli.options", "runner.cli.output", "runner.cli.engine"}
    areas = [p for p in CLI_DIR.glob("*.py") if p.stem not in
             ("__init__", "__main__", "app", "boundary", "options", "output", "engine")]
    assert len(areas) >= 10
    for area in areas:
        cli_imports = {m for m in _imports(area) if m.startswith("runner.cli")}
        assert cli_imports <= shared, f"{area.name} imports {cli_imports - shared}"
    for module in ("options", "output", "engine"):
        assert not {m for m in _imports(CLI_DIR / f"{module}.py")
                    if m.startswith("runner.cli")}


def test_no_command_exits_with_a_bare_number_or_catches_errors_to_exit() -> None:
    for path in CLI_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "Exit"
                    and node.args):
                assert not isinstance(node.args[0], ast.Constant), \
                    f"{path.name}:{node.lineno}: name the exit code (runner.errors)"
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "exit":
                assert path.name in ("boundary.py", "app.py"), \
                    f"{path.name}:{node.lineno}: sys.exit outside the boundary"
        # A handler that cleans up and re-raises (bare ``raise`` last) still leaves the
        # exit code to the boundary.
        handlers = [n for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler)
                    and isinstance(n.type, ast.Name) and n.type.id == "CycleboxError"
                    and not (isinstance(n.body[-1], ast.Raise) and n.body[-1].exc is None)]
        # Only `receipt verify` catches one: a bad signature is listed with the mismatches.
        assert len(handlers) == (1 if path.name == "receipt.py" else 0), path.name


def test_train_proof_that_did_not_reproduce_is_check_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import runner.train.host
    from runner.train.results import ProofSummary

    scores = {"similarity_before": 0.2, "similarity_after": 0.9, "imprint_delta": 0.7,
              "changed": 0.8}
    figures = {"steps": 2, "epochs": 2, "grad_accum": 1, "lr": 0.002, "train_tokens": 9,
               "seconds": 1.0, "tokens_per_s": 9.0, "final_loss": 0.4, "peak_rss_mb": 80.0}
    report = {"persona": "p", "schedule": {"epochs": 2, "grad_accum": 1, "reason": "r"},
              "figures": figures, "probes": ["q"], "references": ["a"], "before": ["x"],
              "after": ["a"], "recall_before": 0.0, "recall_after": 1.0, "scores": scores,
              "classroom_passed": True, "board": {"decision": "approve", "members": {}}}
    receipt = {"schema": 1, "kind": "proof", "config": {}, "config_sha256": "c",
               "dataset_sha256": "d", "adapter_files": {}, "base_model_files": {},
               "recall_before": 0.0, "recall_after": 1.0, "scores": scores,
               "classroom_passed": True, "board": "approve"}
    row = {"persona": "p", "passed": True, "rows": 1, "epochs": 2, "grad_accum": 1,
           "imprint_delta": 0.7, "recall_before": 0.0, "recall_after": 1.0, "board": "approve"}
    summary = [ProofSummary.model_validate({
        "exit_code": 0, "report": report, "receipt": receipt,
        "reproduced_in_fresh_process": False, "ledger": "l", "ledger_row": row,
        "trainer_run": {}})]
    monkeypatch.setattr(runner.train.host, "proof", lambda *_a, **_k: summary[0])
    import runner.cli.train

    monkeypatch.setattr(runner.cli.train, "trainer", lambda: None)  # no engine, no image
    args = ["train", "proof", "--persona", "p.yaml", "--base-model", "m", "--out",
            str(tmp_path / "o"), "--ledger", str(tmp_path / "ledger.jsonl"), "--json"]
    assert app(args, standalone_mode=False) == EXIT_CHECK_FAILED
    assert "did not reproduce" in capsys.readouterr().err
    summary[0] = summary[0].model_copy(update={"exit_code": 4})
    assert app(args, standalone_mode=False) == EXIT_CHECK_FAILED
    assert "nothing imprinted" in capsys.readouterr().err
    summary[0] = summary[0].model_copy(update={"exit_code": 0,
                                               "reproduced_in_fresh_process": True})
    assert app(args, standalone_mode=False) == 0


def test_exec_exit_code_is_the_commands_or_the_stop_reasons() -> None:
    from runner.cli.sandbox import exec_exit_code
    from runner.isolation.sandbox import RunRecord, StopReason

    def rec(reason: StopReason, code: int | None) -> RunRecord:
        return RunRecord(run_id="r", role="worker", image_id="sha256:x", container_name="c",
                         exit_code=code, stop_reason=reason, wall_s=0.1, stdout_bytes=0,
                         stderr_bytes=0, stdout_tail="", stderr_tail="",
                         cleanup_confirmed=True)

    assert exec_exit_code(rec(StopReason.OK, 0)) == 0
    assert exec_exit_code(rec(StopReason.PROCESS_FAILED, 1)) == 1  # the command's own
    assert exec_exit_code(rec(StopReason.TIMEOUT, 137)) == 124
    assert exec_exit_code(rec(StopReason.INVALID_OUTPUT, 0)) == EXIT_OUTPUT_REFUSED
    assert exec_exit_code(rec(StopReason.PROCESS_FAILED, None)) == EXIT_ENGINE


def test_replay_answers_every_upstream_from_the_recording(tmp_path: Path) -> None:
    from runner.cycle.replay import replay_upstreams
    from runner.paths import PROJECT_ROOT

    ups = replay_upstreams(PROJECT_ROOT / "examples" / "shop-analyst" / "cycle.yaml",
                           tmp_path / "rec")
    assert {"target", "optimizer", "judge"} <= set(ups)
    for up in ups.values():
        assert up.provider == "replay" and up.replay_from == str((tmp_path / "rec").resolve())
        assert up.script is None and up.credential is None and up.base_url is None


def test_replay_of_an_anthropic_upstream_drops_its_own_fields(tmp_path: Path) -> None:
    # An anthropic upstream carries anthropic_version; a replayed one must not (the
    # replay variant refuses another provider's field: this crashed `--replay`, exit 10).
    import yaml

    from runner.cycle.replay import replay_upstreams
    from runner.paths import PROJECT_ROOT

    src = PROJECT_ROOT / "examples" / "shop-analyst"
    cyc = yaml.safe_load((src / "cycle.yaml").read_text())
    cyc["upstreams"]["target"] = {
        "provider": "anthropic", "models": ["claude-x"], "base_url": "https://api.anthropic.com",
        "credential": {"env": "SOME_KEY"}, "anthropic_version": "2023-06-01"}
    for name in ("manifest", "policy", "data_dir", "roles"):
        if isinstance(cyc.get(name), str):
            cyc[name] = str((src / cyc[name]).resolve())
    if isinstance(cyc.get("project"), dict) and isinstance(cyc["project"].get("repo"), str):
        cyc["project"]["repo"] = str((src / cyc["project"]["repo"]).resolve())
    for up in cyc["upstreams"].values():
        if up.get("script"):
            up["script"] = str((src / up["script"]).resolve())
    cycle = tmp_path / "cycle.yaml"
    cycle.write_text(yaml.safe_dump(cyc))
    ups = replay_upstreams(cycle, tmp_path / "rec")
    assert ups["target"].provider == "replay" and ups["target"].models == ("claude-x",)
    assert ups["target"].anthropic_version is None and ups["target"].base_url is None


def test_readme_exit_code_table_is_the_one_table() -> None:
    from runner.paths import PROJECT_ROOT

    text = (PROJECT_ROOT / "README.md").read_text()
    section = text.split("### Exit codes", 1)[1]
    rows = [line.strip("|").split("|") for line in section.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [(int(c), m.strip()) for c, m in rows] == list(EXIT_TABLE)


def test_gc_says_which_nodes_were_not_swept_and_exits_6(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A Ray node that did not answer gc is named (not a clean-looking result)."""
    from runner.cli import engine

    class Cluster:
        name = "ray"
        unanswered: ClassVar[list[str]] = ["deadbeef" * 7]

        def sweep(self, *, only_orphans: bool, dry_run: bool) -> list[object]:
            return []

    from runner.isolation import registry

    monkeypatch.setattr(registry, "get_sandbox", lambda *a, **k: Cluster())
    engine.reset()
    assert app(["gc", "--dry-run"], standalone_mode=False) == 6
    err = capsys.readouterr().err
    assert "1 node(s) did not answer and were not swept: deadbeefdead" in err
    Cluster.unanswered = []
    engine.reset()
    assert app(["gc", "--dry-run"], standalone_mode=False) == 0
    engine.reset()


@pytest.mark.parametrize("ev", [
    {"event": "progress", "step": "5", "total": None},
    {"event": "progress", "step": 1e308, "total": None},
    {"event": "progress", "step": 1, "total": 1e308},
    {"event": "progress", "step": True, "total": 2},
    {"event": "progress", "step": 3, "total": 2},
    {"event": "progress"},
])
def test_a_trainer_progress_event_with_a_bad_count_is_not_drawn(ev: dict[str, Any]) -> None:
    """A trainer's event is hostile: a count rich stored quietly broke the bar when it was
    drawn at exit, after training, and the command's exit code was lost."""
    import io

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from runner.cli.train import _Bar

    con = Console(file=io.StringIO(), force_terminal=True, width=100)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=con, auto_refresh=False) as p:
        bar = _Bar(p, "training")
        bar(ev)
        bar({"event": "progress", "step": 1, "total": 2, "loss": 0.5})
    assert "1/2" in con.file.getvalue()  # type: ignore[attr-defined]
