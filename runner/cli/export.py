"""``cyclebox export``: a run's call log and grades as training trajectories."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from runner.cli.options import JsonOpt, OutOpt
from runner.cli.output import out
from runner.paths import PROJECT_ROOT
from runner.termsafe import emit_json, safe

commands = typer.Typer()


@commands.command("export")
def export_cmd(run: Annotated[Path, typer.Option("--run", help="A cycle run directory.")],
               out_dir: OutOpt,
               fmt: Annotated[str, typer.Option("--format", help="Corpus format.")] = "verl",
               calibration: Annotated[Path | None, typer.Option(
                   help="Calibration result from `cyclebox review calibrate`.")] = None,
               policy: Annotated[Path, typer.Option(help="Export policy.")] =
               PROJECT_ROOT / "policies" / "export.yaml",
               json_out: JsonOpt = False) -> None:
    """Export a run's call log and grades as training trajectories.

    Writes trajectories.jsonl (byte-exact recorded requests), rl.parquet and sft.parquet
    (verl's layout: RLHFDataset and MultiTurnSFTDataset read them; sft.parquet holds the
    trajectories that passed, whose history has no assistant turn the model did not say
    right there),
    summary.json and export-receipt.json. Refuse cases are
    rewarded on refusal correctness; r_outcome is null only where nothing was graded.

    Exit codes: 0 exported; 3 refused, the reason named: calibration_missing,
    calibration_inconsistent, calibration_incomplete, kappa_below_policy,
    calibration_unbound, run_has_no_receipt, calibration_of_another_run,
    calibration_ratings_not_of_run (the ratings assessed are not what the run's records
    give), or --out exists; 8 run_altered: the run directory no longer matches its receipt
    (a file changed, added, removed or replaced by a link since the run: `cyclebox
    receipt verify` lists them)."""
    from runner.train.export import export, load_export_policy

    summary = export(run, out_dir, calibration=calibration, policy=load_export_policy(policy),
                     fmt=fmt)
    if json_out:
        emit_json(summary.model_dump(mode="json"))
    else:
        out.print(safe(f"exported {summary.trajectories} trajectories, {summary.turns} "
                       f"turns; r_format {summary.r_format}, r_outcome {summary.r_outcome} "
                       f"(graded on {summary.r_outcome_basis}), format pass rate "
                       f"{summary.format_pass_rate}; verl: rl.parquet {summary.rl_rows} "
                       f"rows, sft.parquet {summary.sft_rows} rows -> {out_dir}"),
                  highlight=False)
