"""``cyclebox freeze`` and ``cyclebox cycle``: freeze a cycle into a plan, run it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from runner import interrupts
from runner.cli.options import HtmlOpt, JsonOpt, JunitOpt, MarkdownOpt, OutOpt
from runner.cli.output import LineProgress, err, out, report_error
from runner.errors import EXIT_INTERRUPTED, ConfigError
from runner.termsafe import emit_json, safe

if TYPE_CHECKING:
    from runner.gateway.config import UpstreamPolicy

app = typer.Typer(no_args_is_help=True, help="Run improvement cycles.")
commands = typer.Typer()

ReplayOpt = Annotated[Path | None, typer.Option(
    help="Answer every model call from this recorded run (byte-exact).")]


def _upstream_override(cycle: Path, replay: Path | None) -> dict[str, UpstreamPolicy] | None:
    if replay is None:
        return None
    from runner.cycle.replay import replay_upstreams

    return replay_upstreams(cycle, replay)


@commands.command()
def freeze(cycle: Annotated[Path, typer.Argument(help="cycle.yaml")], out_dir: OutOpt,
           replay: ReplayOpt = None, json_out: JsonOpt = False) -> None:
    """Freeze a cycle into OUT/plan.json (refuses an existing OUT)."""
    from runner.cli.engine import cycle_images
    from runner.cycle.plan import freeze as do_freeze

    plan, h = do_freeze(cycle, out_dir, images=cycle_images,
                        upstream_override=_upstream_override(cycle, replay))
    if json_out:
        emit_json({"plan": str(out_dir / "plan.json"), "plan_hash": h})
    else:
        out.print(f"frozen {safe(plan.name)}: {safe(out_dir / 'plan.json')} plan_hash {safe(h)}",
                  highlight=False)


@app.command("run")
def cycle_run(
    cycle: Annotated[Path | None, typer.Argument(help="cycle.yaml (omit with --plan)")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Fresh output directory.")] = None,
    plan: Annotated[Path | None, typer.Option(help="Execute a prepared plan.json.")] = None,
    prepare_only: Annotated[bool, typer.Option(help="Stop after freezing.")] = False,
    replay: ReplayOpt = None,
    json_out: JsonOpt = False,
    junit: JunitOpt = None,
    markdown: MarkdownOpt = None,
    html: HtmlOpt = None,
) -> None:
    """Freeze then run a cycle, or run a prepared plan.

    Exit 0 accept_for_review, 1 reject, 2 invalid_comparison; 3 bad input, 5 missing
    prerequisite, 6 engine lost, 9 disk full, 130 interrupted (each after writing the
    verdict and receipt when it can), 10 unexpected; `cyclebox --help` has the table."""
    from runner.cli.engine import cycle_images
    from runner.cycle.compare import EXIT_CODES
    from runner.cycle.plan import freeze as do_freeze
    from runner.cycle.receipt import build
    from runner.cycle.run import CycleRunner
    from runner.report.files import check_targets, write_outputs

    check_targets(junit=junit, markdown=markdown, html=html)
    if plan is None:
        if cycle is None or out_dir is None:
            raise ConfigError("CYCLE and --out are required without --plan",
                              field="CYCLE" if cycle is None else "--out",
                              fix="give CYCLE and --out, or --plan DIR/plan.json")
        # Inputs, credentials, then images: only then is --out created (exclusively).
        do_freeze(cycle, out_dir,
                  images=lambda: cycle_images(check_engine=not prepare_only),
                  upstream_override=_upstream_override(cycle, replay))
        plan = out_dir / "plan.json"
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

        runner = CycleRunner(plan, progress=lines or progress)
        outcome = runner.run()
    failure = outcome.failure
    if failure is not None and failure.reason == "environment_failure":
        # Disk full: no receipt, so that nothing claims a complete run (verify fails).
        report_error(f"{outcome.result.reasons[0]} (no receipt written; partial run "
                     f"in {outcome.run_dir})")
        raise typer.Exit(failure.exit_code)
    with interrupts.shielded():
        receipt = build(outcome)
    report = write_outputs(outcome.run_dir, junit=junit, markdown=markdown, html=html)
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
                   "outcome": receipt["outcome"], "timing": outcome.timings,
                   "report": json.loads(report.model_dump_json(by_alias=True))})
    else:
        _summary(outcome, receipt)
    raise typer.Exit(EXIT_CODES[result.verdict])


def _summary(outcome: Any, receipt: dict[str, Any]) -> None:
    r = outcome.result
    colour = {"accept_for_review": "green", "reject": "red"}.get(r.verdict, "yellow")
    t = Table(title=f"cycle {safe(outcome.run_dir.name)}", show_header=False)
    t.add_column("k")
    t.add_column("v", overflow="fold")
    t.add_row("verdict", f"[bold {colour}]{safe(r.verdict)}[/]")
    for reason in r.reasons:
        t.add_row("reason", safe(reason))
    for c in r.improvements:
        t.add_row("improved", safe(f"{c.case_id} t{c.trial} {c.criterion}"))
    for c in r.regressions:
        t.add_row("regressed", safe(f"{c.case_id} t{c.trial} {c.criterion}"))
    total = receipt["usage"]["total"]
    t.add_row("model calls", safe(f"{total['calls']} ({total['ok']} ok), cost "
                                  f"{total['cost_usd']} USD, complete={total['complete']}"
                                  + (" [fixture]" if receipt["fixture"] else "")))
    t.add_row("time per stage", safe(", ".join(f"{k} {v:.1f}s"
                                               for k, v in outcome.timings.items())))
    t.add_row("receipt", safe(outcome.run_dir / "receipt.json"))
    out.print(t)


@app.command("schema")
def cycle_schema() -> None:
    """Print the JSON schema of cycle.yaml."""
    from runner.cycle.config import CycleFile

    emit_json(CycleFile.model_json_schema(by_alias=True))
