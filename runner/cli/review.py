"""``cyclebox review``: human review packets and judge calibration."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from runner.cli.options import JsonOpt, OutOpt
from runner.cli.output import out
from runner.errors import CheckFailed
from runner.paths import PROJECT_ROOT
from runner.termsafe import emit_json_text, safe

app = typer.Typer(no_args_is_help=True, help="Human review packets and calibration.")


@app.command("packet")
def review_packet(records: Annotated[Path, typer.Option(help="Records (JSONL).")],
                  out_dir: OutOpt, reviewer: str = "",
                  manifest: Annotated[Path | None, typer.Option(
                      help="Scenario manifest: shows each task to the reviewer.")] = None,
                  run: Annotated[Path | None, typer.Option(
                      "--run", help="The run the records belong to (default: the run "
                      "directory holding RECORDS, when it has a receipt). Binds the packet "
                      "and its calibration to that run's receipt.")] = None,
                  intent_key: str = "question") -> None:
    """Write a review packet for human labelling.

    review.md, packet.json, an empty human-labels.json and judge-ratings.json kept apart.
    packet.json records the sha256 of the run's receipt.json and of the records file.
    Exit 0 written; 3 bad input (records not the run's); 8 records changed since the run."""
    from runner.cycle.compare import load_records
    from runner.cycle.review import (
        bind_run,
        make_packet,
        manifest_questions,
        run_of_records,
        tool_calls_of_run,
    )

    questions = manifest_questions(manifest, intent_key) if manifest is not None else None
    if run is None:
        run = run_of_records(records)
    binding = bind_run(run, records) if run is not None else None
    calls = tool_calls_of_run(run, binding) if run is not None and binding else None
    path = make_packet(load_records(records), out_dir, reviewer=reviewer,
                       questions=questions, run=binding, tool_calls=calls)
    bound = (f"bound to run {safe(run)}" if binding
             else "NOT bound to a run (export will refuse it)")
    out.print(f"packet written to {safe(path)}, {bound}; fill human-labels.json, then run "
              "`cyclebox review calibrate`", highlight=False)


@app.command("calibrate")
def review_calibrate(packet: Annotated[Path, typer.Option(help="Packet directory.")],
                     labels: Annotated[Path, typer.Option(help="Filled human-labels.json.")],
                     judges: Annotated[Path, typer.Option(help="judge-ratings.json.")],
                     out_file: Annotated[Path, typer.Option("--out", help="Result file.")],
                     policy: Annotated[Path, typer.Option(
                         help="Export policy whose min_kappa the calibration must reach.")] =
                     PROJECT_ROOT / "policies" / "export.yaml",
                     json_out: JsonOpt = False) -> None:
    """Agreement between human labels and model ratings.

    Coverage, exact agreement, mean absolute difference and Cohen's kappa. A cell
    labelled "na" (or left null where the scorer graded the criterion not applicable)
    is not missing coverage. The result is written in every case that gets that far.

    Exit codes: 0 complete coverage and overall kappa >= the export policy's min_kappa;
    3 bad input (a file unreadable or malformed, --out exists); 4 check failed
    (coverage incomplete or kappa below min_kappa; the result file is still written);
    8 integrity (the packet, review.md, labels or ratings do not match each other)."""
    from runner.cycle.review import OVERALL, calibrate, write_calibration
    from runner.train.export import load_export_policy

    min_kappa = load_export_policy(policy).min_kappa
    result = calibrate(packet, labels, judges)
    write_calibration(result, out_file)
    kappa = result.cohen_kappa.get(OVERALL)
    if json_out:
        emit_json_text(result.model_dump_json())
    else:
        for k in ("coverage", "exact_agreement", "mean_abs_diff", "cohen_kappa"):
            out.print(f"{k}: {safe(getattr(result, k))}", highlight=False)
    if not result.complete:
        raise CheckFailed(f"calibration incomplete: coverage {result.coverage[OVERALL]:.3f}"
                          f" of applicable cells; label every cell 0, 1, 2 or \"na\" in "
                          f"{labels}, then calibrate again (result kept in {out_file})")
    if kappa is None or kappa < min_kappa:
        raise CheckFailed(f"calibration kappa {kappa} is below the export policy's "
                          f"min_kappa {min_kappa} ({policy}); result kept in {out_file}")
