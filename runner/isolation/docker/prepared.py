"""One Docker role container prepared for exactly one case (:class:`DockerPreparedRun`).

``prepare`` creates the container with :mod:`sandbox.holder` as PID 1, attaches to its
stdin/stdout/stderr, starts it, seeds its output tmpfs (a frame on the case channel, no
exec) and waits until the holder is READY (non-dumpable, its relay listening); ``run``
hands the case over (a frame on the holder's stdin: the holder starts the role command
as its child) and follows it to the end: output counted and capped, timeout, copy-out,
then the container is removed and the removal confirmed. ``discard`` removes it unrun.
Whatever happens, the container is removed once and never handed a second case.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import docker.errors
import requests.exceptions
from docker.models.containers import _create_container_args

from runner import interrupts
from runner.errors import SandboxError
from runner.isolation.docker.channel import (
    STOP_GRACE_S,
    CaseChannel,
    _CopyOut,
    _Finish,
    _holder_said,
    _Tail,
)
from runner.isolation.docker.engine_state import flags_from_inspect, killed_from_outside
from runner.isolation.docker.hardening import create_kwargs
from runner.isolation.docker.staging import _seed_tar, _Staging
from runner.isolation.owner import Owner
from runner.isolation.sandbox import (
    OutputCallback,
    RunRecord,
    RunSpec,
    StopReason,
    classify_stop,
)

REMOVED_FROM_OUTSIDE = "cyclebox.removed_from_outside"
"""Key of the state :meth:`DockerPreparedRun.run` stands in for the engine's inspect when
the container is gone (removed from outside before it could be asked)."""


def _removed(image: str) -> dict[str, Any]:
    """The engine's view of a container removed from outside: a named process_failed."""
    return {"Image": image, REMOVED_FROM_OUTSIDE: True,
            "State": {"Running": False, "ExitCode": 137, "OOMKilled": False}}


class _Engine(Protocol):
    """What a prepared run needs of :class:`runner.isolation.docker.backend.DockerSandbox`."""

    client: Any
    owner: Owner

    def _stopped(self, cid: str, within_s: float = 0.0) -> dict[str, Any] | None: ...

    def _gone(self, cid: str, within_s: float = 0.0) -> bool: ...

    def _remove(self, cid: str) -> bool: ...

    def _remove_late(self, name: str, within_s: float = 3.0) -> None: ...

FINISH_BASE_S = 30.0
FINISH_BYTES_PER_S = 32 * 1024 * 1024
READY_TIMEOUT_S = 10.0
"""How long the holder may take to protect its output stream before the run fails."""
SEED_TIMEOUT_S = 60.0
EXIT_WAIT_S = 1.0
"""How long a removal waits for a holder that wrote its last frame to exit (then forced)."""


class _DiedEarly(Exception):
    """The container stopped (killed from outside) before its role command could run."""

    def __init__(self, state: dict[str, Any]) -> None:
        super().__init__("container stopped before its command ran")
        self.state = state


class _Cancelled(SandboxError):
    """The caller is stopping: the container is removed before its command ever runs."""


class DockerPreparedRun:
    """A started container whose holder waits for its one case (see the module docstring)."""

    def __init__(self, backend: _Engine, spec: RunSpec, staged: _Staging, *,
                 cancel: threading.Event | None = None) -> None:
        self._backend = backend
        self._cancel = cancel
        self._spec = spec
        self._staged = staged
        self.kwargs = create_kwargs(staged.spec, backend.owner, secrets.token_hex(4),
                                    holder_dir=staged.holder)
        self.cid: str | None = None
        self.channel: CaseChannel | None = None
        self.copy: _CopyOut | None = None
        self._died: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._state = "preparing"  # -> ready -> running | discarded -> removed
        self._record: RunRecord | None = None
        self._confirmed = True
        try:
            self._prepare()
        except BaseException:
            self._release()
            raise
        self._state = "ready"

    @property
    def spec(self) -> RunSpec:
        return self._spec

    # -- prepare ---------------------------------------------------------------------
    def _prepare(self) -> None:
        spec = self._staged.spec
        api = self._backend.client.api
        seed_links: dict[str, str] = {}
        seed = _seed_tar(spec, seed_links)
        self._check_cancel()
        try:
            # the model layer's create() also inspects the new container: skip that
            args = _create_container_args({**self.kwargs, "version": api._version})
            name = args.pop("name")
            if isinstance(args.get("environment"), dict):
                args["environment"] = docker.utils.utils.format_environment(
                    args["environment"])
            config = api.create_container_config(**args)
            # the engine closes the holder's stdin when the host's attach ends: with the
            # host's process gone before the hand-over, the holder sees EOF and the
            # container ends (docker-py sets StdinOnce only for attached, non-detached
            # runs). No proxy settings of the host's docker config are added either.
            config["StdinOnce"] = True
            self.cid = str(api.create_container_from_config(config, name)["Id"])
        except docker.errors.ImageNotFound:
            raise SandboxError(f"image {spec.image} for role {spec.role} is not present "
                               "locally. Fix: cyclebox images build") from None
        except docker.errors.APIError as exc:
            raise SandboxError(f"engine refused to create the {spec.role} container: "
                               f"{exc.explanation or exc}") from None
        except BaseException:
            # Interrupted (a signal) with the request sent: the engine may still be
            # creating it, and there is no id to remove yet; remove it by name.
            self._backend._remove_late(str(self.kwargs["name"]))
            raise
        cid = self.cid
        self._check_cancel()
        try:
            # stdin too: the hand-over is a frame on the holder's stdin, and only ours
            sock = api.attach_socket(cid, params={"stdin": 1, "stdout": 1, "stderr": 1,
                                                  "stream": 1})
            self.channel = channel = CaseChannel(sock)
            self.copy = copy = _CopyOut(spec, seed_links, channel.stream())
            api.start(cid)
            copy.start()
            if not self._wait_ready(copy, cid) or not copy.ready_ok:
                raise SandboxError(f"the {spec.role} container's holder did not protect "
                                   f"its output stream within {READY_TIMEOUT_S:.0f} s"
                                   + _holder_said(copy.errs.text()))
            if seed is not None:
                channel.seed(seed)
                deadline = time.monotonic() + SEED_TIMEOUT_S
                while not channel.seeded.wait(0.1) and time.monotonic() < deadline:
                    self._check_cancel()
                if not channel.seeded.is_set() or not channel.seed_reply.get("ok"):
                    raise SandboxError(f"could not seed the {spec.role} output directory: "
                                       + (str(channel.seed_reply.get("error"))[:300]
                                          if channel.seed_reply else "no answer"))
            if spec.warm:
                # after READY and the seed's answer: no unsealed frame can follow the key
                channel.warm(list(spec.command), spec.warm)
        except _Cancelled:
            raise
        except (SandboxError, docker.errors.APIError, OSError,
                requests.exceptions.RequestException) as exc:
            # The container stopped under us (docker kill right after start): a run
            # that ended, named, rather than an engine failure that ends the cycle.
            dead = self._backend._stopped(cid, within_s=2.0)  # a kill may still be landing
            if dead is not None and killed_from_outside(dead, ours=False):
                self._died = dead
                return
            if self._backend._gone(cid, within_s=2.0):  # a removal may still be landing
                # removed from outside (`docker rm -f`) while it was being prepared
                self._died = _removed(spec.image)
                return
            if isinstance(exc, SandboxError):
                raise
            raise SandboxError(f"engine could not start the {spec.role} container: "
                               f"{getattr(exc, 'explanation', None) or exc}") from None

    def _check_cancel(self) -> None:
        if self._cancel is not None and self._cancel.is_set():
            raise _Cancelled(f"{self._spec.role} container not started: the run is stopping")

    def _wait_ready(self, copy: _CopyOut, cid: str) -> bool:
        """Wait for the holder's readiness marker (:data:`READY_TIMEOUT_S`); False at once
        when the container stopped meanwhile (its attach stream may stay open). A caller
        stopping (``cancel``) must not wait for it: it exits within its grace period, and
        a wait past that would leave this run's staging copy behind."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not copy.ready.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            self._check_cancel()
            if time.monotonic() >= deadline or self._backend._stopped(cid) is not None:
                return False
        return True

    # -- use once --------------------------------------------------------------------
    def discard(self) -> None:
        """Remove the container unrun (a no-op once ``run`` began or after a discard)."""
        with self._lock:
            if self._state != "ready":
                return
            self._state = "discarded"
        self._release()

    def run(self, *, on_output: OutputCallback | None = None,
            cancel: threading.Event | None = None,
            ended: Callable[[], None] | None = None,
            handing: Callable[[], None] | None = None) -> RunRecord:
        """Hand the case over and run it to the end (or a limit); always remove.

        ``cancel`` set before the hand-over: removed unrun and SandboxError raised (a
        caller stopping a run sweeps the containers that exist; this closes the gap for
        one prepared meanwhile). ``ended`` is called once the command ended and its output
        is copied out, before the container is removed (the scheduler lets the next case
        start: the removal and its confirmation overlap it; the record still waits for
        them). A second ``run`` returns the first one's record; ``run`` after ``discard``
        raises SandboxError."""
        with self._lock:
            if self._state == "running":
                if self._record is None:
                    raise SandboxError("this prepared container is running its case")
                return self._record
            if self._state != "ready":
                raise SandboxError(f"the {self._spec.role} container was discarded "
                                   "before it ran")
            self._state = "running"
        try:
            if cancel is not None and cancel.is_set():
                raise SandboxError(f"{self._spec.role} container not started: "
                                   "the run is stopping")
            record = self._run(on_output, cancel, handing)
            if ended is not None:
                ended()
        finally:
            self._release()
        if not self._confirmed:  # outranks every other reason (classify_stop)
            record = record.model_copy(update={
                "cleanup_confirmed": False, "stop_reason": StopReason.CLEANUP_UNCONFIRMED,
                "detail": "container still known to the engine after removal"})
        self._record = record
        return record

    def _release(self) -> None:
        """Remove the container (confirmed by asking the engine) and the staged inputs."""
        try:
            if self.channel is not None:
                self.channel.close()
            if self.cid is not None:
                if self.copy is not None and self.copy.finished:
                    # the holder wrote its last frame and is exiting: the engine removes
                    # an exited container faster than it kills and removes an exiting one
                    self.copy.closed.wait(EXIT_WAIT_S)
                self._confirmed = self._backend._remove(self.cid)
                self.cid = None
        finally:
            self._staged.cleanup()

    def _run(self, on_output: OutputCallback | None, cancel: threading.Event | None,
             handing: Callable[[], None] | None = None) -> RunRecord:
        spec = self._staged.spec
        api = self._backend.client.api
        started = time.monotonic()
        out, err = _Tail(), _Tail()
        stream_exceeded = threading.Event()
        stopping = threading.Event()
        timed_out = ours_killed = False
        fin = _Finish()
        cid, channel, copy = self.cid, self.channel, self.copy
        if self._died is not None or cid is None or channel is None or copy is None:
            return self._make_record(self._died or {}, None, fin, out, err, started,
                                     timed_out=False, stream_exceeded=False,
                                     ours_killed=False)

        def stop_role(flag: threading.Event | None) -> None:
            # Never block the channel's thread on the engine. SIGUSR1 makes the holder
            # kill every role process and copy the output out; repeated until it says
            # so (a signal before its mask is set up, its first few ms, is dropped).
            if flag is not None:
                flag.set()
            if stopping.is_set():
                return
            stopping.set()

            def _stop() -> None:
                # the stop frame first, then the signal: the holder ends the case only
                # with both (sandbox.holder.F_STOP: a role can forge neither)
                with contextlib.suppress(OSError):
                    channel.ask_stop()
                for _ in range(int(STOP_GRACE_S / 0.05)):
                    with contextlib.suppress(docker.errors.APIError,
                                             requests.exceptions.RequestException):
                        api.kill(cid, signal="SIGUSR1")
                    if copy.announced.wait(0.05) or copy.done.is_set():
                        return

            threading.Thread(target=_stop, daemon=True).start()

        live = [on_output]

        def sink(kind: str, data: bytes) -> None:
            (out if kind == "stdout" else err).add(data)
            cb = live[0]
            if cb is not None and not stream_exceeded.is_set():
                try:
                    cb(kind, data)
                except Exception:
                    live[0] = None
            if out.total + err.total > spec.stdout_cap_bytes and not stream_exceeded.is_set():
                stop_role(stream_exceeded)

        channel.attach(sink)
        if any(channel.early_dropped.values()):  # written before the hand-over, not kept
            out.total += channel.early_dropped["stdout"]
            err.total += channel.early_dropped["stderr"]
            if out.total + err.total > spec.stdout_cap_bytes:
                stop_role(stream_exceeded)
        deadline = time.monotonic() + spec.timeout_s
        if handing is not None:
            handing()
        with contextlib.suppress(OSError):  # the attach is gone: the end below names it
            channel.hand_over(list(spec.command))
        stopping_run = False
        while not channel.ended.wait(min(0.25, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                timed_out = True
                break
            if cancel is not None and cancel.is_set():
                # the caller is stopping (and exits within its grace): end it now
                stopping_run = True
                break
            # on the main thread (a stage's single container): a first signal whose
            # KeyboardInterrupt was swallowed unwinds here, as it would have in the wait
            interrupts.check()
        if timed_out or stream_exceeded.is_set() or stopping_run:
            stop_role(None)
        copy.done.wait(STOP_GRACE_S if stopping_run else STOP_GRACE_S + FINISH_BASE_S
                       + spec.output_cap_bytes / FINISH_BYTES_PER_S)
        if not copy.done.is_set():
            ours_killed = True
            with contextlib.suppress(docker.errors.APIError):
                api.kill(cid)
            copy.done.wait(10)
        if cancel is not None and cancel.is_set():
            # the caller is stopping: its own sweep kills and removes the run's containers,
            # so a kill seen now is the controller's, not one "from outside"
            ours_killed = True
        code = channel.exit_code if channel.exit_reported else None
        # no exit status (or SIGKILL): was the whole container killed under us?
        dead = None
        if code in (None, 137):
            dead = self._backend._stopped(cid, within_s=1.0)
        fin = copy.result(holder_gone=dead is not None
                          and killed_from_outside(dead, ours=ours_killed) is not None)
        state: dict[str, Any] = {"Image": spec.image}
        if not (code is not None and code != 137 and not fin.invalid and not fin.oom_kills
                and dead is None and spec.image.startswith("sha256:")):
            # The engine's view is needed: an OOM flag (the holder killed), an outside
            # kill, the image a tag resolved to. Not when the holder reported the exit and
            # finished its copy-out itself: then it was neither killed nor out of memory.
            try:
                state = api.inspect_container(cid)
            except docker.errors.NotFound:  # `docker rm -f` from outside: a named failure
                state = _removed(spec.image)
        return self._make_record(state, code, fin, out, err, started, timed_out=timed_out,
                                 stream_exceeded=stream_exceeded.is_set(),
                                 ours_killed=ours_killed)

    def _make_record(self, state: dict[str, Any], code: int | None, fin: _Finish,
                     out: _Tail, err: _Tail, started: float, *, timed_out: bool,
                     stream_exceeded: bool, ours_killed: bool) -> RunRecord:
        spec = self._staged.spec
        flags = flags_from_inspect(state, code, oom_kills=fin.oom_kills, timed_out=timed_out,
                                   stream_exceeded=stream_exceeded,
                                   output_dir_exceeded=fin.limit, output_invalid=fin.invalid,
                                   output_detail=fin.detail, cleanup_confirmed=True)
        reason, detail = classify_stop(flags)
        exit_code = flags.exit_code
        if self.channel is not None and code is None and self.channel.refused:
            detail = f"{detail}; the holder's channel was refused: {self.channel.refused}"
        elif self.channel is not None and code is None and self.channel.start_error:
            detail = f"{detail}; the holder refused the case: {self.channel.start_error}"

        outside = ("the container was removed from outside the controller (e.g. docker "
                   "rm -f)" if state.get(REMOVED_FROM_OUTSIDE) and not ours_killed
                   else killed_from_outside(state, ours=ours_killed))
        if outside is not None and reason is StopReason.PROCESS_FAILED:
            detail = outside if code is None else f"{outside}; the command: {detail}"
            exit_code = int(state["State"]["ExitCode"])  # what ended it: the outside kill
        return RunRecord(
            run_id=spec.run_id, role=spec.role, image_id=str(state.get("Image", spec.image)),
            container_name=str(self.kwargs["name"]), exit_code=exit_code, stop_reason=reason,
            detail=detail, wall_s=round(time.monotonic() - started, 3),
            stdout_bytes=out.total, stderr_bytes=err.total,
            stdout_tail=out.text(), stderr_tail=err.text(), cleanup_confirmed=True,
            labels=dict(self.kwargs["labels"]), egress_refused=fin.egress,
            egress_refused_count=fin.egress_count,
        )
