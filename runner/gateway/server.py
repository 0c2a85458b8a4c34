"""The gateway process side: one listener per role container, on its own unix socket.

A :class:`Gateway` runs an asyncio loop in a background thread. ``bind()`` creates a
private directory holding ``gateway.sock`` and ``token`` for one container; the
controller mounts that directory read-only at :data:`CONTAINER_DIR`. The socket
identifies the caller's role, stage, case and trial (a container cannot claim to be
someone else); the token, per run and role, is checked in constant time from the
request head, before any body byte is kept.

Every request is recorded (ok, refused with a named reason, infra error, interrupted,
internal error), except a successful model listing, which is not a model call. A
call's record is written in the loop step that answers it: a small one right after its
reply (the container reads its answer meanwhile; nothing can come between the two, and a
failure to record stops admission), a large one before. Large bodies (requests and
answers) are parsed and large blobs written on a thread pool, a few at a time per
socket, so one container's traffic does not stall another's. Socket limits are in
:mod:`runner.gateway.http`; request vetting and the worst case in :mod:`vet`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import uvloop

from runner import interrupts
from runner.errors import ConfigError, CycleboxError, OutputRejected
from runner.gateway.budget import BudgetPolicy, BudgetRefused, Reservation, RunBudget
from runner.gateway.calllog import (
    ANTHROPIC_APIS,
    PREFIX_BYTES,
    Api,
    CallLog,
    CallRecord,
    CostBasis,
    Usage,
    sha256,
)
from runner.gateway.config import (
    AnthropicUpstream,
    GatewayLimits,
    OpenAIUpstream,
    Price,
    ScriptedUpstream,
    UpstreamPolicy,
    read_credential,
)
from runner.gateway.http import Head, Listener, Reply
from runner.gateway.items import NOTHING, Resolution, ResponseItems
from runner.gateway.providers import (
    AnthropicProvider,
    CallSite,
    OpenAIProvider,
    Provider,
    ProviderResult,
    ReplayProvider,
    ScriptedProvider,
    inspected,
)
from runner.gateway.redact import Redactor
from runner.gateway.vet import ROUTES, Refusal, Vetted, vet, worst_case_usd
from runner.isolation.collect import loads_strict
from runner.isolation.launcher import endpoint_env
from runner.isolation.owner import current_owner
from runner.isolation.sandbox import Mount, SweepResult

CONTAINER_DIR = "/run/cyclebox/gateway"
"""Where a role finds ``gateway.sock`` and ``token`` (read-only mount)."""
SOCKET_NAME = "gateway.sock"
TOKEN_NAME = "token"  # noqa: S105 - a file name, not a secret
OWNER_NAME = "owner.json"
SOCKET_DIR_PREFIX = "cbx-gw-"
OFFLOAD_BYTES = 64 * 1024
"""Bodies and blobs above this are parsed / written on the thread pool; below it the
hop to a thread costs more than the work."""
WRITERS_PER_SOCKET = 2
"""Pool jobs one socket may have queued at once, so a flood queues behind itself."""
UNBIND_GRACE_S = 5.0
BUSY_WAIT_S = 2.0
"""How long close() waits for binds and unbinds under way on other threads."""
CLOSE_GRACE_S = 0.0
"""On close (SIGTERM/SIGINT) in-flight calls are cancelled at once and recorded."""
DEFAULT_LIMIT = 1 << 20
MAX_REQUEST_CONTAINERS = 100_000
"""Objects and arrays in one request body (a long agent history with tools holds a few
thousand): each object costs a Python call to parse (the duplicate-key check), and 4 MiB
of ``[{},{},...]``, refused only once parsed, took 1.1 s of the controller's CPU."""
T = TypeVar("T")
MOUNTED_NAME = "g"
"""Subdirectory of a socket directory that is mounted (socket and token only)."""


def cost_usd(usage: Usage | None, price: Price | None, *,
             writes_1h: bool = False) -> float | None:
    """Cost of a call; None (unknown) without usage or without a price, never zero.
    Cache reads and writes are priced at their own rates (default: the input price;
    Anthropic's 1-hour cache writes: twice it; ``writes_1h``: every write at that price,
    for a request that asked for the 1-hour cache through a family whose usage does not
    say which cache its writes went to);
    reasoning tokens are part of the completion tokens, priced as output."""
    if usage is None or price is None:
        return None
    plain = max(0, usage.prompt_tokens - usage.cached_tokens - usage.cache_write_tokens)
    hour = usage.cache_write_tokens if writes_1h else usage.cache_write_1h_tokens
    short = usage.cache_write_tokens - hour
    return (plain * price.input_per_mtok + usage.cached_tokens * price.cached_input()
            + short * price.cache_write() + hour * price.cache_write_1h()
            + usage.completion_tokens * price.output_per_mtok) / 1e6


def make_provider(name: str, up: UpstreamPolicy) -> tuple[Provider, str | None]:
    """The upstream's provider and, for openai and anthropic, the key (for redaction). The union's
    variant guarantees its fields (a bad provider config never got this far)."""
    if isinstance(up, OpenAIUpstream):
        key = read_credential(name, up.credential)
        return OpenAIProvider(up.base_url, key, timeout_s=up.timeout_s,
                              max_response=up.max_response_bytes), key
    if isinstance(up, AnthropicUpstream):
        key = read_credential(name, up.credential)
        return AnthropicProvider(up.base_url, key, version=up.anthropic_version,
                                 timeout_s=up.timeout_s,
                                 max_response=up.max_response_bytes), key
    if isinstance(up, ScriptedUpstream):
        return ScriptedProvider(Path(up.script)), None
    return ReplayProvider(Path(up.replay_from)), None


def _prefix(data: bytes) -> str:
    return data[:PREFIX_BYTES].decode("utf-8", errors="backslashreplace")


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
    refusals: int = 0
    not_itemized: int = 0
    listener: Listener | None = field(default=None, repr=False)
    writers: asyncio.Semaphore | None = field(default=None, repr=False)
    token: str = field(default="", repr=False)
    """The role's per-run token (also in ``directory``), for :meth:`env`."""
    items: ResponseItems = field(default_factory=ResponseItems, repr=False)
    """Output items of its Responses answers, which its item references resolve to."""
    armed: bool = True
    """False while the container waits for its case (a warm start imports then): every
    call is refused (``not_handed_over``, recorded) until the hand-over arms it."""

    def mount(self) -> Mount:
        """The read-only mount that gives a container this socket and token."""
        return Mount(source=self.directory, target=CONTAINER_DIR, gateway=True)

    def env(self) -> dict[str, str]:
        """The container's model environment: SDK base URLs on its loopback relay, the
        role's token as their key (:func:`runner.isolation.launcher.endpoint_env`)."""
        return endpoint_env(self.token)

    def next_turn(self) -> int:
        t = self.turns
        self.turns += 1
        return t


class GatewayClosed(CycleboxError):
    """Raised by :meth:`Gateway.bind` once the gateway is closed (or before it started):
    a container that would be bound then is one the run no longer starts."""


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
        self._redactor = Redactor([])
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._bindings: list[Binding] = []
        self._closed = False
        """Set by close(), under _bind_lock: no binding is registered after it."""
        self._bind_lock = threading.Condition()
        self._busy = 0
        """binds and unbinds under way (close() waits for them before stopping the loop)"""
        self._unbinding: list[Binding] = []
        """bindings an unbind() took out of _bindings and is closing"""
        self._by_key: dict[tuple[str, str | None, int | None], list[CallRecord]] = {}
        self._index_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> Gateway:
        used = {u for u in self.role_upstream.values() if u}
        keys = []
        for name in sorted(used):
            if name not in self.upstreams:
                raise ConfigError(f"upstream {name!r} is not defined", field="upstreams")
            self._providers[name], key = make_provider(name, self.upstreams[name])
            keys.append(key or "")
        self._redactor = Redactor(keys)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="cyclebox-gw-io")
        # uvloop: the loop, transports and timers in C rather than Python, about 12% less
        # gateway CPU per call (bench/gateway.py); the listener and the upstream client
        # use only the asyncio Protocol/Transport API, which it implements.
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cyclebox-gateway",
                                        daemon=True)
        self._thread.start()
        return self

    def interrupt(self) -> None:
        """Cancel every in-flight upstream call now (each is recorded as ``interrupted``);
        safe from any thread, e.g. a SIGTERM/SIGINT handler. Sockets stay bound."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def cancel() -> None:
            for b in [*self._bindings, *self._unbinding]:
                if b.listener is not None:
                    for t in list(b.listener.tasks):
                        t.cancel()

        loop.call_soon_threadsafe(cancel)

    def close(self) -> None:
        """Stop every socket; in-flight upstream calls are cancelled at once and recorded
        as ``interrupted`` (the controller's unwinding on SIGTERM/SIGINT ends here)."""
        with self._bind_lock:
            self._closed = True
        # A bind or unbind under way on another thread finishes on the running loop
        # first (its in-flight calls cancelled like every other); only then does the loop
        # stop, so none of them waits on a stopped loop or writes after the log closed.
        self.interrupt()
        with self._bind_lock:
            self._bind_lock.wait_for(lambda: self._busy == 0, timeout=BUSY_WAIT_S)
            bindings = list(self._bindings)
        for b in bindings:
            self.unbind(b, grace_s=CLOSE_GRACE_S)
        if self._loop is not None:
            for p in self._providers.values():
                asyncio.run_coroutine_threadsafe(p.aclose(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._loop.close()
            self._loop = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.log.close()

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
        counted = False
        try:
            # deferred: a signal between the count and the flag would leave close() waiting
            with interrupts.deferred(), self._bind_lock:
                loop = self._loop
                if loop is None or self._closed:
                    raise GatewayClosed(f"no gateway socket for the {role} container: the "
                                        "gateway is " + ("closed (the run is stopping)"
                                                         if self._closed else "not started"))
                self._busy += 1
                counted = True
            return self._bind(loop, role, stage=stage, uid=uid, case=case, trial=trial)
        finally:
            if counted:
                self._done()

    def _done(self) -> None:
        with self._bind_lock:
            self._busy -= 1
            self._bind_lock.notify_all()

    def _bind(self, loop: asyncio.AbstractEventLoop, role: str, *, stage: str, uid: int,
              case: str | None, trial: int | None) -> Binding:
        # Short path under the temp dir: unix socket paths are limited to 108 bytes.
        # The owner record (pid, boot id, for `cyclebox gc`) stays beside the mounted
        # directory, never in it: a container learns nothing about the controller.
        # A signal mid-bind is held until the binding is registered (close() then removes
        # it); any other failure removes what was made, so no socket dir outlives a bind.
        with interrupts.deferred():
            outer = Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX))
            binding: Binding | None = None
            try:
                binding = self._make_binding(outer, role, stage=stage, uid=uid, case=case,
                                             trial=trial)
                asyncio.run_coroutine_threadsafe(self._start(binding),
                                                 loop).result(timeout=30)
                with self._bind_lock:
                    # close() may have listed the bindings meanwhile: this one would
                    # outlive it, so it is undone here instead
                    if self._closed:
                        raise GatewayClosed(f"no gateway socket for the {role} container: "
                                           "the gateway closed (the run is stopping)")
                    self._bindings.append(binding)
            except BaseException:
                if binding is not None and binding.listener is not None:
                    with contextlib.suppress(Exception):
                        asyncio.run_coroutine_threadsafe(binding.listener.close(0),
                                                         loop).result(timeout=10)
                shutil.rmtree(outer, ignore_errors=True)
                raise
        return binding

    def _make_binding(self, outer: Path, role: str, *, stage: str, uid: int,
                      case: str | None, trial: int | None) -> Binding:
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
        binding = Binding(role=role, stage=stage, case=case, trial=trial, directory=directory,
                          token=self.token_for(role))
        name = self.role_upstream.get(role)
        up = self.upstreams.get(name) if name else None
        limits = up.limits if up else GatewayLimits()
        binding.listener = Listener(str(directory / SOCKET_NAME), limits,
                                    _Handler(self, binding, name, up))
        return binding

    async def _start(self, b: Binding) -> None:
        b.writers = asyncio.Semaphore(WRITERS_PER_SOCKET)
        assert b.listener is not None  # noqa: S101
        await b.listener.start()

    def unbind(self, b: Binding, *, grace_s: float | None = None) -> None:
        """Close the socket; calls still running after ``grace_s`` (default
        UNBIND_GRACE_S) are cancelled and recorded as interrupted."""
        grace_s = UNBIND_GRACE_S if grace_s is None else grace_s
        taken = finished = False
        try:
            with interrupts.deferred(), self._bind_lock:
                # once per binding: the thread that takes it out closes it (close() and
                # the container's own unbind may both try)
                if b not in self._bindings:
                    return
                self._bindings.remove(b)
                self._unbinding.append(b)
                loop = self._loop
                self._busy += 1
                taken = True
            if b.listener is not None and loop is not None:
                asyncio.run_coroutine_threadsafe(b.listener.close(grace_s),
                                                 loop).result(timeout=grace_s + 10)
            if b.not_itemized:
                self._record(b, b.next_turn(), time.perf_counter(), status="refused",
                             error="refusals_not_itemized",
                             upstream=self.role_upstream.get(b.role), received=b"",
                             not_itemized=b.not_itemized)
                b.not_itemized = 0
            shutil.rmtree(b.directory.parent, ignore_errors=True)
            self.log.sync()
            finished = True
        finally:
            if taken:
                with self._bind_lock:
                    self._unbinding.remove(b)
                    if not finished:  # cut short (a signal): close() closes it again
                        self._bindings.append(b)
                self._done()

    @contextmanager
    def bound(self, role: str, *, stage: str, uid: int, case: str | None = None,
              trial: int | None = None) -> Iterator[Binding]:
        """A bound socket for the duration of the block; when the block is left by an
        exception (Interrupted, KeyboardInterrupt, an engine error) in-flight calls are
        cancelled at once and recorded as interrupted, without the normal grace."""
        b = self.bind(role, stage=stage, uid=uid, case=case, trial=trial)
        try:
            yield b
        except BaseException:
            self.unbind(b, grace_s=0)
            raise
        self.unbind(b)

    def calls(self, stage: str, case: str | None = None, trial: int | None = None, *,
              forget: bool = False) -> list[CallRecord]:
        """Calls recorded so far for one container's (stage, case, trial), from memory;
        every call whose answer was sent before this is asked is in it (:meth:`_caught_up`).
        ``forget``: the caller is done with them (a case read once it ended), so a long
        run's memory does not grow with its calls; the log on disk keeps them all."""
        self._caught_up()
        with self._index_lock:
            key = (stage, case, trial)
            found = self._by_key.pop(key, []) if forget else self._by_key.get(key, [])
            return list(found)

    def flush(self) -> None:
        """Every call answered so far is in the log on disk (fsync'd): for a reader of a
        live run's log."""
        self._caught_up()
        self.log.sync()

    def _caught_up(self) -> None:
        """Asked from another thread, let the loop finish the step it is in: a reply and
        its call's record are written in one step (``Reply.after``)."""
        loop = self._loop
        if (loop is not None and loop.is_running()
                and threading.current_thread() is not self._thread):
            with contextlib.suppress(Exception):  # a closing loop: what is recorded is all
                asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=10)

    # -- recording -----------------------------------------------------------------
    async def offload(self, b: Binding, size: int, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the pool when ``size`` is large (a few jobs per socket at once)."""
        if size < OFFLOAD_BYTES or self._pool is None or b.writers is None:
            return fn()
        async with b.writers:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _record_after(self, record: Callable[[], None]) -> None:
        """Run a call's recording after its reply was sent. It cannot be refused any more,
        so a failure to record stops admission (the run ends incomplete, named), and the
        controller says so; it never passes silently."""
        try:
            record()
        except Exception as exc:
            reason = f"call log write failed: {type(exc).__name__}: {str(exc)[:200]}"
            self.budget.halt(reason)
            print(f"cyclebox gateway: {reason}; admission stopped", file=sys.stderr)

    def _record(self, b: Binding, turn: int, t0: float, *, status: Any, error: str | None,
                upstream: str | None, received: bytes | None = None,
                provider: str | None = None, model: str | None = None, fixture: bool = False,
                stream: bool = False, http_status: int | None = None,
                usage: Usage | None = None, cost: float | None = None,
                sent: bytes | None = None, response: bytes | None = None,
                redactions: int = 0, not_itemized: int | None = None,
                api: Api | None = None, cost_basis: CostBasis | None = None,
                replay_of: str | None = None, resolved_references: int = 0,
                dropped_ids: int = 0) -> None:
        """Write one record (blobs first). ``sent``: bytes sent upstream, stored whole;
        ``received``: a refused request's bytes, of which only hash, length and prefix
        are kept."""
        if sent is not None:
            req_sha, stored, nbytes, prefix = self.log.put_blob(sent), True, len(sent), None
        else:
            data = received or b""
            req_sha, stored, nbytes, prefix = sha256(data), False, len(data), _prefix(data)
        resp_sha = self.log.put_blob(response) if response is not None else None
        rec = CallRecord(
            seq=self.log.next_seq(), ts=CallLog.now(), run_id=self.run_id, role=b.role,
            upstream=upstream, stage=b.stage, case=b.case, trial=b.trial, turn=turn,
            provider=provider, model=model, fixture=fixture, stream=stream, api=api,
            status=status, error=error, http_status=http_status,
            latency_s=round(time.perf_counter() - t0, 6), usage=usage, cost_usd=cost,
            cost_basis=cost_basis,
            request_sha256=req_sha, response_sha256=resp_sha, request_stored=stored,
            request_bytes=nbytes, request_prefix=prefix, redactions=redactions,
            not_itemized=not_itemized, replay_of=replay_of,
            resolved_references=resolved_references or None, dropped_ids=dropped_ids or None)
        self.log.append(rec)
        with self._index_lock:
            self._by_key.setdefault((b.stage, b.case, b.trial), []).append(rec)


class _Handler:
    """The API of one binding, called by its listener."""

    def __init__(self, gw: Gateway, b: Binding, name: str | None,
                 up: UpstreamPolicy | None) -> None:
        self.gw, self.b, self.name, self.up = gw, b, name, up
        self.max_body = up.max_request_bytes if up else DEFAULT_LIMIT
        self.token = gw.token_for(b.role).encode()

    def _token_ok(self, head: Head) -> bool:
        """``Authorization: Bearer`` (OpenAI SDKs) or ``x-api-key`` (Anthropic SDKs); both
        given must be the same token."""
        auth = head.headers.get("authorization")
        key = head.headers.get("x-api-key")
        if auth is None and key is None:
            return False
        bearer = auth[7:] if auth is not None and auth.startswith("Bearer ") else None
        if auth is not None and bearer is None:
            return False
        given = [v.encode("latin-1") for v in (bearer, key) if v is not None]
        ok = [hmac.compare_digest(g, self.token) for g in given]
        return all(ok)

    def head(self, head: Head) -> Reply | None:
        api = ROUTES.get(head.path)
        if api is None and head.path != "/v1/models":
            return self.refuse(head, 404, "not_found", f"no route {head.path[:200]!r}; routes: "
                               f"{sorted([*ROUTES, '/v1/models'])}", b"")
        want = "GET" if api is None else "POST"
        if head.method != want:
            return self.refuse(head, 405, "method_not_allowed", f"{head.path} takes {want}", b"")
        if not self._token_ok(head):
            return self.refuse(head, 401, "bad_token",
                               f"missing or wrong gateway token for role {self.b.role} "
                               "(Authorization: Bearer or x-api-key)", b"")
        if not self.b.armed:
            return self.refuse(head, 409, "not_handed_over",
                               f"the {self.b.role} container has not been handed its case "
                               "yet: a model call while it is prepared (at import, in a warm "
                               "start) is refused", b"")
        if self.up is None or self.name is None:
            return self.refuse(head, 403, "no_model_access",
                               f"role {self.b.role} has no model upstream", b"")
        if api is not None and api not in self.up.apis:
            served = sorted(p for p, a in ROUTES.items() if a in self.up.apis)
            return self.refuse(head, 404, "route_not_served",
                               f"route {head.path} is not served by upstream {self.name} "
                               f"(provider {self.up.provider} serves {served}); the gateway "
                               "does not translate between API families: give role "
                               f"{self.b.role} an upstream whose provider speaks this API "
                               f"(cycle.yaml upstreams.{self.name}.provider)", b"")
        return None

    def refuse(self, head: Head | None, status: int, code: str, message: str,
               received: bytes, *, model: str | None = None, stream: bool = False,
               t0: float | None = None, turn: int | None = None,
               param: str | None = None) -> Reply:
        b = self.b
        api = ROUTES.get(head.path) if head is not None else None
        turn = b.next_turn() if turn is None else turn
        if b.refusals < (self.up.limits.max_refusal_records if self.up else 1000):
            b.refusals += 1
            self.gw._record(b, turn, t0 or time.perf_counter(), status="refused", error=code,
                            upstream=self.name, received=received, model=model, stream=stream,
                            api=api)
        else:
            b.not_itemized += 1
        return _error(status, code, message, api=api, param=param)

    def _models(self) -> Reply:
        ids = list(self.up.models) if self.up else []
        # One listing both SDKs read: OpenAI's list fields and Anthropic's.
        return _json(200, {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": self.name,
             "type": "model", "display_name": m, "created_at": "1970-01-01T00:00:00Z"}
            for m in ids], "has_more": False, "first_id": ids[0] if ids else None,
            "last_id": ids[-1] if ids else None})

    def _interrupted(self, turn: int, t0: float, reservation: Reservation | None,
                     worst: float | None, *, free: bool, common: dict[str, Any]) -> None:
        """A call cancelled in flight (the gateway is stopping): charged its worst case,
        recorded as interrupted."""
        basis: CostBasis | None = "upper_bound" if worst is not None and not free else None
        if reservation is not None:
            self.gw.budget.settle(reservation, worst, upper_bound=basis == "upper_bound")
        self.gw._record(self.b, turn, t0, status="infra_error", error="interrupted",
                        cost=worst, cost_basis=basis, **common)

    def _interrupted_unsent(self, head: Head, body: bytes, turn: int, t0: float, *,
                            model: str | None = None, stream: bool = False) -> None:
        """A call cancelled before anything was sent upstream (the gateway is stopping
        while the pool parses or checks it): recorded as interrupted, at no cost."""
        self.gw._record_after(functools.partial(
            self.gw._record, self.b, turn, t0, status="infra_error", error="interrupted",
            upstream=self.name, received=body, model=model, stream=stream,
            api=ROUTES.get(head.path), cost=0.0))

    async def handle(self, head: Head, body: bytes) -> Reply:
        api = ROUTES.get(head.path)
        if api is None:
            return self._models()
        t0 = time.perf_counter()
        turn = self.b.next_turn()
        up, name = self.up, self.name
        assert up is not None and name is not None  # noqa: S101 - checked in head()
        try:
            obj = await self.gw.offload(self.b, len(body),
                                        lambda: loads_strict(
                                            body, source="request",
                                            max_containers=MAX_REQUEST_CONTAINERS))
        except OutputRejected as exc:
            return self.refuse(head, 400, "bad_request", str(exc), body, t0=t0, turn=turn)
        except asyncio.CancelledError:  # stopped while the pool parsed it: nothing sent
            self._interrupted_unsent(head, body, turn, t0)
            raise
        if not isinstance(obj, dict):
            return self.refuse(head, 400, "bad_request", "body must be an object", body,
                               t0=t0, turn=turn)
        model = obj.get("model")
        if not isinstance(model, str) or model not in up.models:
            shown = ascii(model)[:120]  # hostile: bounded and escaped before it is stored
            return self.refuse(head, 403, "model_not_allowed",
                               f"model {shown} is not allowed for {self.b.role}; allowed: "
                               f"{list(up.models)} (cycle.yaml upstreams.{name}.models)",
                               body, model=shown, t0=t0, turn=turn, param="model")
        stream = obj.get("stream") is True
        found = NOTHING
        if api == "responses":  # item ids: checked, references found, nothing parsed yet
            try:
                found = await self.gw.offload(self.b, len(body), functools.partial(
                    self.b.items.measure, obj, body_bytes=len(body),
                    max_bytes=up.max_request_bytes))
            except Refusal as r:
                return self.refuse(head, r.status, r.code, r.message, body, model=model,
                                   stream=stream, t0=t0, turn=turn, param=r.param)
            except asyncio.CancelledError:
                self._interrupted_unsent(head, body, turn, t0, model=model, stream=stream)
                raise
        if not found.extra:
            return await self._answer(head, body, obj, api, model, stream, t0, turn, found)
        # The referenced items count as body bytes the container sent: the socket's byte
        # rate and in-flight bytes are charged for them, and held until the call ends.
        lst = self.b.listener
        held = lst.hold(found.extra) if lst is not None else None
        if isinstance(held, tuple):
            return self.refuse(head, *held, body, model=model, stream=stream, t0=t0,
                               turn=turn)
        try:
            return await self._answer(head, body, obj, api, model, stream, t0, turn, found)
        finally:
            if lst is not None:
                lst.unhold(found.extra)

    async def _answer(self, head: Head, body: bytes, obj: dict[str, Any], api: Api,
                      model: str, stream: bool, t0: float, turn: int,
                      found: Resolution) -> Reply:
        up, name = self.up, self.name
        assert up is not None and name is not None  # noqa: S101 - checked in head()

        def prepare() -> tuple[Vetted, bytes, int]:
            resolved = found.apply(obj)  # this container's own items, in place
            v = vet(obj, rules=up.rules, cap=up.max_tokens, api=api,
                    where=f"upstreams.{name}.rules")
            return v, json.dumps(v.body, separators=(",", ":"), sort_keys=True,
                                 ensure_ascii=False).encode(), resolved

        try:
            vetted, sent, resolved = await self.gw.offload(self.b, len(body) + found.extra,
                                                           prepare)
        except Refusal as r:
            return self.refuse(head, r.status, r.code, r.message, body, model=model,
                               stream=stream, t0=t0, turn=turn, param=r.param)
        except asyncio.CancelledError:
            self._interrupted_unsent(head, body, turn, t0, model=model, stream=stream)
            raise
        price = up.prices.get(model)
        free = api == "count_tokens"  # answered without generating: never billed
        worst = 0.0 if free else (worst_case_usd(len(sent), vetted, price, up.rules,
                                                 stored_tokens=found.stored_tokens)
                                  if price else None)
        try:  # a free call too: it reaches the upstream, so the call caps count it
            reservation = self.gw.budget.admit(self.b.role, worst, free=free)
        except BudgetRefused as exc:
            return self.refuse(head, 429, "budget", exc.reason, body, model=model,
                               stream=stream, t0=t0, turn=turn)
        provider = self.gw._providers[name]
        common: dict[str, Any] = {"upstream": name, "provider": provider.name, "model": model,
                                  "stream": stream, "sent": sent, "api": api,
                                  "resolved_references": resolved,
                                  "dropped_ids": len(found.dropped)}
        deadline = _Deadline(up.call_deadline_s)
        try:
            site = CallSite(self.b.role, self.b.stage, self.b.case, self.b.trial, turn)
            result = await provider.call(sent, vetted.body, role=self.b.role,
                                         stream=stream, site=site, api=api)
        except TimeoutError:
            result = ProviderResult(None, None, "upstream_deadline")
        except asyncio.CancelledError:
            if deadline.expired():
                result = ProviderResult(None, None, "upstream_deadline")
            else:
                self._interrupted(turn, t0, reservation, worst, free=free, common=common)
                raise
        except Exception as exc:
            result = ProviderResult(None, None, f"internal_error: {type(exc).__name__}")
        finally:
            deadline.cancel()
        response, redactions = result.response, 0
        if response is not None:
            # parsed for its usage and redacted; on the pool when large (a 16 MB answer
            # takes seconds), so other containers' calls are not held up meanwhile
            finish = functools.partial(_finish, result, self.gw._redactor, stream=stream,
                                       api=api, asked_1h=vetted.cache_1h)
            try:
                result, response, redactions = (
                    finish() if len(response) < OFFLOAD_BYTES
                    else await self.gw.offload(self.b, len(response), finish))
            except asyncio.CancelledError:
                self._interrupted(turn, t0, reservation, worst, free=free, common=common)
                raise
            except Exception as exc:  # the call reached the upstream: charged, recorded
                result = ProviderResult(None, None, f"internal_error: {type(exc).__name__}")
                response = None
        cost, basis = _charge(result, price, worst, free=free,
                              writes_1h=vetted.cache_1h and api != "messages")
        self.gw.budget.settle(reservation, cost, upper_bound=basis == "upper_bound")
        if result.error or response is None:
            reply = _error(502, result.error or "no_response",
                           f"upstream {name} failed: {result.error}; recorded, not retried",
                           api=api)
        else:
            reply = Reply(200, response, "text/event-stream" if stream else "application/json")

        remember = api == "responses" and response is not None and not result.error

        def record() -> None:
            if remember:  # before the next request of this container can be read
                assert response is not None  # noqa: S101 - remember says so
                # The redacted answer, parsed again: the items inspect() parsed are the
                # upstream's unredacted ones, and a resolved reference is sent and recorded.
                self.b.items.remember(response, stream=stream, tokens=(
                    result.usage.completion_tokens if result.usage is not None
                    else vetted.choices * vetted.max_tokens))
            self.gw._record(
                self.b, turn, t0, status="infra_error" if result.error else "ok",
                error=result.error, fixture=result.fixture, http_status=result.http_status,
                usage=result.usage, cost=cost, cost_basis=basis, response=response,
                redactions=redactions, replay_of=result.replay_of, **common)

        size = len(sent) + len(response or b"")
        if size >= OFFLOAD_BYTES:
            # Large blobs: on the pool, before the reply. A failed write stops admission
            # (as after a small call's reply), wherever it ran.
            once = _Once(functools.partial(self.gw._record_after, record))
            try:
                await self.gw.offload(self.b, size, once)
            except asyncio.CancelledError:
                # Stopped while the pool was busy: the call happened and was charged, so
                # it is recorded here, unless the pool has started it (then it finishes
                # there: the gateway's close waits for the pool before the log closes).
                once()
                raise
        else:
            # Small: written right after the reply, in the same step of the loop (no await
            # between them, so neither a cancel nor another call comes in between), while
            # the container reads its answer: one call's recording is off its latency.
            reply.after = functools.partial(self.gw._record_after, record)
        return reply


class _Once:
    """Run ``fn`` at most once, from whichever thread claims it first; a later caller
    returns at once, never waiting for the first (a call's recording: on the pool, or
    on the loop when the task awaiting the pool was cancelled). ``fn`` handles its own
    failure (:meth:`Gateway._record_after` stops admission and says why)."""

    __slots__ = ("_claimed", "_fn", "_lock")

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn, self._lock, self._claimed = fn, threading.Lock(), False

    def __call__(self) -> None:
        with self._lock:  # held for the claim only, never while fn runs
            if self._claimed:
                return
            self._claimed = True
        self._fn()


class _Deadline:
    """The call deadline of the running task: what ``asyncio.timeout`` does, without its
    per-call context object and running-loop lookups (a getpid each) on the hot path."""

    __slots__ = ("_cancelling", "_fired", "_handle", "_task")

    def __init__(self, delay_s: float) -> None:
        task = asyncio.current_task()
        assert task is not None  # noqa: S101 - called from a handler task
        self._task = task
        self._fired = False
        self._cancelling = task.cancelling()
        self._handle = task.get_loop().call_later(delay_s, self._fire)

    def _fire(self) -> None:
        self._fired = True
        self._task.cancel()

    def expired(self) -> bool:
        """A CancelledError was this deadline's own (then it is absorbed), not a stop."""
        return self._fired and self._task.uncancel() <= self._cancelling

    def cancel(self) -> None:
        self._handle.cancel()


def _finish(result: ProviderResult, redactor: Redactor, *, stream: bool,
            api: Api, asked_1h: bool = False) -> tuple[ProviderResult, bytes | None, int]:
    """(result with its usage, the answer redacted, how many redactions) of an answer."""
    result = inspected(result, stream=stream, api=api, asked_1h=asked_1h)
    if result.response is None:
        return result, None, 0
    response, redactions = redactor.redact(result.response)
    return result, response, redactions


def _charge(result: ProviderResult, price: Price | None, worst: float | None, *,
            free: bool, writes_1h: bool = False) -> tuple[float | None, CostBasis | None]:
    """(cost, basis) of a finished call. Nothing reached: a known zero. Usage and a price:
    measured. Otherwise, when the call was admitted at a known worst case, that worst
    case (an upper bound: the upstream cannot have generated more). Else unknown."""
    if not result.upstream_reached:
        return 0.0, None
    if free:
        return 0.0, "measured"
    if result.error is None and result.usage is not None:
        measured = cost_usd(result.usage, price, writes_1h=writes_1h)
        if measured is not None:
            return measured, "measured"
    if worst is not None:
        return worst, "upper_bound"
    return None, None


def _json(status: int, obj: object) -> Reply:
    return Reply(status, json.dumps(obj, separators=(",", ":")).encode())


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 502: "api_error", 503: "overloaded_error"}


def _error(status: int, code: str, message: str, *, api: Api | None = None,
           param: str | None = None) -> Reply:
    """An error in the called family's own shape, so its SDK prints the message."""
    if api in ANTHROPIC_APIS:
        return _json(status, {"type": "error", "error": {
            "type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"),
            "message": f"{message} (cyclebox gateway: {code})"}})
    return _json(status, {"error": {"message": message, "type": "cyclebox_gateway",
                                    "code": code, "param": param}})


def sweep_socket_dirs(tmp: Path | None = None, *, dry_run: bool = False) -> list[SweepResult]:
    """Remove gateway socket directories whose owning controller is gone."""
    import tempfile

    from runner.isolation.gc import sweep_owner_dirs

    return sweep_owner_dirs(tmp or Path(tempfile.gettempdir()), SOCKET_DIR_PREFIX + "*",
                            OWNER_NAME, role="gateway-socket", kind="socket_dir",
                            dry_run=dry_run)
