"""Typed values of training: the persona the operator gives, and what the trainer container
writes back (``train-receipt.json``, ``report.json``, ``ledger-row.json``,
``cyclebox-tiny.json``) as the host reads it.

The trainer's files are container output: each is read through :mod:`runner.loading`
(bounded, strict JSON) into these models, and a shape the trainer never writes is an
error naming the field. The summaries the host writes from them (``OUT.summary.json``)
are ``model_dump(mode="json")`` of these models, so field names and values are the
container's own; numbers the trainer writes as floats are typed ``float`` and counts
``int``, so nothing is converted on the way through.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, JsonValue

from runner.isolation.sandbox import Frozen

# -- operator input ---------------------------------------------------------------------------


class Exchange(Frozen):
    """One question and the reply the persona must learn."""

    user: str
    assistant: str


class Persona(Frozen):
    """A persona/skill script for the proof loop (``examples/persona/captain.yaml``)."""

    name: str = Field(min_length=1)
    """Names the persona in the ledger (the schedule looks up its last row)."""
    system: str = ""
    """System prompt used for every training row and probe."""
    exchanges: tuple[Exchange, ...] = Field(min_length=1)
    """One training row each; recall is probed on their questions."""
    voice_examples: tuple[str, ...] = ()
    """Extra rows in the persona's voice."""


PERSONA_FIX = ("a YAML mapping with name, exchanges [{user, assistant}] and optionally "
               "system and voice_examples (see examples/persona/captain.yaml)")


# -- what the trainer writes ------------------------------------------------------------------


class ImprintScores(Frozen):
    """Similarity to the reference replies before and after training (sandbox.train.plan)."""

    similarity_before: float
    similarity_after: float
    imprint_delta: float
    changed: float
    """How much the answers changed (1 - similarity of before and after)."""


class Board(Frozen):
    members: dict[str, Literal["approve", "reject"]]
    """Member (recall, imprint, stability) -> vote."""
    decision: Literal["approve", "reject", "dispute"]


class Schedule(Frozen):
    epochs: int
    grad_accum: int
    reason: str


class TrainFigures(Frozen):
    """What one training run measured (sandbox.train.lora.train)."""

    steps: int
    epochs: int
    grad_accum: int
    lr: float
    train_tokens: int
    seconds: float
    tokens_per_s: float | None
    final_loss: float
    peak_rss_mb: float


class Selection(Frozen):
    """Which exported trajectories an SFT run learned from, with the counts."""

    include_failed: bool
    rule: str
    trajectories: int
    by_r_outcome: dict[str, int]
    used: int
    left_out: int
    rows: int
    rows_with_special_tokens: int = 0
    """Rows left out: a text of theirs holds one of the tokenizer's special tokens."""


class BaseModelPaths(Frozen):
    host_path: str | None
    """The base model directory on the host (the adapter names it)."""
    container_path: str


class _TrainReceipt(Frozen):
    """``train-receipt.json``: sha256 of the config, the dataset and every adapter file."""

    schema_: int = Field(alias="schema")
    config: dict[str, JsonValue]
    """The run's configuration as the trainer used it."""
    config_sha256: str
    dataset_sha256: str
    adapter_files: dict[str, str]
    """Adapter file -> sha256; the host checks them against the files written."""
    base_model_files: dict[str, str]


class ProofReceipt(_TrainReceipt):
    kind: Literal["proof"]
    recall_before: float
    recall_after: float
    scores: ImprintScores
    classroom_passed: bool
    board: Literal["approve", "reject", "dispute"]


class SftReceipt(_TrainReceipt):
    kind: Literal["sft"]
    figures: TrainFigures
    selection: Selection
    base_model: BaseModelPaths
    corpus_sha256: str


TrainReceipt = Annotated[ProofReceipt | SftReceipt, Field(discriminator="kind")]


MAX_ANSWER_CHARS = 2048
"""Longest probe answer the host scores: the trainer generates 48 new tokens (the host
writes its config), and the similarity it recomputes grows with the cube of an answer's
length in the worst case; a longer answer is refused, not scored for minutes."""
Answer = Annotated[str, Field(max_length=MAX_ANSWER_CHARS)]


class ProofReport(Frozen):
    """The proof loop's ``report.json``."""

    persona: str
    schedule: Schedule
    figures: TrainFigures
    probes: tuple[str, ...]
    references: tuple[str, ...]
    before: tuple[Answer, ...]
    """Answers to the probes before training."""
    after: tuple[Answer, ...]
    recall_before: float
    recall_after: float
    scores: ImprintScores
    classroom_passed: bool
    board: Board


class LedgerRow(Frozen):
    """One line the proof loop appends to the ledger (the next schedule reads it)."""

    persona: str
    passed: bool
    rows: int
    epochs: int
    grad_accum: int
    imprint_delta: float
    recall_before: float
    recall_after: float
    board: Literal["approve", "reject", "dispute"]


class TinyModel(Frozen):
    """``cyclebox-tiny.json`` beside the tiny model the trainer made."""

    parameters: int
    vocab: int
    hidden: int
    layers: int
    seed: int


class ProofSummary(Frozen):
    """``OUT.summary.json`` of ``cyclebox train proof`` (and its ``--json`` output)."""

    exit_code: int | None
    """The proof container's exit code: 0 passed, 4 nothing imprinted."""
    report: ProofReport
    receipt: ProofReceipt
    reproduced_in_fresh_process: bool
    """A fresh container loaded the adapter and reproduced the recorded answers."""
    ledger: str
    ledger_row: LedgerRow
    trainer_run: dict[str, JsonValue]
    """The proof container's run record (without its stdout tail)."""
