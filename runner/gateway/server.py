"""The gateway process side: one uvicorn server per role container, on its own unix socket.

A :class:`Gateway` runs an asyncio loop in a background thread. ``bind()`` creates a
private directory holding ``gateway.sock`` and ``token`` for one container; the
controller mounts that directory read-only at :data:`CONTAINER_DIR`. The socket
identifies the caller's role, stage, case and trial (a container cannot claim to be
someone else); the token, per run and role, is checked in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runner.collect import loads_strict
from runner.errors import ConfigError, OutputRejected
from runner.gateway.budget import BudgetPolicy, BudgetRefused, RunBudget
from runner.gateway.calllog import CallLog, CallRecord, Usage
from runner.gateway.config import Price, UpstreamPolicy, read_credential
from runner.gateway.providers import OpenAIProvider, Provider, ReplayProvider, ScriptedProvider
from runner.owner import current_owner
from runner.sandbox import Mount

CONTAINER_DIR = "/run/cyclebox/gateway"
"""Where a role finds ``gateway.sock`` and ``token`` (read-only mount)."""
SOCKET_NAME = "gateway.sock"
TOKEN_NAME = "token"  # noqa: S105 - a file name, not a secret
OWNER_NAME = "owner.json"
SOCKET_DIR_PREFIX = "cbx-gw-"
MOUNTED_NAME = "g"
"""Subdirectory of a socket directory that is mounted (socket and token only)."""


def cost_usd(usage: Usage | None, price: Price | None) -> float | None:
    """Cost of a call; None (unknown) without usage or without a price, never zero."""
    if usage is None or price is None:
        return None
    return (usage.prompt_tokens * price.input_per_mtok
            + usage.completion_tokens * price.output_per_mtok) / 1e6


def make_provider(name: str, up: UpstreamPolicy) -> Provider:
    if up.provider == "openai":
        assert up.base_url is not None and up.credential is not None  # noqa: S101
        key = read_credential(name, up.credential)
        return OpenAIProvider(up.base_url, key, timeout_s=up.timeout_s,
                              max_response=up.max_response_bytes)
    if up.provider == "scripted":
        assert up.script is not None  # noqa: S101
        return ScriptedProvider(Path(up.script))
    assert up.replay_from is not None  # noqa: S101
    return ReplayProvider(Path(up.replay_from))


@dataclass
class Binding:
    """One container's connection to the gateway."""

    role: str
    stage: str
    case: str | None
    trial: int | None
    directory: Path
    """Host directory to mount read-only at CONTAINER_DIR."""
    turns: int = 0
    server: uvicorn.Server | None = field(default=None, repr=False)

    def mount(self) -> Mount:
        """The read-only mount that gives a container this socket and token."""
        return Mount(source=self.directory, target=CONTAINER_DIR, gateway=True)

    def next_turn(self) -> int:
        t = self.turns
        self.turns += 1
        return t


class Gateway:
    """Host-side model gateway for one run."""

    def __init__(self, run_dir: Path, run_id: str, upstreams: dict[str, UpstreamPolicy],
                 role_upstream: Mapping[str, str | None], budget: RunBudget | None = None) -> None:
        self.run_id = run_id
        self.upstreams = upstreams
        self.role_upstream = role_upstream
        self.budget = budget or RunBudget(BudgetPolicy())
        self.log = CallLog(run_dir / "gateway")
        self._tokens: dict[str, str] = {}
        self._providers: dict[str, Provider] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._bindings: list[Binding] = []
        self._by_key: dict[tuple[str, str | None, int | None], list[CallRecord]] = {}
        self._index_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> Gateway:
        used = {u for u in self.role_upstream.values() if u}
        for name in sorted(used):
            if name not in self.upstreams:
                raise ConfigError(f"upstream {name!r} is not defined", field="upstreams")
            self._providers[name] = make_provider(name, self.upstreams[name])
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cyclebox-gateway",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        for b in list(self._bindings):
            self.unbind(b)
        self.log.sync()
        if self._loop is not None:
            for p in self._providers.values():
                asyncio.run_coroutine_threadsafe(p.aclose(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._loop.close()
            self._loop = None

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def token_for(self, role: str) -> str:
        """The per-run, per-role capability (worthless outside this run)."""
        return self._tokens.setdefault(role, secrets.token_urlsafe(32))

    # -- bindings ----------------------------------------------------------------
    def bind(self, role: str, *, stage: str, uid: int, case: str | None = None,
             trial: int | None = None) -> Binding:
        """Start a socket for one container of ``role``; mount ``binding.directory`` read-only."""
        assert self._loop is not None, "gateway not started"  # noqa: S101
        # Short path under the temp dir: unix socket paths are limited to 108 bytes.
        # The owner record (pid, boot id, for `cyclebox gc`) stays beside the mounted
        # directory, never in it: a container learns nothing about the controller.
        outer = Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX))
        (outer / OWNER_NAME).write_text(json.dumps(asdict(current_owner())))
        directory = outer / MOUNTED_NAME
        directory.mkdir(mode=0o700)
        token_file = directory / TOKEN_NAME
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "w") as f:
            f.write(self.token_for(role))
        if os.getuid() == 0 and uid != 0:
            os.chown(directory, uid, uid)
            os.chown(token_file, uid, uid)
        binding = Binding(role=role, stage=stage, case=case, trial=trial, directory=directory)
        app = self._app(binding)
        config = uvicorn.Config(app, uds=str(directory / SOCKET_NAME), log_level="warning",
                                access_log=False, lifespan="off", timeout_keep_alive=30)
        binding.server = uvicorn.Server(config)
        fut = asyncio.run_coroutine_threadsafe(self._serve(binding), self._loop)
        fut.result(timeout=30)
        self._bindings.append(binding)
        return binding

    async def _serve(self, b: Binding) -> None:
        # uvicorn's startup()/shutdown() without its main loop: Server.serve() polls
        # should_exit every 100 ms, which made every bind+unbind cost ~200 ms.
        assert b.server is not None  # noqa: S101
        config = b.server.config
        if not config.loaded:
            config.load()
        b.server.lifespan = config.lifespan_class(config)
        await b.server.startup()

    def unbind(self, b: Binding) -> None:
        if b in self._bindings:
            self._bindings.remove(b)
        if b.server is not None and self._loop is not None and b.server.started:
            asyncio.run_coroutine_threadsafe(_stop(b.server), self._loop).result(timeout=30)
        shutil.rmtree(b.directory.parent, ignore_errors=True)
        self.log.sync()

    @contextmanager
    def bound(self, role: str, *, stage: str, uid: int, case: str | None = None,
              trial: int | None = None) -> Iterator[Binding]:
        b = self.bind(role, stage=stage, uid=uid, case=case, trial=trial)
        try:
            yield b
        finally:
            self.unbind(b)

    # -- the API -----------------------------------------------------------------
    def _app(self, b: Binding) -> Starlette:
        async def chat(request: Request) -> Response:
            return await self._chat(b, request)

        async def models(request: Request) -> Response:
            if not self._authorized(b, request):
                return _error(401, "bad_token", "missing or wrong gateway token for this role")
            name = self.role_upstream.get(b.role)
            ids = list(self.upstreams[name].models) if name else []
            return JSONResponse({"object": "list", "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": name} for m in ids]})

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                 Route("/v1/models", models, methods=["GET"])])

    def _authorized(self, b: Binding, request: Request) -> bool:
        auth = request.headers.get("authorization", "")
        given = auth[7:].encode() if auth.startswith("Bearer ") else b""
        return hmac.compare_digest(given, self.token_for(b.role).encode())

    async def _chat(self, b: Binding, request: Request) -> Response:
        t0 = time.perf_counter()
        turn = b.next_turn()
        name = self.role_upstream.get(b.role)
        up = self.upstreams.get(name) if name else None
        limit = up.max_request_bytes if up else 1 << 20
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                return self._refuse(b, turn, t0, b"".join(parts), 413, "request_too_large",
                                    f"request body over {limit} bytes", name)
        raw = b"".join(parts)
        if not self._authorized(b, request):
            return self._refuse(b, turn, t0, raw, 401, "bad_token",
                                f"missing or wrong gateway token for role {b.role}", name)
        if up is None or name is None:
            return self._refuse(b, turn, t0, raw, 403, "no_model_access",
                                f"role {b.role} has no model upstream", None)
        try:
            body = loads_strict(raw, source="request")
        except OutputRejected as exc:
            return self._refuse(b, turn, t0, raw, 400, "bad_request", str(exc), name)
        if not isinstance(body, dict):
            return self._refuse(b, turn, t0, raw, 400, "bad_request", "body must be an object",
                                name)
        model = body.get("model")
        if model not in up.models:
            return self._refuse(b, turn, t0, raw, 403, "model_not_allowed",
                                f"model {model!r} is not allowed for {b.role}; allowed: "
                                f"{list(up.models)}", name, model=str(model))
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        requested = body.get(key)
        if requested is None:
            body["max_tokens"] = up.max_tokens
        elif not isinstance(requested, int) or requested > up.max_tokens or requested < 1:
            return self._refuse(b, turn, t0, raw, 400, "max_tokens_over_cap",
                                f"{key}={requested!r} exceeds the cap {up.max_tokens}", name,
                                model=str(model))
        stream = bool(body.get("stream"))
        if stream:
            body["stream_options"] = {**(body.get("stream_options") or {}),
                                      "include_usage": True}
        upstream_bytes = json.dumps(body, separators=(",", ":"), sort_keys=True,
                                    ensure_ascii=False).encode()
        try:
            reservation = self.budget.admit(b.role)
        except BudgetRefused as exc:
            return self._refuse(b, turn, t0, upstream_bytes, 429, "budget", exc.reason, name,
                                model=str(model), stream=stream)
        provider = self._providers[name]
        result = await provider.call(upstream_bytes, body, role=b.role, stream=stream)
        if not result.upstream_reached:
            cost: float | None = 0.0
        elif result.error is None:
            cost = cost_usd(result.usage, up.prices.get(str(model)))
        else:
            cost = None
        self.budget.settle(reservation, cost)
        req_sha = self.log.put_blob(upstream_bytes)
        resp_sha = self.log.put_blob(result.response) if result.response is not None else None
        self._record(b, turn, t0, status="infra_error" if result.error else "ok",
                     error=result.error, upstream=name, provider=provider.name,
                     model=str(model), fixture=result.fixture, stream=stream,
                     http_status=result.http_status, usage=result.usage, cost=cost,
                     req_sha=req_sha, resp_sha=resp_sha)
        if result.error or result.response is None:
            return _error(502, result.error or "no_response",
                          f"upstream {name} failed: {result.error}; recorded, not retried")
        return Response(result.response, status_code=200,
                        media_type="text/event-stream" if stream else "application/json")

    def _refuse(self, b: Binding, turn: int, t0: float, raw: bytes, status: int, code: str,
                message: str, upstream: str | None, *, model: str | None = None,
                stream: bool = False) -> Response:
        req_sha = self.log.put_blob(raw)
        self._record(b, turn, t0, status="refused", error=code, upstream=upstream,
                     provider=None, model=model, fixture=False, stream=stream, http_status=None,
                     usage=None, cost=None, req_sha=req_sha, resp_sha=None)
        return _error(status, code, message)

    def calls(self, stage: str, case: str | None = None,
              trial: int | None = None) -> list[CallRecord]:
        """Calls recorded so far for one container's (stage, case, trial), from memory."""
        with self._index_lock:
            return list(self._by_key.get((stage, case, trial), ()))

    def _record(self, b: Binding, turn: int, t0: float, *, status: Any, error: str | None,
                upstream: str | None, provider: str | None, model: str | None, fixture: bool,
                stream: bool, http_status: int | None, usage: Usage | None,
                cost: float | None, req_sha: str, resp_sha: str | None) -> None:
        rec = CallRecord(
            seq=self.log.next_seq(), ts=CallLog.now(), run_id=self.run_id, role=b.role,
            upstream=upstream, stage=b.stage, case=b.case, trial=b.trial, turn=turn,
            provider=provider, model=model, fixture=fixture, stream=stream, status=status,
            error=error, http_status=http_status,
            latency_s=round(time.perf_counter() - t0, 6), usage=usage, cost_usd=cost,
            request_sha256=req_sha, response_sha256=resp_sha)
        self.log.append(rec)
        with self._index_lock:
            self._by_key.setdefault((b.stage, b.case, b.trial), []).append(rec)


async def _stop(server: uvicorn.Server, grace_s: float = 5.0) -> None:
    """Close one socket's server; like uvicorn's shutdown() without its fixed 100 ms sleeps.

    By the time a binding is released its container is gone, so connections are
    normally closed already; anything still running after the grace period is cancelled.
    """
    loop = asyncio.get_running_loop()
    for srv in server.servers:
        srv.close()
    for conn in list(server.server_state.connections):
        conn.shutdown()
    deadline = loop.time() + grace_s
    while (server.server_state.connections or server.server_state.tasks) and \
            loop.time() < deadline:
        await asyncio.sleep(0.002)
    for task in list(server.server_state.tasks):
        task.cancel()
    for srv in server.servers:
        await srv.wait_closed()


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "cyclebox_gateway",
                                   "code": code}}, status_code=status)
