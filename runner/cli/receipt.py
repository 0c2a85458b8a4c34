"""``cyclebox receipt``: sign, verify and compare run receipts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from runner.cli.options import JsonOpt
from runner.cli.output import err, out
from runner.errors import EXIT_INTEGRITY, EXIT_OK, CycleboxError
from runner.termsafe import emit_json, safe

app = typer.Typer(no_args_is_help=True, help="Verify and compare receipts.")


@app.command("keygen")
def receipt_keygen(out_key: Annotated[Path, typer.Option("--out", help="Private key file.")]
                   ) -> None:
    """Create an Ed25519 signing key (0600) and KEY.pub."""
    from runner.cycle.signing import keygen

    pub = keygen(out_key)
    out.print(f"private key {safe(out_key)} (keep it off shared machines); public key "
              f"{safe(pub)}", highlight=False)


@app.command("sign")
def receipt_sign(run_dir: Annotated[Path, typer.Argument(help="A cycle run directory.")],
                 key: Annotated[Path, typer.Option(help="Ed25519 private key (PEM).")]) -> None:
    """Sign receipt.json into a DSSE envelope (receipt.dsse.json)."""
    from runner.cycle.signing import sign

    env = sign(run_dir, key)
    out.print(f"signed: {safe(env)}", highlight=False)


@app.command("verify")
def receipt_verify(run_dir: Annotated[Path, typer.Argument(help="A cycle run directory.")],
                   pubkey: Annotated[Path | None, typer.Option(
                       help="Also require a valid DSSE signature by this Ed25519 key.")] = None,
                   json_out: JsonOpt = False) -> None:
    """Re-hash every file the receipt names (and check its signature with --pubkey);
    exit 8 naming each mismatch."""
    from runner.cycle.receipt import verify

    problems = verify(run_dir)
    if pubkey is not None:
        from runner.cycle.signing import load_public, verify_signature

        try:
            verify_signature(run_dir, load_public(pubkey))
        except CycleboxError as exc:  # one more problem, listed with the hash mismatches
            problems.append(str(exc))
    if json_out:
        emit_json({"ok": not problems, "problems": problems})
    else:
        for p in problems:
            err.print(f"[red]mismatch:[/] {safe(p)}", highlight=False)
        out.print("receipt verified: every named file matches and no other file is present"
                  if not problems else f"receipt verification FAILED ({len(problems)} "
                                       "problem(s))", highlight=False)
    raise typer.Exit(EXIT_OK if not problems else EXIT_INTEGRITY)


@app.command("compare")
def receipt_compare(recorded: Annotated[Path, typer.Argument(help="Recorded run dir.")],
                    replayed: Annotated[Path, typer.Argument(help="Replayed run dir.")]) -> None:
    """Show that two runs' receipts have equal input and outcome hashes (timings aside)."""
    from runner.cycle.receipt import load_receipt, replay_hashes

    rows = replay_hashes(load_receipt(recorded), load_receipt(replayed))
    t = Table(title="recorded vs replayed")
    for c in ("hash", "recorded", "replayed", "equal"):
        t.add_column(c, overflow="fold")

    def short(v: Any) -> str:
        return v[:16] if isinstance(v, str) else json.dumps(v, sort_keys=True)[:24]

    for k, a, b in rows:
        t.add_row(safe(k, 200), safe(short(a)), safe(short(b)),
                  "[green]yes[/]" if a == b else "[red]NO[/]")
    out.print(t)
    raise typer.Exit(EXIT_OK if all(a == b for _, a, b in rows) else EXIT_INTEGRITY)
