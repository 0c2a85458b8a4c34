"""Upstream definitions: which provider, where, with which credential *name*.

Only names and paths of credentials live here (and so in plans and receipts);
the value is read on the host by :func:`read_credential` when the gateway starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from runner.errors import ConfigError, PrerequisiteError
from runner.isolation.sandbox import Frozen


class CredentialSource(Frozen):
    """Where the host reads a provider key: exactly one of an env var name or a file path."""

    env: str | None = None
    """Name of a host environment variable holding the key."""
    file: str | None = None
    """Path of a host file holding the key (first line)."""

    @model_validator(mode="after")
    def _one(self) -> CredentialSource:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env or file")
        return self

    def describe(self) -> str:
        return f"env:{self.env}" if self.env else f"file:{self.file}"


class Price(Frozen):
    """USD per million tokens."""

    input_per_mtok: float = Field(ge=0)
    """USD per million prompt (input) tokens."""
    output_per_mtok: float = Field(ge=0)
    """USD per million completion (output) tokens."""


class GatewayLimits(Frozen):
    """What one container may hold of the gateway through its socket (one binding).

    Every refusal these cause is recorded with a named reason; none lets a container
    grow the controller's memory or disk beyond these bounds.
    """

    max_connections: int = Field(default=16, gt=0, le=4096)
    """Open connections at once; one more is answered 503 ``too_many_connections``."""
    max_header_bytes: int = Field(default=16 * 1024, ge=1024, le=1024 * 1024)
    """Request line plus headers; more is answered 431 ``header_too_large``."""
    header_timeout_s: float = Field(default=10, gt=0)
    """Time to send a complete request head once its first byte arrived (408)."""
    body_timeout_s: float = Field(default=30, gt=0)
    """Time to send the whole body once the head is complete (408 ``body_timeout``)."""
    idle_timeout_s: float = Field(default=30, gt=0)
    """A keep-alive connection with no request for this long is closed (not a call)."""
    max_inflight_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    """Sum of request bodies being read or held by this binding (503 ``inflight_bytes``);
    at least max_request_bytes, or a maximal request could never be admitted."""
    rate_per_s: float = Field(default=50, gt=0)
    """Sustained requests per second (token bucket; 429 ``rate_limited``)."""
    burst: int = Field(default=100, gt=0)
    """Requests allowed at once before the rate applies."""
    body_bytes_per_s: int = Field(default=8 * 1024 * 1024, gt=0)
    """Sustained request-body bytes per second (429 ``byte_rate_limited``): parsing is
    CPU the whole controller shares, so one container cannot starve the others."""
    body_bytes_burst: int = Field(default=16 * 1024 * 1024, gt=0)
    """Body bytes allowed at once; at least max_request_bytes."""
    max_refusal_records: int = Field(default=1000, ge=1)
    """Refusals itemized in the call log per binding; further ones are counted in one
    ``refusals_not_itemized`` record when the socket closes (bounds log growth)."""


class RequestRules(Frozen):
    """Which request fields a role may send upstream; everything else is refused (400)."""

    max_n: int = Field(default=1, ge=1, le=128)
    """Largest ``n`` / ``best_of`` allowed; each choice is reserved at max_tokens."""
    allow_tools: bool = False
    """Function tools (``tools``, ``tool_choice``, ``parallel_tool_calls``); built-in
    tools such as web search are never forwarded by this switch alone."""
    allow_images: bool = False
    """Inline ``data:`` image parts (each reserved at image_token_bound input tokens);
    remote image URLs are always refused (the upstream would fetch them)."""
    image_token_bound: int = Field(default=6000, gt=0)
    """Worst-case input tokens charged for one image part."""
    extra_fields: tuple[str, ...] = ()
    """Extra top-level fields forwarded verbatim, e.g. ``service_tier``, ``store``,
    ``web_search_options``, ``metadata``. Their cost effects are not bounded."""
    token_limit_key: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"  # noqa: S105
    """Which key the gateway sets to the cap when the request names none."""


class UpstreamPolicy(Frozen):
    """One model upstream (target, optimizer or judge)."""

    provider: Literal["openai", "scripted", "replay"]
    """openai: any OpenAI-compatible server; scripted: offline fixture replies from a
    script file; replay: byte-exact answers from a recorded call log."""
    base_url: str | None = None
    """openai: the server's base URL, e.g. https://api.example.com/v1."""
    credential: CredentialSource | None = None
    """openai: where the host reads the key."""
    script: str | None = None
    """scripted: path of the script file (relative paths resolve against the policy file)."""
    replay_from: str | None = None
    """replay: a run directory whose gateway/calls.jsonl is replayed."""
    models: tuple[str, ...] = Field(min_length=1)
    """Model allowlist; any other model is refused and recorded."""
    max_tokens: int = Field(default=4096, gt=0)
    """Cap on max_tokens; set when absent, a larger request is refused."""
    prices: dict[str, Price] = Field(default_factory=dict)
    """Per-model prices; a model without a price has unknown cost."""
    timeout_s: float = Field(default=120, gt=0)
    """Upstream timeout for one call; reaching it is an infra error, never retried."""
    max_request_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    """Largest request body a role may send; a larger one is refused (413) and recorded."""
    max_response_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    """Largest upstream response read; more is an infra error (``response_too_large``)."""
    call_deadline_s: float = Field(default=300, gt=0)
    """Total time one upstream call may take, however slowly bytes trickle in; then it
    is an infra error (``upstream_deadline``), recorded, never retried."""
    limits: GatewayLimits = GatewayLimits()
    """Per-container socket limits (connections, header size, body time, in-flight
    bytes, request rate)."""
    rules: RequestRules = RequestRules()
    """Request fields the role may use (n, tools, images, extra fields)."""

    @model_validator(mode="after")
    def _provider_fields(self) -> UpstreamPolicy:
        need = {"openai": ("base_url", "credential"), "scripted": ("script",),
                "replay": ("replay_from",)}[self.provider]
        missing = [f for f in need if getattr(self, f) is None]
        if missing:
            raise ValueError(f"provider {self.provider} needs {', '.join(missing)}")
        if self.limits.body_bytes_burst < self.max_request_bytes:
            raise ValueError(f"limits.body_bytes_burst ({self.limits.body_bytes_burst}) "
                             f"must be at least max_request_bytes ({self.max_request_bytes})")
        if self.limits.max_inflight_bytes < self.max_request_bytes:
            raise ValueError(f"limits.max_inflight_bytes ({self.limits.max_inflight_bytes}) "
                             f"must be at least max_request_bytes ({self.max_request_bytes})")
        return self


def read_credential(name: str, src: CredentialSource) -> str:
    """The key's value, read on the host only; PrerequisiteError naming the source if absent."""
    if src.env is not None:
        value = os.environ.get(src.env, "")
        if not value:
            raise PrerequisiteError(f"upstream {name}: credential env var {src.env} is not set. "
                                    f"Fix: export {src.env}=... on the host (never in a role).")
        return value
    assert src.file is not None  # noqa: S101 - guaranteed by the validator
    try:
        value = Path(src.file).expanduser().read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        raise PrerequisiteError(f"upstream {name}: credential file {src.file} is missing or "
                                "empty. Fix: write the key on its first line.") from None
    if not value:
        raise PrerequisiteError(f"upstream {name}: credential file {src.file} is empty")
    return value


def resolve_path(value: str, *, base: Path) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def check_script(path: Path, *, field: str) -> None:
    if not path.is_file():
        raise ConfigError(f"script {path} does not exist", field=field,
                          fix="point to a scripted-provider YAML file")
