"""The files the sandbox code and the agent exchange with the controller, as typed values.

These models document formats that ``sandbox/`` reads and writes with the standard library
(it never imports ``runner``); unit tests check each model against that code. They are
served by ``cyclebox schema`` and described in docs/contracts.md.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from runner.isolation.sandbox import Frozen

AGENT_ENV: dict[str, str] = {
    "CYCLEBOX_MODEL": "the model to request: the first entry of the target upstream's models",
    "CYCLEBOX_CASE_ID": "the scenario id of this case",
    "CYCLEBOX_TRIAL": "the zero-based trial number",
    "CYCLEBOX_SEED": "the trial's seed from the plan (cycle file seeds, default the trial)",
    "CYCLEBOX_GATEWAY_DIR": "where sandbox.gateway_client finds the gateway socket and token "
                            "(default /run/cyclebox/gateway)",
    "OPENAI_BASE_URL": "http://127.0.0.1:40080/v1: the container's own gateway endpoint",
    "OPENAI_API_BASE": "the same, for frameworks that read the older name",
    "OPENAI_API_KEY": "the per-run, per-role gateway token (never a provider key)",
    "ANTHROPIC_BASE_URL": "http://127.0.0.1:40080: the same endpoint, for the Anthropic SDK",
    "ANTHROPIC_API_KEY": "the same per-run, per-role gateway token",
    "CYCLEBOX_GATEWAY_URL": "http://127.0.0.1:40080",
}
"""Environment of the analyst container beyond the role policy's own ``env``."""

AGENT_MOUNTS: dict[str, str] = {
    "/src": "the agent's source tree (project.subdir at base_ref, or the candidate), read-only",
    "/case/input.json": "the scenario's input object, read-only",
    "/data": "the cycle's data_dir, read-only",
    "/out": "a fresh, empty, writable directory; write answer.json here",
    "/run/cyclebox/gateway": "the gateway socket and a per-run token (never a provider key)",
    "/tmp": "a small tmpfs (size in the role policy); everything else is read-only",  # noqa: S108
}
"""What the analyst container sees (docs/contracts.md)."""


class Answer(BaseModel):
    """``/out/answer.json``, written by the agent for each case, at most 256 KiB (as read
    and as the records store it, written compactly); other keys are kept in the record
    (e.g. the raw model reply, an error) but not graded."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)

    answer: float | str | None = None
    """The answer, compared by the case's scorer (docs/scorers.md): a number for a number
    reference (within its tolerance), text for a text reference (`kind: text` means the
    `normalized` scorer: equal after Unicode normalisation, case folding and whitespace
    collapsing; `contains` is the opt-in substring test), null when refusing."""
    refused: bool = False
    """true when the agent declines the request; a refuse reference needs exactly this."""
    evidence: list[str] = Field(default_factory=list)
    """What the answer rests on (queries, table names, fact ids): at most 16 strings; every
    entry of the reference's evidence must occur in one of them as whole words, and
    citing many entries the case does not need fails the evidence criterion."""


class BaseFile(Frozen):
    """One editable file as the worker receives it."""

    path: str
    """Path relative to the source tree (one of edit.paths)."""
    content: str
    """The file's content at base_ref; empty for a file that does not exist yet."""
    sha256: str | None
    """sha256 of the file at base_ref; null for a file that does not exist yet."""


class WorkerRequest(Frozen):
    """``/in/request.json`` of the worker container (the propose stage)."""

    brief: str
    """Markdown failure brief built from development-split failures only."""
    files: tuple[BaseFile, ...]
    """The current content of every path the edit may change."""
    paths: tuple[str, ...]
    """This cycle's exact path set (edit.paths)."""
    allowlist: tuple[str, ...]
    """Globs every changed path must match (edit.allowlist)."""
    model: str
    """The optimizer model to call (worker.model)."""
    max_tokens: int = Field(gt=0)
    """Cap on the reply (worker.max_tokens)."""


class ReplyFile(Frozen):
    """One replaced file in the worker model's reply."""

    path: str
    """One of the request's paths."""
    content: str
    """The whole new content of the file."""


class WorkerReply(Frozen):
    """What the optimizer model must reply to the worker: one JSON object (optionally in one
    Markdown code fence) with exactly these keys. Anything else is refused as
    ``malformed_proposal``; a path outside the request's paths or allowlist is refused by
    name. The worker turns it into ``proposal.json``."""

    files: tuple[ReplyFile, ...]
    """The files to replace, each at most once."""
    rationale: str = ""
    """One paragraph: what changed and why."""
