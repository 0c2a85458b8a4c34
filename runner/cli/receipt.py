"""``cyclebox receipt``: sign, attest, verify and compare run receipts."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from runner.cli.options import JsonOpt
from runner.cli.output import err, out
from runner.errors import EXIT_INTEGRITY, EXIT_OK, ConfigError, CycleboxError
from runner.loading import show
from runner.termsafe import emit_json, safe

app = typer.Typer(no_args_is_help=True,
                  help="Sign, attest (in-toto / SLSA), verify and compare receipts.")


class KeyKind(StrEnum):
    ed25519 = "ed25519"
    ecdsa_p256 = "ecdsa-p256"


@app.command("keygen")
def receipt_keygen(out_key: Annotated[Path, typer.Option("--out", help="Private key file.")],
                   kind: Annotated[KeyKind, typer.Option(
                       "--type", help="ed25519, or ecdsa-p256 (what cosign verifies).")
                   ] = KeyKind.ed25519) -> None:
    """Create a signing key (PEM, 0600), KEY.pub (PEM) and KEY.pub.json (securesystemslib
    key dict with its keyid)."""
    from runner.cycle.keys import keyid, load_public
    from runner.cycle.signing import keygen

    pub = keygen(out_key, kind.value)
    out.print(f"private key {safe(out_key)} (keep it off shared machines); public key "
              f"{safe(pub)} and {safe(pub)}.json; keyid {keyid(load_public(pub))}",
              highlight=False)


@app.command("sign")
def receipt_sign(run_dir: Annotated[Path, typer.Argument(help="A cycle run directory.")],
                 key: Annotated[Path, typer.Option(
                     help="Ed25519 or ECDSA P-256 private key (PEM).")]) -> None:
    """Sign receipt.json into a DSSE envelope (receipt.dsse.json); only a run that verifies
    (exit 8 otherwise), once."""
    from runner.cycle.signing import sign

    env = sign(run_dir, key)
    out.print(f"signed: {safe(env)}", highlight=False)


@app.command("verify")
def receipt_verify(run_dir: Annotated[Path, typer.Argument(help="A cycle run directory.")],
                   pubkey: Annotated[Path | None, typer.Option(
                       help="Also require a valid receipt.dsse.json signature by this public "
                       "key (PEM, Ed25519 or ECDSA P-256).")] = None,
                   json_out: JsonOpt = False) -> None:
    """Re-hash every file the receipt names (and check its signature with --pubkey);
    exit 8 naming each mismatch."""
    from runner.cycle.receipt import verify
    from runner.cycle.signing import load_public, verify_signature

    # the key first: a mistyped --pubkey is bad input (exit 3), not a failed verification
    pub = load_public(pubkey) if pubkey is not None else None
    problems = verify(run_dir)
    if pub is not None:
        try:
            verify_signature(run_dir, pub)
        except CycleboxError as exc:  # one more problem, listed with the hash mismatches
            problems.append(str(exc))
    if json_out:
        emit_json({"ok": not problems, "problems": problems})
    else:
        for p in problems:
            err.print(f"[red]mismatch:[/] {safe(p, newlines=False)}", highlight=False)
        ok = ("receipt verified: every named file matches, no other regular file is "
              "present, and every field its files give agrees (links and special files "
              "are not bound)")
        out.print(ok if not problems else
                  f"receipt verification FAILED ({len(problems)} problem(s))", highlight=False)
    raise typer.Exit(EXIT_OK if not problems else EXIT_INTEGRITY)


@app.command("attest")
def receipt_attest(run_dir: Annotated[Path, typer.Argument(help="A cycle run directory.")],
                   key: Annotated[Path, typer.Option(
                       help="Ed25519 or ECDSA P-256 private key (PEM).")],
                   bundle: Annotated[Path | None, typer.Option(
                       "--out", help="Bundle file to create (never overwritten). Default: "
                       "RUN/receipt.intoto.jsonl.")] = None,
                   markdown: Annotated[Path | None, typer.Option(
                       "--markdown", help="Also write the subjects and their digests as "
                       "Markdown (CI step summary).")] = None,
                   json_out: JsonOpt = False) -> None:
    """Write in-toto Statements (cyclebox evaluation, SLSA provenance v1) in DSSE
    envelopes, one a line (.intoto.jsonl), for a run whose receipt verifies; exit 8 and
    write nothing otherwise. See docs/attestations.md."""
    from runner.attest.bundle import attest
    from runner.attest.summary import summary_json, summary_markdown
    from runner.report.files import _write, check_targets

    check_targets(run_dir, markdown=markdown)
    done = attest(run_dir, key, bundle)
    if markdown is not None:
        _write(markdown, summary_markdown(done).encode(), flag="markdown")
    if json_out:
        emit_json(summary_json(done))
        return
    out.print(f"attested: {safe(done.path)} ({len(done.statements)} statements, "
              f"{done.keytype} keyid {done.keyid})", highlight=False)
    for st in done.statements:
        out.print(f"  {safe(st.predicateType)}", highlight=False)
        for s in st.subject:
            digests = ", ".join(f"{safe(k)}:{safe(v)}" for k, v in sorted(s.digest.items()))
            out.print(f"    {safe(s.name or '')}  {digests}", highlight=False)


@app.command("compare")
def receipt_compare(recorded: Annotated[Path, typer.Argument(help="Recorded run dir.")],
                    replayed: Annotated[Path, typer.Argument(help="Replayed run dir.")]) -> None:
    """Show that two runs' receipts have equal input and outcome hashes (timings aside).

    Each run directory is verified against its receipt first (as `receipt verify`, the
    data stores aside: their hashes are compared as inputs): a run changed since its
    receipt is exit 8 and nothing is compared."""
    from runner.cycle.receipt import (
        RECEIPT,
        RECEIPT_FIX,
        SCHEMA,
        Receipt,
        compare_receipts,
        read_receipt_bytes,
        require_unaltered,
    )
    from runner.loading import parse_model

    receipts = []
    for run_dir in (recorded, replayed):
        if not run_dir.is_dir():
            raise ConfigError(f"{show(str(run_dir))} is not a directory", field="DIR",
                              fix=RECEIPT_FIX)
        # read once, never through a link: the bytes verified are the bytes compared
        raw = read_receipt_bytes(run_dir)
        require_unaltered(run_dir, what="only runs that verify are compared", receipt_bytes=raw)
        receipts.append(parse_model(raw, Receipt, path=show(str(run_dir / RECEIPT)),
                                    fix=RECEIPT_FIX, schema=SCHEMA))
    rows = compare_receipts(*receipts)
    t = Table(title="recorded vs replayed")
    for c in ("hash", "recorded", "replayed", "equal"):
        t.add_column(c, overflow="fold")

    def short(v: Any) -> str:
        return v[:16] if isinstance(v, str) else json.dumps(v, sort_keys=True)[:24]

    for r in rows:
        t.add_row(safe(r.key, 200), safe(short(r.recorded)), safe(short(r.replayed)),
                  "[green]yes[/]" if r.equal else "[red]NO[/]")
    out.print(t)
    raise typer.Exit(EXIT_OK if all(r.equal for r in rows) else EXIT_INTEGRITY)
