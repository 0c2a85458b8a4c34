"""Upstream definitions: which provider, where, with which credential *name*.

Only names and paths of credentials live here (and so in plans and receipts);
the value is read on the host by :func:`read_credential` when the gateway starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import Field, TypeAdapter, model_validator

from runner.errors import PrerequisiteError
from runner.gateway.calllog import ALL_APIS, ANTHROPIC_APIS, OPENAI_APIS
from runner.isolation.sandbox import Frozen


class CredentialSource(Frozen):
    """Where the host reads a provider key: exactly one of an env var name or a file path."""

    env: str | None = Field(default=None, min_length=1)
    """Name of a host environment variable holding the key."""
    file: str | None = Field(default=None, min_length=1)
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
    """USD per million completion (output) tokens; reasoning tokens are output tokens."""
    cached_input_per_mtok: float | None = Field(default=None, ge=0,
                                                exclude_if=lambda v: v is None)
    """USD per million input tokens read from the provider's prompt cache; default: the
    input price."""
    cache_write_per_mtok: float | None = Field(default=None, ge=0,
                                               exclude_if=lambda v: v is None)
    """USD per million input tokens written to the prompt cache (Anthropic cache creation);
    default: 1.25 times the input price (Anthropic's 5-minute rate; an upstream that bills
    writes as plain input, as OpenAI does, is then charged a little more than it bills,
    never less). The worst case reserves every input token at the dearest input price."""

    cache_write_1h_per_mtok: float | None = Field(default=None, ge=0,
                                                  exclude_if=lambda v: v is None)
    """USD per million input tokens written to Anthropic's 1-hour cache (``cache_control``
    with ``ttl: 1h``); default: twice the input price (Anthropic's rate). A request asking
    for it is reserved at this price when it is the dearest."""

    def cached_input(self) -> float:
        return self.input_per_mtok if self.cached_input_per_mtok is None \
            else self.cached_input_per_mtok

    def cache_write(self) -> float:
        return 1.25 * self.input_per_mtok if self.cache_write_per_mtok is None \
            else self.cache_write_per_mtok

    def cache_write_1h(self) -> float:
        return 2 * self.input_per_mtok if self.cache_write_1h_per_mtok is None \
            else self.cache_write_1h_per_mtok

    def max_input_per_mtok(self, *, cache_1h: bool = False) -> float:
        """The dearest input price; with ``cache_1h`` (the request asks for 1-hour cache
        writes) the 1-hour write price counts too."""
        return max(self.input_per_mtok, self.cached_input(), self.cache_write(),
                   self.cache_write_1h() if cache_1h else 0.0)


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
    """Function tools (``tools``, ``tool_choice``, ``parallel_tool_calls``; Anthropic
    custom tools); server-side tools (web search, file search, code interpreter,
    computer use, MCP, Anthropic server tools) are never forwarded."""
    allow_images: bool = False
    """Inline ``data:`` image parts (each reserved at image_token_bound input tokens);
    remote image URLs are always refused (the upstream would fetch them)."""
    image_token_bound: int = Field(default=50_000, gt=0)
    """Worst-case input tokens charged for one image part. The default covers the
    dearest published rule: gpt-4o-mini at high detail, 2,833 + 5,667 per 512 px tile,
    8 tiles for a 768 x 2048 image = 48,169 tokens (6,000 did not: such a call cost more
    than its reservation). Set it to your model's bound."""
    allow_documents: bool = False
    """Inline files the upstream reads page by page (Anthropic ``document`` blocks with a
    base64 source, Responses ``input_file`` with ``file_data``: PDFs), each reserved at
    document_token_bound input tokens. Their bytes do not bound their tokens (a 1 KB PDF
    of 100 blank pages is billed per page) and a page may be sent as an image too.
    Plain-text documents (a ``text`` or ``content`` source) are text, always allowed."""
    document_token_bound: int = Field(default=300_000, gt=0)
    """Worst-case input tokens charged for one such document (the default: 100 pages of
    3,000 tokens, text and page image; set it to your provider's page limit)."""
    extra_fields: tuple[str, ...] = ()
    """Extra top-level fields forwarded verbatim, e.g. ``service_tier``, ``store``,
    ``web_search_options``, ``metadata``. Their cost effects are not bounded."""
    token_limit_key: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"  # noqa: S105
    """Which key the gateway sets to the cap when a chat completions request names none
    (the Responses API uses max_output_tokens, Messages max_tokens)."""


class _Upstream(Frozen):
    """What every upstream has, whichever provider answers it."""

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

    @model_validator(mode="before")
    @classmethod
    def _own_fields_only(cls, data: Any) -> Any:
        # Each provider's fields stay on every variant (as None elsewhere) so that plans
        # and receipts keep one shape; a value given for another provider is refused.
        if isinstance(data, dict):
            provider = data.get("provider")
            for key, owners in _PROVIDER_OF.items():
                if data.get(key) is not None and provider not in owners:
                    owner = " or ".join(owners)
                    raise ValueError(f"{key} is for provider {owner}, not {provider}; "
                                     f"remove {key} or set provider: {owners[0]}")
        return data

    @model_validator(mode="after")
    def _priced_models_are_listed(self) -> Self:
        stray = sorted(set(self.prices) - set(self.models))
        if stray:
            raise ValueError(f"prices names {', '.join(map(repr, stray))}, not in models "
                             f"{list(self.models)}: a misspelt price leaves the model it meant "
                             "unpriced (every call's cost unknown, refused under limit_usd); "
                             "key prices by the names in models")
        return self

    @model_validator(mode="after")
    def _limits_fit(self) -> Self:
        if self.limits.body_bytes_burst < self.max_request_bytes:
            raise ValueError(f"limits.body_bytes_burst ({self.limits.body_bytes_burst}) "
                             f"must be at least max_request_bytes ({self.max_request_bytes})")
        if self.limits.max_inflight_bytes < self.max_request_bytes:
            raise ValueError(f"limits.max_inflight_bytes ({self.limits.max_inflight_bytes}) "
                             f"must be at least max_request_bytes ({self.max_request_bytes})")
        return self


_PROVIDER_OF = {"base_url": ("openai", "anthropic"), "credential": ("openai", "anthropic"),
                "anthropic_version": ("anthropic",), "script": ("scripted",),
                "replay_from": ("replay",)}
"""Provider-specific field -> the providers it belongs to."""
PROVIDER_FIELDS: tuple[str, ...] = tuple(_PROVIDER_OF)
"""Fields that belong to one provider or another (None on every other variant)."""


class OpenAIUpstream(_Upstream):
    """Any OpenAI-compatible server, reached from the host with a host-side key."""

    provider: Literal["openai"]
    """openai: any OpenAI-compatible server."""
    base_url: str = Field(min_length=1, pattern=r"^https?://[^\s/?#]+")
    """The server's base URL, e.g. https://api.example.com/v1."""
    credential: CredentialSource
    """Where the host reads the key. The key is read only when a role of the cycle uses
    this upstream."""
    script: None = None
    """Not used by this provider (scripted only); always null."""
    replay_from: None = None
    """Not used by this provider (replay only); always null."""
    anthropic_version: None = Field(default=None, exclude_if=lambda v: v is None)
    """Not used by this provider (anthropic only); always null."""

    @property
    def apis(self) -> frozenset[str]:
        return OPENAI_APIS




class AnthropicUpstream(_Upstream):
    """Anthropic's Messages API, reached from the host with a host-side key."""

    provider: Literal["anthropic"]
    """anthropic: the Messages API (``/v1/messages``, ``/v1/messages/count_tokens``)."""
    base_url: str = Field(min_length=1, pattern=r"^https?://[^\s/?#]+")
    """The server's base URL as the Anthropic SDK takes it, e.g. https://api.anthropic.com
    (the gateway appends /v1/messages)."""
    credential: CredentialSource
    """Where the host reads the key (sent as ``x-api-key``). Read only when a role of the
    cycle uses this upstream."""
    anthropic_version: str = Field(default="2023-06-01", min_length=1,
                                   pattern=r"^[0-9A-Za-z._-]+$")
    """The ``anthropic-version`` header the host sends."""
    script: None = None
    """Not used by this provider (scripted only); always null."""
    replay_from: None = None
    """Not used by this provider (replay only); always null."""

    @property
    def apis(self) -> frozenset[str]:
        return ANTHROPIC_APIS


class ScriptedUpstream(_Upstream):
    """Offline fixture replies from a script file (never a real model)."""

    provider: Literal["scripted"]
    """scripted: offline fixture replies from a script file."""
    script: str = Field(min_length=1)
    """Path of the script file (relative paths resolve against the file that defines the
    upstream, e.g. cycle.yaml)."""
    base_url: None = None
    """Not used by this provider (openai only); always null."""
    credential: None = None
    """Not used by this provider (openai only); always null."""
    replay_from: None = None
    """Not used by this provider (replay only); always null."""
    anthropic_version: None = Field(default=None, exclude_if=lambda v: v is None)
    """Not used by this provider (anthropic only); always null."""

    @property
    def apis(self) -> frozenset[str]:
        return ALL_APIS


class ReplayUpstream(_Upstream):
    """Byte-exact answers from a recorded call log."""

    provider: Literal["replay"]
    """replay: byte-exact answers from a recorded call log."""
    replay_from: str = Field(min_length=1)
    """A run directory whose gateway/calls.jsonl is replayed."""
    base_url: None = None
    """Not used by this provider (openai only); always null."""
    credential: None = None
    """Not used by this provider (openai only); always null."""
    script: None = None
    """Not used by this provider (scripted only); always null."""
    anthropic_version: None = Field(default=None, exclude_if=lambda v: v is None)
    """Not used by this provider (anthropic only); always null."""

    @property
    def apis(self) -> frozenset[str]:
        return ALL_APIS


AnyUpstream = OpenAIUpstream | AnthropicUpstream | ScriptedUpstream | ReplayUpstream
UpstreamPolicy = Annotated[AnyUpstream,
                           Field(discriminator="provider")]
"""One model upstream (target, optimizer or judge), told apart by ``provider``: a missing
or unknown provider, or a field of another provider, is refused naming the field."""

_UPSTREAM: TypeAdapter[AnyUpstream] = TypeAdapter(
    UpstreamPolicy)


def parse_upstream(data: object) -> AnyUpstream:
    """An upstream from plain data (pydantic ValidationError when it is not one)."""
    return _UPSTREAM.validate_python(data)


MAX_CREDENTIAL_FILE_BYTES = 64 * 1024
"""Largest credential file read (a key is its first line)."""


def read_credential(name: str, src: CredentialSource) -> str:
    """The key's value, read on the host only; PrerequisiteError naming the source if absent."""
    if src.env is not None:
        value = os.environ.get(src.env, "")
        if not value:
            raise PrerequisiteError(f"upstream {name}: credential env var {src.env} is not set. "
                                    f"Fix: export {src.env}=... on the host (never in a role).")
        return value
    assert src.file is not None  # noqa: S101 - guaranteed by the validator
    from runner.errors import ConfigError
    from runner.loading import read_capped

    where = f"upstream {name}: credential file {src.file}"
    try:  # a regular file, bounded, never blocking (a FIFO hung freeze, /dev/zero grew)
        raw = read_capped(Path(src.file).expanduser(), max_bytes=MAX_CREDENTIAL_FILE_BYTES,
                          what="credential file", ref=("", ""))
    except ConfigError as exc:
        raise PrerequisiteError(f"upstream {name} (upstreams.{name}.credential.file): {exc}. "
                                "Fix: write the key on the first line of a regular file "
                                "(a relative path is read against the cycle file's "
                                "directory).") from None
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise PrerequisiteError(f"{where} is not UTF-8 text. Fix: write the key on its first "
                                "line as text.") from None
    try:
        value = lines[0].strip()
    except IndexError:
        raise PrerequisiteError(f"{where} is missing or empty. Fix: write the key on its "
                                "first line.") from None
    if not value:
        raise PrerequisiteError(f"upstream {name}: credential file {src.file} is empty")
    return value


class UpstreamsFile(Frozen):
    """A file of upstream definitions for ``cyclebox sandbox exec`` (a cycle defines its
    own in cycle.yaml): ``policies/upstreams.yaml`` holds the offline scripted fixtures."""

    schema_: int = Field(alias="schema")
    """File format version; this code reads version 1."""
    upstreams: dict[str, UpstreamPolicy]
    """Upstream name (target, optimizer, judge) -> provider settings; credential names only."""


UPSTREAMS_FIX = ("a mapping with schema: 1 and upstreams: {NAME: {provider: ..., models: "
                 "[...]}} (the same keys as cycle.yaml's upstreams)")


def load_upstreams(path: Path) -> dict[str, UpstreamPolicy]:
    """Upstreams from an upstreams file; script and replay paths resolved against it and
    every script loaded. ConfigError naming the file and field otherwise."""
    from runner.gateway.providers import load_script
    from runner.loading import checked_path, load_model, resolve_under, show

    doc = load_model(path, UpstreamsFile, fmt="yaml", what="upstreams file", schema=1,
                     fix=UPSTREAMS_FIX)
    where, base = show(str(path)), path.resolve().parent
    out: dict[str, UpstreamPolicy] = {}
    for name, up in doc.upstreams.items():
        field = f"upstreams.{name}"
        upd: dict[str, str] = {}
        if up.script:
            fix = "point to a scripted-provider YAML file, relative to this file"
            script = checked_path(resolve_under(base, up.script, path=where,
                                                field=f"{field}.script", fix=fix),
                                  kind="file", path=where, field=f"{field}.script", fix=fix)
            load_script(script, ref=(where, f"{field}.script"))
            upd["script"] = str(script)
        if up.replay_from:
            upd["replay_from"] = str(resolve_under(base, up.replay_from, path=where,
                                                   field=f"{field}.replay_from",
                                                   fix="point at a finished run directory"))
        out[name] = up.model_copy(update=upd)
    return out
