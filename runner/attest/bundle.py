"""``receipt attest``: verify a run, make its Statements, sign them, write the bundle once.

Order is the contract: the key is loaded and the destination checked first (bad input,
exit 3, nothing read); then the receipt must verify in full (exit 8 otherwise, nothing
written); only then are the Statements made, from the files the receipt binds. The bundle
is written to a temporary file beside the target, synced, and *linked* into place:
``link`` fails when the target exists, so an existing bundle is never replaced, and a
reader never sees a half-written one (a full disk, a read-only directory or Ctrl-C leave
no file behind).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.attest.evaluation import RunFacts, evaluation_statement
from runner.attest.provenance import provenance_statement
from runner.attest.statement import Statement, envelope
from runner.cycle import keys
from runner.cycle.plan import read_plan_doc
from runner.cycle.receipt import (
    BUNDLE_SUFFIX,
    RECEIPT,
    RECEIPT_FIX,
    SCHEMA,
    Receipt,
    verify,
)
from runner.errors import ConfigError, IntegrityError
from runner.loading import MAX_BYTES, load_data, parse_model, read_capped, show
from runner.outdir import run_holding, write_once

BUNDLE = "receipt" + BUNDLE_SUFFIX
"""Default bundle name, beside receipt.json (in-toto's ``.intoto.jsonl`` convention)."""


@dataclass(frozen=True)
class Attested:
    """What ``attest`` wrote."""

    path: Path
    keyid: str
    keytype: str
    statements: tuple[Statement, ...]


def _target(run_dir: Path, out: Path | None) -> Path:
    """The bundle path, refused before any work when it cannot be written once."""
    path = out if out is not None else run_dir / BUNDLE
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"{show(str(parent))} is not a directory", path=show(str(path)),
                          field="--out", fix="create the directory first or pick another path")
    if path.exists() or path.is_symlink():
        raise ConfigError(f"{show(str(path))} exists; an attestation bundle is never "
                          "overwritten", field="--out", fix="give a new --out path (or keep "
                          "the bundle you have)")
    inside = run_holding(path)
    if inside is not None and inside != Path(os.path.realpath(parent)):
        raise ConfigError(f"{show(str(path))} is inside the run {show(str(inside))}, whose "
                          "receipt binds every file below its top level (receipt verify "
                          "would fail)", field="--out",
                          fix=f"write it at the run's top level (a name ending "
                              f"{BUNDLE_SUFFIX}) or outside the run")
    if inside is not None and not path.name.endswith(BUNDLE_SUFFIX):
        # at the top level of this run or of another: only a bundle's name is not bound
        raise ConfigError(f"{show(path.name)} in a run directory would be a file its receipt "
                          "does not name (receipt verify would fail)", field="--out",
                          fix=f"end the name with {BUNDLE_SUFFIX}, or write outside the run")
    return path


def _facts(run_dir: Path) -> RunFacts:
    """Everything the Statements are made of; only called once verify found no problem."""
    from runner.report import build_report

    raw = read_capped(run_dir / RECEIPT, max_bytes=MAX_BYTES, what="receipt", fix=RECEIPT_FIX)
    receipt = parse_model(raw, Receipt, path=show(str(run_dir / RECEIPT)), schema=SCHEMA,
                          fix=RECEIPT_FIX)
    plan = read_plan_doc(run_dir / "plan.json")
    result: dict[str, Any] = {}
    if "stages/apply/result.json" in receipt.files:
        doc = load_data(run_dir / "stages/apply/result.json", fmt="json",
                        what="apply result")
        result = doc if isinstance(doc, dict) else {}
    run_ids = {c.run_id for c in receipt.containers}
    run_id = run_ids.pop() if len(run_ids) == 1 else f"{plan.plan.name}-{plan.plan_hash[:10]}"
    return RunFacts(run_dir=run_dir, receipt=receipt,
                    receipt_sha256=hashlib.sha256(raw).hexdigest(), plan=plan,
                    # attest verified the run just before (verify, in full)
                    report=build_report(run_dir, verified=True), apply_result=result,
                    run_id=run_id)


def statements(run_dir: Path) -> tuple[Statement, ...]:
    """The run's Statements (evaluation, then provenance when there is a candidate)."""
    facts = _facts(run_dir)
    prov = provenance_statement(facts)
    return (evaluation_statement(facts),) + ((prov,) if prov is not None else ())


def attest(run_dir: Path, key_path: Path, out: Path | None = None) -> Attested:
    """Write the run's attestation bundle signed by ``key_path``; see the module docstring."""
    if not run_dir.is_dir():
        raise ConfigError(f"{show(str(run_dir))} is not a directory", field="RUN",
                          fix=RECEIPT_FIX)
    key = keys.load_private(key_path)
    path = _target(run_dir, out)
    problems = verify(run_dir)
    if problems:
        shown = "; ".join(show(p) for p in problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise IntegrityError(f"{show(str(run_dir))}: the receipt does not verify, so nothing "
                             f"is attested: {shown}{more}. Fix: `cyclebox receipt verify "
                             f"{show(str(run_dir))}` names every problem")
    made = statements(run_dir)
    lines = [json.dumps(envelope(s, key), sort_keys=True, separators=(",", ":"))
             for s in made]
    write_once(path, ("\n".join(lines) + "\n").encode(), what="an attestation bundle",
               field="--out", fix="give a new --out path")
    info = keys.describe(key.public_key())
    return Attested(path=path, keyid=info.keyid, keytype=info.scheme, statements=made)
