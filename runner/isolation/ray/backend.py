"""Ray implementation of :class:`runner.isolation.sandbox.Sandbox` (the head side).

Each :class:`RunSpec` becomes one Ray task, pinned to a node that advertises the
``cyclebox`` custom resource (one unit per container slot), where the same
:class:`runner.isolation.docker.backend.DockerSandbox` run happens
(:mod:`runner.isolation.ray.node`). The head

- checks every mount under the same rules as a local run *before* anything ships;
- ships inputs as content-addressed tars through the object store (a node fetches one
  only when its cache lacks that digest);
- hands a gateway mount to the node as a relay ticket, never as a socket or key
  (:mod:`runner.isolation.ray.relay`);
- reads the returned output tar with the same safe reader as a local run
  (:func:`runner.isolation.copyout.extract`) into ``spec.output_dir``;
- turns a lost node (or a task that never returned) into a record with stop reason
  ``node_lost``; it never retries a run (a retry would replace a failure, SPEC §2);
- watches the head it joined (:mod:`runner.isolation.ray.headwatch`): once the head is
  lost, every call raises SandboxError naming the cluster (the stage ends as an engine
  failure, exit 6, with a verdict and a receipt) and nothing more is asked of Ray, which
  would otherwise end the controller with exit 1 and nothing written.

- checks that every node has the image ids the plan uses; a node that lacks one gets it
  from the head's own engine (``docker save`` of the id the head resolved, in bounded
  chunks through the object store, ``docker load`` on the node, the id checked there:
  :mod:`runner.isolation.ray.ship`); a node holding a *different* image under the same
  name is refused by name, never overwritten.

Simplification, by design: ``on_output`` hears the stdout/stderr tails once the run has
ended (no live stream).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner import fswalk, interrupts
from runner.errors import (
    ConfigError,
    CycleboxError,
    OutputRejected,
    PolicyViolation,
    PrerequisiteError,
    SandboxError,
)
from runner.failures import one_line
from runner.isolation.copyout import CopyRefused, extract, limits_for
from runner.isolation.docker.backend import TAIL_BYTES, DockerSandbox, check_mount_sources
from runner.isolation.ray import node as node_side
from runner.isolation.ray import ship
from runner.isolation.ray.archive import digest, pack_input, pack_output
from runner.isolation.ray.headwatch import HeadWatch, Target
from runner.isolation.ray.relay import HeadForwarder, Ticket
from runner.isolation.sandbox import (
    OutputCallback,
    RunRecord,
    RunSpec,
    StopReason,
    SweepResult,
)

DEFAULT_RESOURCE = "cyclebox"
GCS_CONNECT_S = 5.0
"""How long the head waits for the cluster's GCS port to accept a connection before
``ray.init`` (which, given a dead or mistyped address, retries for many minutes)."""
RESULT_GRACE_S = 300.0
"""Beyond a run's own timeout: how long the head waits for a node's answer (staging,
input fetch, copy-out, removal) before it records the node as lost."""
CANCEL_GRACE_S = 30.0
DISCARD_WORD_S = 2.0
"""How long a discarded prepared run's node task gets to take the word and remove its
container before it is cancelled (a task still queued for a slot never takes it)."""
EACH_NODE_S = 120.0
"""How long a call on every node (gc, doctor, leftovers, image ids) waits for all of
them together; a node that has not answered by then is skipped and its task cancelled."""
MAILBOX_CONCURRENCY = 10_000
"""Words the mailbox actor may be waited on for at once (one per prepared container of
this head; an async actor: no thread each)."""
INPUT_MEMO_BYTES = 256 * 1024 * 1024
ANSWER_TEXT_MAX = 64 * 1024
"""Characters a node's record may hold in ``detail`` or a label, a refusal in its
message (after which it is cut): far above anything a node's DockerSandbox writes."""
ANSWER_LABELS_MAX = 64
TAR_ENTRY_OVERHEAD = 8 * 1024
"""Tar bytes per output entry beyond its content (header, pax header with a long name,
padding): the bound on a node's output tar is the cap plus this per entry."""
_ERRORS: dict[str, type[CycleboxError]] = {
    c.__name__: c for c in (SandboxError, PrerequisiteError, OutputRejected)}
log = logging.getLogger(__name__)


def _signature(source: Path) -> tuple[Any, ...]:
    """What must not change for a packed input to be reused: every entry's name, type,
    size, mtime and inode (read without following links), walked by directory descriptor
    (:mod:`runner.fswalk`): a path past ``PATH_MAX`` counts like any other, and an entry
    that cannot be read is a ConfigError naming it, never left out."""
    def one(rel: str, st: os.stat_result) -> tuple[Any, ...]:
        return (rel, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)

    try:
        with fswalk.root_entry(source) as top:
            rows = [one(".", top.st)]
            tree = top.is_dir
        if tree:
            rows += [one(e.rel, e.st) for e in fswalk.walk(source, max_depth=4096)]
    except fswalk.WalkError as exc:
        raise ConfigError(f"{source}/{exc}: the input cannot be shipped to a node in full",
                          fix="make every entry of the input readable, with shorter paths "
                          "(or remove it)") from None
    return tuple(rows)


def _clear(root: Path) -> None:
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


def check_reachable(address: str | None, timeout: float = GCS_CONNECT_S) -> None:
    """PrerequisiteError naming the address unless the cluster's GCS (``address``, or what
    Ray's ``auto`` finds: ``RAY_ADDRESS``, the last ``ray start`` on this machine) accepts
    a TCP connection within ``timeout`` seconds; ``ray://`` (Ray Client) is left to Ray."""
    given = address or "auto"
    if given.startswith("ray://"):
        return
    from ray._private.services import canonicalize_bootstrap_address_or_die

    fix = ("Fix: start the cluster (`ray start --head`) or pass --ray-address HOST:PORT "
           "of its head (the GCS port, 6379 unless changed)")
    try:
        resolved = canonicalize_bootstrap_address_or_die(given)
        host, _, port = resolved.rpartition(":")
        where = (host.strip("[]"), int(port))
    except (ConnectionError, ValueError) as exc:
        raise PrerequisiteError(f"Ray cluster not found at {given} ({exc}). {fix}") from None
    try:
        socket.create_connection(where, timeout=timeout).close()
    except OSError as exc:
        raise PrerequisiteError(f"Ray cluster not reachable at {given} ({resolved}: "
                                f"{exc.strerror or exc}). {fix}") from None


def check_mounts(spec: RunSpec) -> None:
    """The local run's mount rules, applied to what the caller named, on the head."""
    for i, m in enumerate(spec.mounts):
        if m.gateway and not (Path(m.source) / node_side.GATEWAY_SOCKET).exists():
            raise PolicyViolation(f"{m.source} holds no gateway socket",
                                  field=f"mounts[{i}]", fix="bind it through the "
                                  "gateway (launcher.launch)")
    check_mount_sources(spec)


def take_answer(spec: RunSpec, node: str, got: object) -> tuple[RunRecord, bytes | None]:
    """The record and output tar of what ``node`` returned for ``spec``, checked before
    the head uses either: a record of this run and role, with the head's labels and the
    node's own id, every field and the tar within bounds; the error a node raised, by
    class name and cut to one line. Anything else is a SandboxError naming the node and
    what was wrong (the cycle fails closed with it). A node is trusted less than the head:
    it may not record another run, case or node, nor hand the head unbounded text.

    (Ray unpickles what a node returns: a node that runs arbitrary code can run it on the
    head too. These checks bound an honest node's mistakes and a container's reach
    through it, not a compromised node; see docs/ray.md.)"""
    where = f"node {node[:12]}"
    if not isinstance(got, dict):
        raise SandboxError(f"{where} answered with a {type(got).__name__}, not a run's answer")
    if "error" in got:
        cls = _ERRORS.get(str(got["error"])[:64], SandboxError)
        raise cls(f"on {where}: {one_line(str(got.get('message', '')), ANSWER_TEXT_MAX)}")
    rec, output = got.get("record"), got.get("output")
    if not isinstance(rec, RunRecord):
        raise SandboxError(f"{where} answered without a run record "
                           f"({type(rec).__name__})")
    if output is not None and not isinstance(output, bytes):
        raise SandboxError(f"{where} answered with an output of type {type(output).__name__}")
    wrong = [f for f, want in (("run_id", spec.run_id), ("role", spec.role))
             if getattr(rec, f) != want]
    if spec.image.startswith("sha256:") and rec.image_id != spec.image:
        wrong.append("image_id")
    wrong += [f"labels[{k}]" for k, v in spec.labels if rec.labels.get(k) != v]
    if rec.labels.get(node_side.NODE_LABEL) != node:
        wrong.append(f"labels[{node_side.NODE_LABEL}]")
    if wrong:
        raise SandboxError(f"{where} answered with a record that is not this run's "
                           f"({', '.join(wrong)} differ from what the head asked): refused")
    big = [f for f in ("stdout_tail", "stderr_tail") if len(getattr(rec, f)) > TAIL_BYTES]
    big += [f for f in ("detail", "container_name", "image_id")
            if len(getattr(rec, f)) > ANSWER_TEXT_MAX]
    if len(rec.labels) > ANSWER_LABELS_MAX or any(
            len(k) + len(v) > ANSWER_TEXT_MAX for k, v in rec.labels.items()):
        big.append("labels")
    bound = spec.output_cap_bytes + (spec.output_max_entries + 2) * TAR_ENTRY_OVERHEAD
    if output is not None and len(output) > bound:
        big.append(f"output ({len(output)} bytes, at most {bound})")
    if big:
        raise SandboxError(f"{where} answered with a record beyond its bounds "
                           f"({', '.join(big)}): refused")
    return rec, output


def read_output(spec: RunSpec, rec: RunRecord, data: bytes,
                seed_links: dict[str, str]) -> RunRecord:
    """The node's output tar into ``spec.output_dir`` through the safe reader; a
    refusal turns an ``ok`` record into ``invalid_output`` / ``output_limit``."""
    assert spec.output_dir is not None  # noqa: S101 - for mypy
    _clear(spec.output_dir)
    lim = limits_for(spec.role, max_bytes=spec.output_cap_bytes,
                     max_entries=spec.output_max_entries)
    try:
        extract([data], spec.output_dir, lim, seed_links=seed_links)
    except CopyRefused as exc:
        if rec.stop_reason is not StopReason.OK:
            return rec
        reason = StopReason.OUTPUT_LIMIT if exc.limit else StopReason.INVALID_OUTPUT
        return rec.model_copy(update={"stop_reason": reason,
                                      "detail": f"output refused on the head: {exc}"})
    return rec


def lost_record(spec: RunSpec, node: str, wall_s: float, why: str) -> RunRecord:
    """The record of a run whose node went away: never a pass, never retried; its
    container (if any) is unknown, so cleanup is not confirmed."""
    return RunRecord(
        run_id=spec.run_id, role=spec.role, image_id=spec.image, container_name="",
        exit_code=None, stop_reason=StopReason.NODE_LOST,
        detail=f"node {node[:12]} lost during the run ({why})", wall_s=wall_s,
        stdout_bytes=0, stderr_bytes=0, stdout_tail="", stderr_tail="",
        cleanup_confirmed=False, labels={**dict(spec.labels), node_side.NODE_LABEL: node})


class RaySandbox:
    """Runs role containers on the nodes of a Ray cluster under the isolation contract."""

    name = "ray"

    def __init__(self, address: str | None = None, *, resource: str = DEFAULT_RESOURCE,
                 relay_host: str | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise PrerequisiteError("the ray backend needs Ray. Fix: pip install "
                                    "'cyclebox[ray]'") from None
        self._ray = ray
        if not ray.is_initialized():
            check_reachable(address)
            # ray.init makes SIGTERM a bare sys.exit: the controller keeps its own handler
            # (runner.interrupts: a stop with a verdict and a whole receipt, exit 130)
            sigterm = signal.getsignal(signal.SIGTERM)
            try:
                ray.init(address=address or "auto", log_to_driver=False,
                         logging_level=logging.ERROR, namespace="cyclebox")
            except Exception as exc:  # whatever Ray raised, named once
                raise PrerequisiteError(
                    f"Ray cluster not reachable at {address or 'auto'} ("
                    f"{one_line(f'{type(exc).__name__}: {exc}', 500)}). Fix: start the "
                    "cluster (`ray start --head`) or pass --ray-address HOST:PORT"
                ) from None
            finally:
                if (sigterm is not None
                        and threading.current_thread() is threading.main_thread()):
                    signal.signal(signal.SIGTERM, sigterm)
        self.address = address or "auto"
        self._watch = _watch_head(ray, self.address)
        self.resource = resource
        self.relay_host = relay_host or str(
            ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        self._forwarder: HeadForwarder | None = None
        self._lock = threading.Lock()
        self._inflight: dict[str, int] = {}
        self._turn = 0
        self._memo: OrderedDict[tuple[Any, ...], tuple[str, Any, int]] = OrderedDict()
        self._memo_bytes = 0
        self.unanswered: list[str] = []
        """Nodes that did not answer the last call on every node (gc, doctor, ...)."""
        self._serve_task = ray.remote(node_side.serve)
        self._mail: Any = None
        self._live: dict[str, RayPreparedRun] = {}
        """Prepared runs whose node task was submitted and not yet released, by key."""
        self._head_engine: DockerSandbox | None = None
        self._ship_lock = threading.Lock()

    # -- the head ----------------------------------------------------------------
    def head_lost(self) -> str | None:
        """Why the head this controller joined is lost (None while it answers)."""
        return self._watch.lost if self._watch is not None else None

    def _head(self) -> None:
        """Before a Ray call that needs the head: SandboxError naming the cluster once
        the head is lost (a call then could end the process with exit 1, unnamed)."""
        if self._watch is not None:
            self._watch.ensure()

    # -- nodes -------------------------------------------------------------------
    def nodes(self) -> list[str]:
        """Ids of the alive nodes that advertise the cyclebox resource."""
        self._head()
        return sorted(n["NodeID"] for n in self._ray.nodes()  # type: ignore[no-untyped-call]
                      if n.get("Alive") and (n.get("Resources") or {}).get(self.resource, 0) > 0)

    def _pick(self) -> str:
        """The alive cyclebox node with the fewest runs in flight from this head."""
        nodes = self.nodes()
        if not nodes:
            raise PrerequisiteError(f"no alive Ray node advertises the {self.resource!r} "
                                    f"resource. Fix: ray start ... --resources "
                                    f"'{{\"{self.resource}\": 2}}' on each Docker node")
        with self._lock:
            self._turn += 1
            order = nodes[self._turn % len(nodes):] + nodes[:self._turn % len(nodes)]
            node = min(order, key=lambda n: self._inflight.get(n, 0))
            self._inflight[node] = self._inflight.get(node, 0) + 1
        return node

    def _release(self, node: str) -> None:
        with self._lock:
            self._inflight[node] -= 1

    def _on(self, node: str) -> dict[str, Any]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

    def _each_node(self, fn: Callable[..., Any], *args: Any) -> list[tuple[str, Any]]:
        """``fn(*args)`` once on every alive cyclebox node; (node, result) per node that
        answered (a node lost meanwhile is skipped: its gc runs when it is back)."""
        task = self._ray.remote(fn)
        refs = {n: task.options(num_cpus=0, max_retries=0, **self._on(n)).remote(*args)
                for n in self.nodes()}
        out = []
        self.unanswered = []
        deadline = time.monotonic() + EACH_NODE_S  # one deadline, however many hang
        for n, ref in refs.items():
            try:
                self._until_ready(ref, deadline)
                out.append((n, self._ray.get(ref, timeout=0)))
            except self._ray.exceptions.RayTaskError as exc:
                raise SandboxError(f"on node {n[:12]}: "
                                   f"{one_line(str(exc.cause or exc), ANSWER_TEXT_MAX)}"
                                   ) from None
            except (self._ray.exceptions.RayError, TimeoutError):
                with contextlib.suppress(Exception):  # no task left running on it
                    self._ray.cancel(ref, force=True)
                self.unanswered.append(n)
                continue
        return out

    def _until_ready(self, ref: Any, deadline: float) -> None:
        """Wait for ``ref`` until ``deadline`` (then ``ray.get`` times out on it),
        SandboxError as soon as the head is lost."""
        while (left := deadline - time.monotonic()) > 0:
            if self._ray.wait([ref], timeout=min(0.5, left))[0]:
                return
            if self._watch is not None:
                self._watch.check()

    def on_each_node(self, fn: Callable[..., Any], *args: Any) -> list[tuple[str, Any]]:
        """``fn(*args)`` on every alive cyclebox node: (node id, result) of each that
        answered (``cyclebox doctor --backend ray``)."""
        return self._each_node(fn, *args)

    # -- inputs ------------------------------------------------------------------
    def _input(self, source: Path) -> tuple[str, Any]:
        """(sha256, object ref) of a packed input; reused while the tree is unchanged."""
        key = (str(source), _signature(source))
        with self._lock:
            hit = self._memo.get(key)
            if hit is not None:
                self._memo.move_to_end(key)
                return hit[0], hit[1]
        data = pack_input(source)
        entry = (digest(data), self._ray.put(data), len(data))
        with self._lock:
            won = self._memo.get(key)
            if won is not None:  # another run packed it meanwhile: one entry, counted once
                return won[0], won[1]
            self._memo[key] = entry
            self._memo_bytes += entry[2]
            while self._memo_bytes > INPUT_MEMO_BYTES and len(self._memo) > 1:
                _, old = self._memo.popitem(last=False)
                self._memo_bytes -= old[2]
        return entry[0], entry[1]

    def _seed(self, root: Path, cap: int, links: dict[str, str]) -> list[Any] | None:
        """The host-made seed of an output directory (walked by descriptor, its symlinks
        into ``links``) as an object ref, or None when the directory is empty."""
        seeded = False
        try:
            for e in fswalk.walk(root, max_depth=4096):
                seeded = True
                if e.is_link:
                    links[e.rel] = e.readlink()
        except fswalk.WalkError as exc:
            raise SandboxError(f"{root}/{exc}: the output directory cannot be seeded "
                               "in full") from None
        return [self._ray.put(pack_output(root, cap))] if seeded else None

    def _forward(self) -> HeadForwarder:
        with self._lock:
            if self._forwarder is None:
                self._forwarder = HeadForwarder(self.relay_host)
            return self._forwarder

    def relay_forwarder(self) -> HeadForwarder:
        """The head's relay listener, started on first use."""
        return self._forward()

    # -- running -----------------------------------------------------------------
    def _mailbox(self) -> Any:
        """The head's mailbox actor (:class:`node_side.Mailbox`), started on first use on
        the head's own node and only there (a soft affinity let Ray place it on a worker
        node whenever the head's raylet was slow to start a worker: losing that node then
        failed every prepared run on the others); its calls queue while it starts."""
        with self._lock:
            if self._mail is None:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                here = str(self._ray.get_runtime_context().get_node_id())
                self._mail = self._ray.remote(node_side.Mailbox).options(
                    num_cpus=0, max_restarts=0, max_concurrency=MAILBOX_CONCURRENCY,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
                ).remote()
            return self._mail

    def _mailbox_lost(self) -> None:
        """The mailbox actor failed: the next prepare starts a new one."""
        with self._lock:
            self._mail = None

    def prepare(self, spec: RunSpec, *,
                cancel: threading.Event | None = None) -> RayPreparedRun:
        """Ship ``spec``'s inputs and start a node task that prepares its container and
        holds it, ready, until :meth:`RayPreparedRun.run` hands the case over (or
        ``discard`` removes it unrun); see :func:`node_side.serve`. Mount rules are
        checked here, before anything ships; what the node refuses is raised by ``run``
        (as a run would raise it); a node lost meanwhile is that run's ``node_lost``
        record. ``cancel`` set: nothing is shipped (the node task, once started,
        is removed by ``discard`` or :meth:`leftovers`)."""
        if cancel is not None and cancel.is_set():
            check_mounts(spec)
            raise SandboxError(f"{spec.role} container not started: the run is stopping")
        return RayPreparedRun(self, spec)

    def run(self, spec: RunSpec, *, on_output: OutputCallback | None = None,
            cancel: threading.Event | None = None) -> RunRecord:
        """Run ``spec`` on a cluster node; the record says which (``io.cyclebox.node``).
        One path: ``prepare(spec).run(...)``."""
        return self.prepare(spec, cancel=cancel).run(on_output=on_output, cancel=cancel)

    def _submit(self, spec: RunSpec, key: str, owner: RayPreparedRun
                ) -> tuple[str, Any, Ticket | None, dict[str, str]]:
        """Pack ``spec``'s inputs, pick its node, bind its relay ticket and start its node
        task: (node, task ref, ticket, the seed's links); ``owner`` is registered under
        ``key`` until it is released (:meth:`leftovers` discards what is still there)."""
        check_mounts(spec)
        self._head()
        inputs: list[tuple[int, str, list[Any]]] = []
        for i, m in enumerate(spec.mounts):
            if not m.gateway:
                dg, ref = self._input(Path(m.source))
                inputs.append((i, dg, [ref]))
        seed_links: dict[str, str] = {}
        seed: list[Any] | None = None
        if spec.output_dir is not None:
            seed = self._seed(spec.output_dir, spec.output_cap_bytes, seed_links)
        mailbox = self._mailbox()
        node = self._pick()
        ticket: Ticket | None = None
        try:
            self._head()
            for m in spec.mounts:
                if m.gateway:
                    src = Path(m.source)
                    ticket = self._forward().add(src / node_side.GATEWAY_SOCKET,
                                                 (src / node_side.GATEWAY_TOKEN).read_bytes())
            # a signal between the submission and the registration would leave a task
            # (and its container) that no discard or leftovers() sweep could find
            with interrupts.deferred():
                ref = self._serve_task.options(
                    num_cpus=0, max_retries=0, resources={self.resource: 1},
                    **self._on(node)).remote(spec, inputs, seed, ticket, key, mailbox)
                with self._lock:
                    self._live[key] = owner
        except BaseException:
            self._release(node)
            if ticket is not None:
                self._forward().remove(ticket)
            raise
        return node, ref, ticket, seed_links

    def _wait(self, ref: Any, spec: RunSpec, node: str, cancel: threading.Event | None,
              started: float) -> tuple[RunRecord | None, object]:
        """(the head's node_lost record, None) or (None, what the node returned): a node
        cannot pass its answer off as the head's own record."""
        ray = self._ray
        deadline = started + spec.timeout_s + RESULT_GRACE_S
        cancelled = False
        while True:
            ready, _ = ray.wait([ref], timeout=0.5)
            if ready:
                break
            if self._watch is not None:
                # the node's run ends with its cluster; the head is asked nothing more
                self._watch.check()
            if cancel is not None and cancel.is_set() and not cancelled:
                # KeyboardInterrupt in the task: DockerSandbox.run's finally removes it
                ray.cancel(ref)
                cancelled = True
                deadline = min(deadline, time.monotonic() + CANCEL_GRACE_S)
            interrupts.check()  # main thread: a first signal whose KeyboardInterrupt was lost
            if time.monotonic() > deadline:
                ray.cancel(ref, force=True)
                return self._lost(spec, node, started, "no answer from the node within "
                                  f"{spec.timeout_s + RESULT_GRACE_S:.0f} s"), None
        try:
            result: object = ray.get(ref)
        except ray.exceptions.TaskCancelledError:
            raise SandboxError(f"{spec.role} container on node {node[:12]} stopped: the run "
                               "is stopping") from None
        except ray.exceptions.RayTaskError as exc:
            raise SandboxError(f"on node {node[:12]}: {type(exc.cause).__name__}: "
                               f"{one_line(str(exc.cause), ANSWER_TEXT_MAX)}") from None
        except ray.exceptions.RayError as exc:
            return self._lost(spec, node, started, f"{type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}"[:300]), None
        return None, result

    def _answered(self, spec: RunSpec, node: str, answer: tuple[RunRecord | None, object],
                  seed_links: dict[str, str], on_output: OutputCallback | None) -> RunRecord:
        lost, got = answer
        if lost is not None:
            return lost  # the head's own record: the node did not answer
        rec, output = take_answer(spec, node, got)
        if spec.output_dir is not None and output is not None:
            rec = read_output(spec, rec, output, seed_links)
        if on_output is not None:
            on_output("stdout", rec.stdout_tail.encode())
            on_output("stderr", rec.stderr_tail.encode())
        return rec

    def _lost(self, spec: RunSpec, node: str, started: float, why: str) -> RunRecord:
        return lost_record(spec, node, round(time.monotonic() - started, 3), why)

    # -- images and cleanup -----------------------------------------------------
    def _node_ids(self, ref: str) -> dict[str, str | None]:
        """Each alive cyclebox node's id for ``ref`` (None where it has none)."""
        ids = {n: i for n, (_, i) in self._each_node(node_side.image_id, ref)}
        if not ids:
            raise PrerequisiteError(f"no alive Ray node advertises the {self.resource!r} "
                                    "resource. Fix: start the Docker nodes")
        return ids

    def head_image_id(self, ref: str) -> str | None:
        """The id ``ref`` names in the head's own engine, i.e. what :meth:`image_id`
        would ship to a node that lacks it; None when nothing can be shipped."""
        with self._ship_lock:
            return self._head_image(ref)

    def _head_image(self, ref: str) -> str | None:
        """The id ``ref`` names in the head's own engine; None without an engine or
        without the image (nothing can be shipped then)."""
        if self._head_engine is None:
            try:
                self._head_engine = DockerSandbox(timeout=int(ship.LOAD_TIMEOUT_S))
            except PrerequisiteError:
                return None
        return self._head_engine.image_id(ref)

    def image_id(self, ref: str) -> str | None:
        """The image's id when every cyclebox node has it (the same id everywhere).

        Nodes that lack it get it from the head's engine (the id the head resolved,
        checked on each node after loading). None when no node has it and the head
        cannot ship it; PrerequisiteError naming the nodes that lack it (head without
        it) or that hold a different image under ``ref`` (never overwritten)."""
        with self._ship_lock:
            ids = self._node_ids(ref)
            present = {i for i in ids.values() if i is not None}
            missing = sorted(n for n, i in ids.items() if i is None)
            if not missing and len(present) == 1:
                return str(present.pop())
            head_id = self._head_image(ref)
            if len(present) > 1:
                raise _differs(ref, ids, head_id)
            if head_id is None:
                if not present:
                    return None
                raise PrerequisiteError(
                    f"image {ref} is not on every node (missing on "
                    f"{[n[:12] for n in missing]}) and the head's engine cannot ship it "
                    f"(no engine or no such image there). Fix: `docker save` the images "
                    "where they were built and `docker load` them on each node (a rebuild "
                    "may give other ids)")
            if present - {head_id}:
                raise _differs(ref, ids, head_id)
            self._ship(ref, head_id, missing)
            after = self._node_ids(ref)
            wrong = {n: after.get(n) for n in sorted(set(after) | set(missing))
                     if after.get(n) != head_id}
            if wrong:
                raise PrerequisiteError(
                    f"image {ref} was shipped but the nodes do not all report the head's "
                    f"{head_id}: " + ", ".join(f"node {n[:12]} has {i}"
                                               for n, i in wrong.items())
                    + ". Fix: check those nodes' engines and run again")
            return head_id

    def _ship(self, ref: str, head_id: str, nodes: list[str]) -> None:
        """``docker save`` of ``head_id`` on the head into one loader per node in
        ``nodes`` (bounded chunks through the object store); PrerequisiteError naming
        the node that refused, died or did not answer in time."""
        assert self._head_engine is not None  # noqa: S101 - _head_image made it
        ray = self._ray
        self._head()
        if self._head_engine.image_size(head_id) > ship.MAX_IMAGE_BYTES:
            raise PrerequisiteError(
                f"image {ref} ({head_id}) is larger than {ship.MAX_IMAGE_BYTES} bytes, the "
                "most shipped to a node. Fix: `docker load` it on each node by hand")
        started = time.monotonic()
        loader = ray.remote(node_side.ImageLoader)
        actors = {n: loader.options(num_cpus=0, max_restarts=0, max_task_retries=0,
                                    **self._on(n)).remote(n, head_id, ref) for n in nodes}
        done = False
        try:
            def send(chunk: Any) -> list[tuple[str, Any]]:
                return [(n, a.write.remote(chunk)) for n, a in actors.items()]

            def settle(calls: list[tuple[str, Any]]) -> None:
                deadline = time.monotonic() + ship.CHUNK_TIMEOUT_S
                for n, call in calls:
                    self._answer(n, call, max(1.0, deadline - time.monotonic()),
                                 f"receiving image {ref}")

            stream = self._head_engine.save_image(head_id, ship.READ_BYTES)
            count, size = ship.pump(
                ship.rechunk(stream, what=f"image {ref} ({head_id})"), ray.put, send, settle)
            finishing = {n: a.finish.remote() for n, a in actors.items()}
            deadline = time.monotonic() + ship.LOAD_TIMEOUT_S
            for n, call in finishing.items():
                self._answer(n, call, max(1.0, deadline - time.monotonic()),
                             f"loading image {ref}")
            done = True
            log.info("shipped image %s (%d bytes, %d chunks) to %d node(s) in %.1f s", ref,
                     size, count, len(nodes), time.monotonic() - started)
        finally:
            if not done:  # the loaders remove their files; a killed one is left to gc
                aborts = [a.abort.remote() for a in actors.values()]
                ray.wait(aborts, num_returns=len(aborts), timeout=ship.ABORT_TIMEOUT_S)
            for a in actors.values():
                ray.kill(a)

    def _answer(self, node: str, call: Any, timeout: float, what: str) -> Any:
        """A loader's answer, or PrerequisiteError naming the node."""
        ray = self._ray
        try:
            return ray.get(call, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise PrerequisiteError(f"node {node[:12]} did not answer within {timeout:.0f} s "
                                    f"while {what}. Fix: check the node, or `docker load` "
                                    "the image there by hand") from None
        except ray.exceptions.RayTaskError as exc:
            raise PrerequisiteError(f"node {node[:12]} refused while {what}: "
                                    f"{exc.cause or exc}") from None
        except ray.exceptions.RayError as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise PrerequisiteError(f"node {node[:12]} was lost while {what} "
                                    f"({type(exc).__name__}: {first[:300]})") from None

    def leftovers(self, run_id: str) -> list[str]:
        """Discard this head's prepared runs of ``run_id`` not yet run, then remove what
        is still labelled with ``run_id`` on every alive node."""
        with self._lock:
            live = [r for r in self._live.values() if r.spec.run_id == run_id]
        for r in live:
            r.discard()
        names: set[str] = set()
        for _, got in self._each_node(node_side.leftovers, run_id):
            names.update(got)
        return sorted(names)

    def sweep(self, *, only_orphans: bool = True, dry_run: bool = False) -> list[SweepResult]:
        """Each alive node's sweep (containers, Docker staging copies, node run
        directories of gone node processes); one row per thing, whichever node saw it."""
        rows: dict[tuple[str, str], SweepResult] = {}
        for _, got in self._each_node(node_side.sweep, only_orphans, dry_run):
            for r in got:
                key = (r.kind, r.name)
                if key not in rows or r.removed:
                    rows[key] = r
        return list(rows.values())

    def close(self) -> None:
        if self._mail is not None and self.head_lost() is None:
            # a task still waiting for its word (none should) removes its container
            with contextlib.suppress(Exception):
                self._ray.kill(self._mail)
            self._mail = None
        if self._forwarder is not None:
            self._forwarder.close()
        if self._watch is not None:
            self._watch.close()


class RayPreparedRun:
    """One container prepared on a node for exactly one case (:meth:`RaySandbox.prepare`):
    a node task (:func:`node_side.serve`) holding the node slot, whose container is
    created with its holder waiting, until ``run`` sends the word that hands the case
    over (a few milliseconds through the head's mailbox actor) or ``discard`` sends the
    one that removes it unrun. ``run`` at most once; after either, the other is refused
    (``run``) or a no-op (``discard``). The task, and so the container, also ends when
    the head dies (the mailbox goes with it) or cancels it (``ray.cancel``)."""

    def __init__(self, sandbox: RaySandbox, spec: RunSpec) -> None:
        self._sandbox = sandbox
        self._spec = spec
        self._key = secrets.token_hex(16)
        self._lock = threading.Lock()
        self._state = "ready"  # -> running | discarded
        self._record: RunRecord | None = None
        self._put: Any = None
        self.node, self._ref, self._ticket, self._links = sandbox._submit(spec, self._key,
                                                                          self)
        self._released = False

    @property
    def spec(self) -> RunSpec:
        return self._spec

    def _claim(self, to: str) -> str:
        with self._lock:
            was = self._state
            if was == "ready":
                self._state = to
            return was

    def _release(self) -> None:
        """The node slot and the relay ticket, once (the node task has ended, or was
        cancelled and given up on)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        with self._sandbox._lock:
            self._sandbox._live.pop(self._key, None)
        self._sandbox._release(self.node)
        if self._ticket is not None:
            self._sandbox._forward().remove(self._ticket)

    def _say(self, word: str) -> None:
        try:
            mailbox = self._sandbox._mailbox()
            self._put = mailbox.put.remote(self._key, word)
        except Exception as exc:  # the mailbox is gone: the task is cancelled instead
            log.debug("mailbox put failed: %s", exc)
            self._sandbox._mailbox_lost()
            with contextlib.suppress(Exception):
                self._sandbox._ray.cancel(self._ref)

    def run(self, *, on_output: OutputCallback | None = None,
            cancel: threading.Event | None = None,
            ended: Callable[[], None] | None = None,
            handing: Callable[[], None] | None = None) -> RunRecord:
        """Hand the case over and follow it to the end (or a limit); the node removes the
        container before it answers. ``cancel`` set before the hand-over: removed unrun
        and SandboxError raised."""
        was = self._claim("running")
        if was == "running":
            if self._record is None:
                raise SandboxError("this prepared container is running its case")
            return self._record
        if was != "ready":
            raise SandboxError(f"the {self._spec.role} container was discarded before it ran")
        spec, sandbox = self._spec, self._sandbox
        try:
            if cancel is not None and cancel.is_set():
                self._end("discard")
                raise SandboxError(f"{spec.role} container not started: the run is stopping")
            sandbox._head()
            started = time.monotonic()
            if handing is not None:
                handing()
            self._say(node_side.RUN)
            answer = sandbox._wait(self._ref, spec, self.node, cancel, started)
        except BaseException:
            if sandbox.head_lost() is None:
                # the wait was cut (a signal): the task's own finally removes the container
                with contextlib.suppress(Exception):
                    sandbox._ray.cancel(self._ref)
            raise
        finally:
            self._release()
            self._forget()
        rec = sandbox._answered(spec, self.node, answer, self._links, on_output)
        if ended is not None:  # the container is gone too: nothing overlaps here
            ended()
        self._record = rec
        return rec

    def discard(self) -> None:
        """Remove the container unrun and wait (bounded) until the node says so; a no-op
        once ``run`` began or after a discard."""
        if self._claim("discarded") != "ready":
            return
        try:
            self._end("discard")
        finally:
            self._release()
            self._forget()

    def _end(self, word: str) -> None:
        """Send ``word`` (not the hand-over) and wait until the task removed its container:
        up to :data:`DISCARD_WORD_S` for the word, then ``ray.cancel`` (a task still queued
        never starts; a running one unwinds through its ``finally``, which removes the
        container) for up to :data:`CANCEL_GRACE_S`, and only then a forced cancel. The head
        watched throughout: once it is lost, nothing more is asked of Ray."""
        sandbox, ray = self._sandbox, self._sandbox._ray
        try:
            sandbox._head()
            self._say(word)
            if self._ended_within(DISCARD_WORD_S):
                return
            ray.cancel(self._ref)
            if self._ended_within(CANCEL_GRACE_S):
                return
            ray.cancel(self._ref, force=True)
        except SandboxError:
            return  # the head is lost: the node's task ends with its cluster
        except Exception as exc:  # what Ray raised about a task that is gone
            log.debug("discard of %s: %s", self._key[:8], exc)

    def _ended_within(self, seconds: float) -> bool:
        """Whether the task ended within ``seconds`` (SandboxError once the head is lost)."""
        self._sandbox._until_ready(self._ref, time.monotonic() + seconds)
        return bool(self._sandbox._ray.wait([self._ref], timeout=0)[0])

    def _forget(self) -> None:
        """The mailbox forgets this key once the task ended (a word no task took: a
        refused prepare, a lost node, a cancel), after the word itself (the ``put``'s ref
        is ``drop``'s argument, so Ray runs it first)."""
        if self._sandbox.head_lost() is not None or self._sandbox._mail is None:
            return
        with contextlib.suppress(Exception):
            self._sandbox._mail.drop.remote(self._key, self._put)


def _watch_head(ray: Any, address: str) -> HeadWatch | None:
    """A watch on the head this driver joined: its GCS port and this driver's raylet;
    None where Ray names neither (Ray Client, ``ray://``)."""
    targets: list[Target] = []
    with contextlib.suppress(Exception):  # whatever this Ray version lacks is not watched
        node = ray._private.worker.global_worker.node
        host, _, port = str(node.gcs_address).rpartition(":")
        targets.append(("GCS", (host.strip("[]"), int(port))))
        targets.append(("raylet", (str(node.node_ip_address), int(node.node_manager_port))))
    return HeadWatch(address, targets, on_lost=_skip_ray_shutdown) if targets else None


def _skip_ray_shutdown() -> None:
    """Once the head is lost, the driver's exit must not go through ``ray.shutdown``
    (registered by Ray with atexit): it waits on the dead head for seconds."""
    with contextlib.suppress(Exception):
        import ray._private.worker

        atexit.unregister(ray._private.worker.shutdown)


def _differs(ref: str, ids: dict[str, str | None], head_id: str | None) -> PrerequisiteError:
    """The refusal for nodes holding another image under ``ref`` than the head (or than
    each other): nothing is overwritten."""
    want = head_id or ""
    rows = ", ".join(f"node {n[:12]} has {i}" for n, i in sorted(ids.items())
                     if i is not None and i != want)
    head = f"the head has {head_id}" if head_id else "the nodes disagree"
    return PrerequisiteError(
        f"image {ref} is a different image on some nodes ({head}; {rows}); nothing was "
        "overwritten. Fix: on those nodes remove or retag it (`docker rmi`), then run again "
        "to ship the head's image, or `docker load` the head's image there")


def open_ray(address: str | None = None, **options: Any) -> RaySandbox:
    """The registry's factory: ``get_sandbox("ray", address=...)``."""
    if address is not None and not address.strip():
        raise ConfigError("empty Ray address", field="ray.address",
                          fix="give HOST:PORT of the cluster's head, or omit it for 'auto'")
    return RaySandbox(address, **options)


