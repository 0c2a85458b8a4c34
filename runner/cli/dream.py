"""``cyclebox dream``: dream variants, measured by a paired off/on run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from runner.cli.options import JsonOpt, OutOpt
from runner.cli.output import out
from runner.termsafe import emit_json, safe

app = typer.Typer(no_args_is_help=True, help="Dream variants (training-set augmentation).")


@app.command("compare")
def dream_compare(cycle: Annotated[Path, typer.Argument(help="cycle.yaml with dream on")],
                  out_dir: OutOpt, json_out: JsonOpt = False) -> None:
    """Run a cycle with dream off and on and write one paired receipt.

    Same tasks, models and seeds; the receipt holds held-out scores, verdicts,
    acceptance/fallback rates, the held-out delta and the incremental cost."""
    from runner.cli.engine import cycle_images
    from runner.cycle.dream_compare import paired

    receipt = paired(cycle, out_dir, images=cycle_images())
    if json_out:
        emit_json(receipt)
        return
    t = Table(title="dream off vs on", show_header=True)
    for c in ("", "off", "on"):
        t.add_column(c)
    arms = receipt["arms"]
    for label, key in (("verdict", "verdict"), ("model calls", "model_calls"),
                       ("cost USD", "cost_usd")):
        t.add_row(label, safe(arms["off"][key], 200), safe(arms["on"][key], 200))
    for side in ("baseline", "candidate"):
        t.add_row(f"held-out {side}",
                  *[safe(f"{(arms[a]['heldout'][side] or {}).get('passed')}/"
                         f"{(arms[a]['heldout'][side] or {}).get('total')}", 200)
                    for a in ("off", "on")])
    d = arms["on"]["dream"] or {}
    t.add_row("dream", "-", safe(f"{d.get('accepted')}/{d.get('requested')} accepted; reasons "
                                 f"{ {k: v for k, v in (d.get('reasons') or {}).items() if v} }"))
    out.print(t)
    out.print(safe(f"held-out delta {receipt['heldout_delta']}, incremental cost "
                   f"{receipt['incremental_cost_usd']} USD; {receipt['claim']}"), highlight=False)
    out.print(f"receipt: {safe(out_dir / 'dream-receipt.json')}", highlight=False)
