"""``cyclebox gateway calls``: a run's recorded model calls."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from runner.cli.options import JsonOpt
from runner.cli.output import out
from runner.errors import ConfigError, IntegrityError
from runner.loading import show
from runner.termsafe import emit_json, safe

RUN_MARKERS = ("plan.json", "receipt.json", "containers.jsonl")
"""Files only a run directory holds: such a directory without a call log made no call."""

app = typer.Typer(no_args_is_help=True, help="Inspect the model gateway's call log.")


def _receipt_files(run_dir: Path) -> dict[str, str] | None:
    """The files the run's receipt binds; None when the run has no receipt."""
    from runner.cycle.receipt import (
        RECEIPT,
        RECEIPT_FIX,
        SCHEMA,
        ReceiptHead,
        read_receipt_bytes,
    )
    from runner.loading import parse_model

    if not os.path.lexists(run_dir / RECEIPT):  # a link, even a dangling one, is there
        return None
    raw = read_receipt_bytes(run_dir)  # never through a link: IntegrityError (exit 8)
    return parse_model(raw, ReceiptHead, path=show(str(run_dir / RECEIPT)), fix=RECEIPT_FIX,
                       schema=SCHEMA).files


@app.command("calls")
def gateway_calls(run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
                  json_out: JsonOpt = False) -> None:
    """List every recorded model call of a run, with per-role totals and completeness."""
    from runner.cycle.receipt import sha256_in_run
    from runner.gateway.calllog import CallLog
    from runner.gateway.report import summarize

    log_dir = run_dir / "gateway"
    log = log_dir / "calls.jsonl"
    try:
        mode: int | None = os.lstat(log).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise IntegrityError(f"{log}: cannot inspect the call log ({exc.strerror})") from None
    unconfirmed = False
    if mode is not None and not stat.S_ISREG(mode):
        raise IntegrityError(f"{log} is not a regular file (a link, directory or device); "
                             "the run's call log cannot be read")
    if mode is None:
        if not any((run_dir / marker).is_file() for marker in RUN_MARKERS):
            raise ConfigError("calls.jsonl not found", path=str(log), field="RUN_DIR",
                              fix="pass a run directory (e.g. build/runs/<id>)")
        named = _receipt_files(run_dir)
        if named is not None and "gateway/calls.jsonl" in named:
            raise IntegrityError(f"{log} is missing; the run's receipt recorded it, so the "
                                 "run made calls that can no longer be listed")
        unconfirmed = named is None
        records = []  # a run whose roles reached no model: no gateway log at all
    else:
        named = _receipt_files(run_dir)
        unconfirmed = named is None
        if named is not None and (want := named.get("gateway/calls.jsonl")) != \
                sha256_in_run(run_dir, "gateway/calls.jsonl"):
            raise IntegrityError(
                f"run_altered: {show(str(log))} is not the call log the run's receipt binds "
                + ("(the receipt names no call log)" if want is None else "(its sha256 "
                   "differs)") + "; `cyclebox receipt verify` lists every change")
        records = CallLog.reader(log_dir).records()
    totals = summarize(records)
    if json_out:
        emit_json({"calls": [r.model_dump(mode="json") for r in records],
                   "totals": totals.model_dump(mode="json"), "verified": not unconfirmed})
        return
    if not records:
        out.print(f"no model calls recorded in {safe(run_dir)}"
                  + (" (the run has no receipt to confirm it made none)" if unconfirmed
                     else ""), highlight=False)
        return
    table = Table(title=f"model calls: {safe(log_dir)}")
    for col in ("seq", "role", "stage", "case", "trial", "turn", "api", "model", "status",
                "tokens", "cost", "ms"):
        table.add_column(col)
    for r in records:
        tokens = str(r.usage.total_tokens) if r.usage else "?"
        cost = "unknown" if r.cost_usd is None else f"{r.cost_usd:.6f}" + (
            " (bound)" if r.cost_basis == "upper_bound" else "")
        status = r.status + (f" ({r.error})" if r.error else "") + (" [fixture]" if r.fixture
                                                                       else "")
        cells = (str(r.seq), r.role, r.stage, r.case or "-",
                 "-" if r.trial is None else str(r.trial), str(r.turn), r.api or "-",
                 r.model or "-",
                 status, tokens, cost, f"{r.latency_s * 1000:.1f}")
        table.add_row(*(safe(c, 500) for c in cells))
    out.print(table)
    if unconfirmed:
        out.print("not verified: the run has no receipt (a run in progress, or one whose "
                  "receipt is gone): these calls are as the log says", highlight=False)
    for role, row in totals.per_role.items():
        usd = "unknown" if row.cost_usd is None else f"{row.cost_usd} USD"
        fixture = sum(r.fixture for r in records if r.role == role)
        out.print(safe(f"{role}: {row.calls} calls, {row.tokens} tokens, {usd}, "
                       f"complete={row.complete}"
                       + (f", {row.bounded_calls} bounded (no usage: charged the worst "
                          "case, not measured)" if row.bounded_calls else "")
                       + (f", {fixture} fixture (scripted, not billed)" if fixture else "")),
                  highlight=False)
