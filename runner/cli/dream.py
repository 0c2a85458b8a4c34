"""``cyclebox dream``: dream variants, measured by a paired off/on run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

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
    from runner.cli.engine import cycle_images, sandbox
    from runner.cycle.dream_compare import paired

    receipt = paired(cycle, out_dir, images=cycle_images(), sandbox=sandbox())
    if json_out:
        emit_json(receipt.model_dump(mode="json", by_alias=True))
        return
    t = Table(title="dream off vs on", show_header=True)
    for c in ("", "off", "on"):
        t.add_column(c)
    off, on = receipt.arms.off, receipt.arms.on
    for label, key in (("verdict", "verdict"), ("model calls", "model_calls"),
                       ("cost USD", "cost_usd")):
        t.add_row(label, _shown(getattr(off, key)), _shown(getattr(on, key)))
    for side in ("baseline", "candidate"):
        counts = [getattr(a.heldout, side) for a in (off, on)]
        t.add_row(f"held-out {side}", *[safe(f"{c.passed if c else None}/"
                                             f"{c.total if c else None}", 200) for c in counts])
    d = on.dream
    t.add_row("dream", "-", safe(f"{d.accepted if d else None}/{d.requested if d else None} "
                                 f"accepted; reasons "
                                 f"{ {k: v for k, v in (d.reasons if d else {}).items() if v} }"))
    out.print(t)
    inc = receipt.incremental_cost_usd
    out.print(safe(f"held-out delta {_shown(receipt.heldout_delta)}, incremental cost "
                   f"{'unknown' if inc is None else f'{inc} USD'}; {receipt.claim}"),
              highlight=False)
    out.print(f"receipt: {safe(out_dir / 'dream-receipt.json')}", highlight=False)


def _shown(v: Any) -> str:
    """A figure for the terminal: ``unknown`` for a missing value, never ``None``."""
    return "unknown" if v is None else safe(v, 200)
