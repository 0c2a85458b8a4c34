"""``cyclebox freeze`` and ``cyclebox cycle``: freeze a cycle into a plan, run it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from runner import interrupts
from runner.cli.options import (
    BackendOpt,
    HtmlOpt,
    JsonOpt,
    JunitOpt,
    MarkdownOpt,
    OutOpt,
    RayAddressOpt,
)
from runner.cli.output import LineProgress, err, out, print_terminal, report_error, report_warning
from runner.errors import EXIT_INTERRUPTED, ConfigError, CycleboxError
from runner.termsafe import emit_json, safe

if TYPE_CHECKING:
    from runner.gateway.config import UpstreamPolicy
    from runner.toolchain import AgentToolchains, DerivedAnalyst

app = typer.Typer(no_args_is_help=True, help="Run improvement cycles.")
commands = typer.Typer()

ReplayOpt = Annotated[Path | None, typer.Option(
    help="Answer every model call from this recorded run (byte-exact); a run with a "
    "receipt must verify against it (exit 8 otherwise).")]


def _upstream_override(cycle: Path, replay: Path | None) -> dict[str, UpstreamPolicy] | None:
    if replay is None:
        return None
    from runner.cycle.replay import replay_upstreams

    return replay_upstreams(cycle, replay)


@commands.command()
def freeze(cycle: Annotated[Path, typer.Argument(help="cycle.yaml")], out_dir: OutOpt,
           replay: ReplayOpt = None, json_out: JsonOpt = False) -> None:
    """Freeze a cycle into OUT/plan.json (refuses an existing OUT)."""
    from runner.cli.engine import cycle_images, derive_analyst
    from runner.cycle.plan import freeze as do_freeze

    plan, h = do_freeze(cycle, out_dir, images=cycle_images,
                        upstream_override=_upstream_override(cycle, replay), warn=report_warning,
                        derive_analyst=_derive(derive_analyst))
    if json_out:
        emit_json({"plan": str(out_dir / "plan.json"), "plan_hash": h})
    else:
        out.print(f"frozen {safe(plan.name)}: {safe(out_dir / 'plan.json')} plan_hash {safe(h)}",
                  highlight=False)


@app.command("run")
def cycle_run(
    cycle: Annotated[Path | None, typer.Argument(help="cycle.yaml (omit with --plan)")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Fresh output directory.")] = None,
    plan: Annotated[Path | None, typer.Option(
        help="Execute a prepared plan.json (alone: not with CYCLE, --out, --prepare-only "
             "or --replay).")] = None,
    prepare_only: Annotated[bool, typer.Option(help="Stop after freezing.")] = False,
    replay: ReplayOpt = None,
    json_out: JsonOpt = False,
    junit: JunitOpt = None,
    markdown: MarkdownOpt = None,
    html: HtmlOpt = None,
    backend: BackendOpt = None,
    ray_address: RayAddressOpt = None,
) -> None:
    """Freeze then run a cycle, or run a prepared plan.

    Exit 0 accept_for_review, 1 reject, 2 invalid_comparison; 3 bad input, 5 missing
    prerequisite, 6 engine lost, 9 disk full, 130 interrupted (each after writing the
    verdict and receipt when it can), 10 unexpected; `cyclebox --help` has the table."""
    from runner.cli.engine import choose_backend, cycle_images, derive_analyst, sandbox
    from runner.cycle.compare import EXIT_CODES
    from runner.cycle.plan import freeze as do_freeze
    from runner.cycle.run import CycleRunner
    from runner.report.files import check_targets, write_outputs

    if plan is not None:  # the plan says all of it: a flag that would change it is refused
        given = [name for name, value in (("CYCLE", cycle), ("--out", out_dir),
                                          ("--prepare-only", prepare_only),
                                          ("--replay", replay)) if value]
        if given:
            raise ConfigError(f"{', '.join(given)} cannot be given with --plan: the plan "
                              "was frozen with its inputs, its directory and its upstreams "
                              "(a --replay given here would not replace a live upstream)",
                              field=given[0], fix="run the plan alone (`cyclebox cycle run "
                              "--plan DIR/plan.json`), or freeze again with these flags")
    check_targets(out_dir if plan is None else plan.resolve().parent, junit=junit,
                  markdown=markdown, html=html)
    if cycle is not None and plan is None:
        from runner.cycle.config import load_cycle

        chosen, _ = load_cycle(cycle)  # flags win over the cycle file
        backend = backend or chosen.backend
        if backend == "ray" and ray_address is None and chosen.ray is not None:
            ray_address = chosen.ray.address
    choose_backend(backend, ray_address=ray_address)
    froze_here = False
    if plan is None:
        if cycle is None or out_dir is None:
            raise ConfigError("CYCLE and --out are required without --plan",
                              field="CYCLE" if cycle is None else "--out",
                              fix="give CYCLE and --out, or --plan DIR/plan.json")
        # Inputs, credentials, then images: only then is --out created (exclusively).
        do_freeze(cycle, out_dir,
                  images=lambda: cycle_images(check_engine=not prepare_only),
                  upstream_override=_upstream_override(cycle, replay), warn=report_warning,
                        derive_analyst=_derive(derive_analyst))
        plan = out_dir / "plan.json"
        froze_here = True
        if prepare_only:
            out.print(f"prepared {safe(plan)}", highlight=False)
            return
    # Not a terminal (CI) or --json: plain lines on stderr, so the run shows life.
    lines = LineProgress() if json_out or not err.is_terminal else None
    with Progress(TextColumn("{task.description:<20}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, disable=lines is not None) as bar:
        tasks: dict[str, Any] = {}

        def progress(stage: str, done: int, total: int) -> None:
            # total 0 marks a single-step stage: shown as 1/1 once it starts
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total or 1)
            bar.update(tasks[stage], completed=done if total else 1, total=total or 1)

        try:
            outcome = CycleRunner(plan, sandbox=sandbox(),
                                  progress=lines or progress).run()
        except CycleboxError:
            # Refused before any stage started (no container ran, nothing to keep): the
            # --out this command just made is removed, so the corrected rerun can use
            # the same path.
            if froze_here and out_dir is not None:
                _discard_unstarted(out_dir)
            raise
    failure = outcome.failure
    if failure is not None and failure.reason == "environment_failure":
        # Disk full: no receipt, so that nothing claims a complete run (verify fails).
        report_error(f"{outcome.result.reasons[0]} (no receipt written; partial run "
                     f"in {outcome.run_dir})")
        raise typer.Exit(failure.exit_code)
    t0 = time.monotonic()
    with interrupts.shielded():  # the import too: a first signal must not cut it short
        from runner.cycle.receipt import build_receipt

        receipt = build_receipt(outcome)
    t1 = time.monotonic()
    report = write_outputs(outcome.run_dir, junit=junit, markdown=markdown, html=html)
    # what this command spent after the stages (not in the receipt: it is built first)
    timings = {**outcome.timings, "receipt": round(t1 - t0, 3),
               "report": round(time.monotonic() - t1, 3)}
    result = outcome.result
    if failure is not None:
        # The verdict and receipt are written; the exit code says why the cycle stopped.
        report_error(f"{result.reasons[0] if result.reasons else failure.reason}"
                     f" (verdict and receipt in {outcome.run_dir})")
        raise typer.Exit(failure.exit_code)
    if interrupts.seen():  # a signal held while the receipt was written
        raise typer.Exit(EXIT_INTERRUPTED)
    if json_out:
        emit_json({"run_dir": str(outcome.run_dir), "verdict": result.verdict,
                   "reasons": list(result.reasons),
                   "receipt": str(outcome.run_dir / "receipt.json"),
                   "outcome": receipt.outcome.model_dump(mode="json"),
                   "timing": timings,
                   "report": json.loads(report.model_dump_json(by_alias=True))})
    else:
        # The report's rows (verdict, reasons, pass counts per arm and split, changes,
        # cost per role with unknown and fixture costs named), then this run's timing.
        print_terminal(report, extra=(
            # a dotted key is a stage's detail (concurrency, prepared waits): receipt only
            ("time per stage", ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()
                                         if "." not in k)),
            ("receipt", str(outcome.run_dir / "receipt.json"))))
    raise typer.Exit(EXIT_CODES[result.verdict])


def _derive(build: Callable[..., DerivedAnalyst]
            ) -> Callable[[str, AgentToolchains], DerivedAnalyst]:
    """The derived-image builder for freeze, its steps printed on stderr."""
    def log(line: str) -> None:
        err.print(safe(line, 300), highlight=False)

    return lambda analyst_id, toolchains: build(analyst_id, toolchains, log=log)


def _discard_unstarted(out_dir: Path) -> None:
    """Remove a run directory whose run never started a stage (plan, inputs, empty logs)."""
    import shutil

    if not any((out_dir / "stages").glob("*")):
        shutil.rmtree(out_dir, ignore_errors=True)


@app.command("schema")
def cycle_schema() -> None:
    """Print the JSON schema of cycle.yaml."""
    from runner.cycle.config import CycleFile

    emit_json(CycleFile.model_json_schema(by_alias=True))
