"""``cyclebox model`` and ``cyclebox train``: local base models, LoRA training in the
trainer image."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from runner.cli.engine import trainer
from runner.cli.options import JsonOpt, OutOpt
from runner.cli.output import err, out
from runner.errors import CheckFailed
from runner.paths import state_dir
from runner.termsafe import emit_json, safe
from runner.train.flags import EPOCHS_MAX, LR_MAX, SEED_MAX, check_seed, check_train_flags

model_app = typer.Typer(no_args_is_help=True, help="Local base models.")
app = typer.Typer(no_args_is_help=True, help="CPU LoRA training in the trainer image.")
BaseOpt = Annotated[Path, typer.Option("--base-model", help="Local model directory.")]
# Numeric flags are checked by runner.train.flags (exit 3 naming the flag, nothing made)
# before the trainer is looked up, an engine asked or --out created.
SeedOpt = Annotated[int, typer.Option("--seed", help=f"Random seed, 0..{SEED_MAX}.")]
LrOpt = Annotated[float, typer.Option(
    "--lr", help=f"Learning rate: finite, greater than 0, at most {LR_MAX:g}.")]


MAX_STEPS = 10**9
"""Most training steps a progress event may count."""


class _Bar:
    """Shows trainer progress events as a bar."""

    def __init__(self, progress: Progress, label: str) -> None:
        self.p = progress
        self.task = progress.add_task(label, total=None)

    def __call__(self, ev: dict[str, Any]) -> None:
        if ev.get("event") == "start":
            # Trainer events come from a container: shown escaped and capped.
            self.p.console.print(safe(f"rows {ev.get('rows')}, epochs {ev.get('epochs')}, "
                                      f"grad-accum {ev.get('grad_accum')}, threads "
                                      f"{ev.get('threads')}", 300), highlight=False)
        elif ev.get("event") == "progress":
            step, total = ev.get("step"), ev.get("total")
            if not all(type(v) is int for v in (step, total)) or not (
                    0 <= step <= total <= MAX_STEPS):  # type: ignore[operator]
                return  # a bad count is not drawn (it broke the bar at exit, code lost)
            self.p.update(self.task, completed=step, total=total,
                          description=safe(f"loss {ev.get('loss')}", 40, newlines=False))


def _progress(json_out: bool) -> Progress:
    return Progress(TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=err, disable=json_out)


@model_app.command("tiny")
def model_tiny(out_dir: OutOpt, seed: SeedOpt = 0, json_out: JsonOpt = False) -> None:
    """Create a tiny Llama-style model and BPE tokenizer offline (in the trainer image)."""
    from runner.train.host import make_tiny

    check_seed(seed)
    info = make_tiny(trainer(), out_dir, lambda _e: None, seed=seed)
    if json_out:
        emit_json(info.model_dump(mode="json"))
    else:
        out.print(safe(f"tiny model in {out_dir}: {info.parameters} parameters, vocab "
                  f"{info.vocab}"), highlight=False)


@app.command("proof")
def train_proof(persona: Annotated[Path, typer.Option(help="Persona/skill script (YAML).")],
                base_model: BaseOpt, out_dir: OutOpt,
                ledger: Annotated[Path | None, typer.Option(
                    help="Feedback ledger (default build/train/ledger.jsonl).")] = None,
                lr: LrOpt = 5e-3, seed: SeedOpt = 0, json_out: JsonOpt = False) -> None:
    """Train a LoRA adapter on a persona and prove it imprinted.

    Exit 4 (check failed) when nothing imprinted (the classroom failed) or when the
    adapter did not reproduce its answers in a fresh process; the adapter, receipt and
    ledger row are kept either way. Exit 3 before any training for a numeric flag out of
    range, a --ledger that cannot be appended to (a directory, device, FIFO, read-only)
    or an OUT.summary.json that exists (even as a link);
    a ledger that refuses the row after the training is exit 3 (9 when the disk is full)
    naming it, with the adapter and receipt kept in --out."""
    from runner.train.host import check_ledger, proof

    check_train_flags(seed=seed, lr=lr)
    ledger = ledger or state_dir() / "train" / "ledger.jsonl"
    check_ledger(ledger)  # before the training, not after it
    with _progress(json_out) as p:
        summary = proof(trainer(), persona, base_model, out_dir, ledger=ledger, lr=lr, seed=seed,
                        on_event=_Bar(p, "training"))
    r = summary.report
    if json_out:
        emit_json(summary.model_dump(mode="json", by_alias=True, exclude={"trainer_run"}))
    else:
        out.print(safe(f"recall {r.recall_before:.2f} -> {r.recall_after:.2f}; imprint "
                  f"{r.scores.model_dump()}; classroom "
                  f"{'passed' if r.classroom_passed else 'FAILED'}; "
                  f"board {r.board.decision} {r.board.members}; reproduced in a "
                  f"fresh process: {summary.reproduced_in_fresh_process}"), highlight=False)
        out.print(safe(f"adapter: {out_dir / 'adapter'}; receipt: "
                       f"{out_dir / 'train-receipt.json'}"), highlight=False)
    if summary.exit_code == 4:
        raise CheckFailed(f"nothing imprinted: the classroom failed (board "
                          f"{r.board.decision}); receipt in {out_dir}")
    if not summary.reproduced_in_fresh_process:
        raise CheckFailed("the adapter did not reproduce its answers in a fresh process; "
                          f"receipt in {out_dir}")


@app.command("sft")
def train_sft(corpus: Annotated[Path, typer.Option(help="Exported corpus directory.")],
              base_model: BaseOpt, out_dir: OutOpt, lr: LrOpt = 5e-3, seed: SeedOpt = 0,
              epochs: Annotated[int | None, typer.Option(
                  help=f"Override the epochs derived from the row count (1..{EPOCHS_MAX})."
              )] = None,
              include_failed: Annotated[bool, typer.Option(
                  "--include-failed", help="Also learn from trajectories that failed "
                  "(r_outcome 0) or were not graded (null). Default: only r_outcome == 1.")]
              = False,
              json_out: JsonOpt = False) -> None:
    """Supervised LoRA fine-tuning on an exported corpus (same container rules, same receipt).

    Learns only from trajectories that passed (r_outcome == 1) unless --include-failed;
    the choice and the counts are in train-receipt.json under "selection". The adapter's
    adapter_config.json names --base-model as resolved on this host, so
    AutoPeftModelForCausalLM.from_pretrained(OUT/adapter) works here; the receipt also
    records the container's path. Outputs are owned by the invoking user (SUDO_UID when
    run with sudo), directories 0755 and files 0644.

    Exit codes: 0 trained; 3 bad input (no corpus, no model, a numeric flag out of
    range, nothing passed the selection); 5 prerequisite (trainer image); 6 engine or
    trainer failure; 8 the adapter files differ from the receipt."""
    from runner.train.host import sft

    check_train_flags(seed=seed, lr=lr, epochs=epochs)
    with _progress(json_out) as p:
        receipt = sft(trainer(), corpus, base_model, out_dir, lr=lr, seed=seed, epochs=epochs,
                      on_event=_Bar(p, "training"), include_failed=include_failed)
    if json_out:
        emit_json(receipt.model_dump(mode="json", by_alias=True))
    else:
        f, sel = receipt.figures, receipt.selection
        out.print(safe(f"learned from {sel.used} of {sel.trajectories} trajectories "
                       f"({sel.rule}; by r_outcome {sel.by_r_outcome}), {sel.rows} rows"),
                  highlight=False)
        out.print(safe(f"trained {f.steps} steps, {f.tokens_per_s} tokens/s, final loss "
                       f"{f.final_loss}; receipt {out_dir / 'train-receipt.json'}"),
                  highlight=False)
