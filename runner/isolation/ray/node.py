"""What a Ray task runs on a node: the same :class:`DockerSandbox` run as locally.

Everything a node keeps lives under ``$CYCLEBOX_RAY_NODE_DIR`` (default
``<tmp>/cyclebox-ray-<uid>``), one subdirectory per Ray node id: ``inputs/<sha256>``
(the content-addressed input cache), ``runs/<pid>-<start>-<rand>`` (one run's output
directory and gateway relay socket) and ``loads/<pid>-<start>-<rand>`` (an image the
head is shipping, on its way into ``docker load``); the last two carry an owner record
so ``cyclebox gc`` removes those of a killed worker. Nothing here reads a model
credential; none is ever sent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from runner.errors import CycleboxError, PrerequisiteError, SandboxError
from runner.isolation.owner import current_owner
from runner.isolation.ray.archive import cached, pack_output, unpack_input, unpack_seed
from runner.isolation.ray.relay import NodeRelay, Ticket
from runner.isolation.ray.ship import LOAD_TIMEOUT_S, MAX_CHUNKS, MAX_IMAGE_BYTES, Received
from runner.isolation.roles import fresh_output_dir
from runner.isolation.sandbox import LABEL_PREFIX, RunRecord, RunSpec, SweepResult

NODE_DIR_ENV = "CYCLEBOX_RAY_NODE_DIR"
NODE_LABEL = f"{LABEL_PREFIX}.node"
"""Record label: the Ray node id the container ran on."""
WORKER_PID_LABEL = f"{LABEL_PREFIX}.node_pid"
"""Record label: the node process that ran the container and its gateway relay."""
OWNER_NAME = "owner.json"
GATEWAY_SOCKET = "gateway.sock"
GATEWAY_TOKEN = "token"  # noqa: S105 - a file name

_docker: Any = None


def node_id() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def node_root() -> Path:
    """This host's directory for every node it runs (``$CYCLEBOX_RAY_NODE_DIR``)."""
    return Path(os.environ.get(NODE_DIR_ENV)
                or Path(tempfile.gettempdir()) / f"cyclebox-ray-{os.getuid()}")


def node_base(node: str | None = None) -> Path:
    return node_root() / (node or node_id())[:16]


def _own_dir(path: Path) -> Path:
    """``path`` as a directory of this user that no one else can write or list (made
    0711 when absent); SandboxError naming it when it is a link, not a directory or
    another user's: in a shared ``/tmp`` another local user could have made it first
    and would then plant cached inputs (mounted into role containers) or swap run
    directories."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o711)
    st = path.lstat()
    why = ("a symlink" if stat.S_ISLNK(st.st_mode) else
           "not a directory" if not stat.S_ISDIR(st.st_mode) else
           f"owned by uid {st.st_uid}" if st.st_uid != os.getuid() else
           "writable by other users" if stat.S_IMODE(st.st_mode) & 0o022 else None)
    if why is not None:
        raise SandboxError(f"node directory {path} is {why}, not a private directory of "
                           f"uid {os.getuid()}. Fix: set {NODE_DIR_ENV} on this node to a "
                           "private directory and restart its raylet")
    if stat.S_IMODE(st.st_mode) & 0o044:
        os.chmod(path, 0o711)  # noqa: S103 - others may traverse, not list
    return path


def own_base(node: str) -> Path:
    """This node's directory with its ``inputs`` and ``runs``, each checked to be this
    user's own (:func:`_own_dir`) before anything in them is trusted."""
    root = node_root()
    root.parent.mkdir(parents=True, exist_ok=True)
    _own_dir(root)
    base = _own_dir(node_base(node))
    _own_dir(base / "inputs")
    _own_dir(base / "runs")
    return base


def _sandbox() -> Any:
    """This worker process's Docker backend (one per process, reused across tasks)."""
    global _docker  # noqa: PLW0603
    if _docker is None:
        from runner.isolation.docker.backend import DockerSandbox

        _docker = DockerSandbox()
    return _docker


def docker_sandbox() -> Any:
    """This node's Docker backend (raises the engine's error when it is unreachable)."""
    return _sandbox()


RUNS = "runs"
LOADS = "loads"
SCRATCH_KINDS = {RUNS: ("node_run_dir", "ray-node-run"),
                 LOADS: ("node_load_dir", "ray-node-load")}
"""Owned scratch directories under a node's base: (sweep kind, sweep role)."""
LOAD_FILE = "image.tar"


def _scratch(base: Path, kind: str = RUNS, mode: int = 0o711) -> Path:
    """A fresh ``base/kind/<pid>-<start>-<rand>`` with this process's owner record
    (``mode`` 0o711 for runs: the role uid traverses to its socket)."""
    parent = base / kind
    parent.mkdir(parents=True, exist_ok=True, mode=mode)
    os.chmod(parent, mode)
    me = current_owner()
    work = Path(tempfile.mkdtemp(prefix=f"{me.pid}-{me.start}-", dir=parent))
    os.chmod(work, mode)
    (work / OWNER_NAME).write_text(json.dumps(asdict(me)))
    return work


def _stage(spec: RunSpec, inputs: list[tuple[int, str, list[Any]]], seed: list[Any] | None,
           ticket: Ticket | None, base: Path, work: Path) -> tuple[RunSpec, NodeRelay | None]:
    """``spec`` as this node runs it: each input from the content-addressed cache
    (fetched on a miss), the gateway mount a relay to the head in ``work``, the output
    directory fresh in ``work`` and seeded. The relay (or None) is the caller's to close,
    on every way out, once the run ended."""
    import ray

    relay: NodeRelay | None = None
    try:
        mounts = list(spec.mounts)
        for i, expected, refs in inputs:
            path = cached(base / "inputs", expected)
            if path is None:
                path = unpack_input(ray.get(refs[0]), expected, base / "inputs")
            mounts[i] = mounts[i].model_copy(update={"source": path})
        for i, m in enumerate(mounts):
            if m.gateway:
                if ticket is None or relay is not None:
                    raise CycleboxError("a gateway mount arrived without its own relay ticket")
                relay = NodeRelay(work / "g", ticket, uid=spec.uid, socket_name=GATEWAY_SOCKET,
                                  token_name=GATEWAY_TOKEN)
                mounts[i] = m.model_copy(update={"source": work / "g"})
        out = None
        if spec.output_dir is not None:
            out = fresh_output_dir(work / "out")
            if seed:
                unpack_seed(ray.get(seed[0]), out, spec.output_cap_bytes)
    except BaseException:
        if relay is not None:
            relay.close()
        raise
    return spec.model_copy(update={"mounts": tuple(mounts), "output_dir": out}), relay


def _answer(spec: RunSpec, node_spec: RunSpec, rec: RunRecord, node: str) -> dict[str, Any]:
    """The record (labelled with this node and process) and the output tar."""
    out = node_spec.output_dir
    output = pack_output(out, spec.output_cap_bytes) if out is not None else None
    rec = rec.model_copy(update={"labels": {**rec.labels, NODE_LABEL: node,
                                            WORKER_PID_LABEL: str(os.getpid())}})
    return {"record": rec, "output": output, "node": node}


def _refusal(exc: CycleboxError, node: str) -> dict[str, Any]:
    return {"error": type(exc).__name__, "message": str(exc), "node": node}


RUN = "run"
"""The head's word that hands a prepared container its case (anything else discards it)."""


def serve(spec: RunSpec, inputs: list[tuple[int, str, list[Any]]], seed: list[Any] | None,
          ticket: Ticket | None, key: str, mailbox: Any) -> dict[str, Any]:
    """Prepare ``spec``'s container here, then wait for the head's word on ``key``
    (``mailbox.wait``): :data:`RUN` hands the case over and follows it to the end;
    anything else (or the mailbox gone with its head, or this task cancelled) removes the
    container unrun. The task holds its node slot (one ``cyclebox`` unit) throughout,
    so a prepared container counts against the node like a running one.

    ``inputs`` are (mount index, sha256, [object ref]) (the ref is fetched only on a
    cache miss), ``seed`` the output directory's seed tar. Returns the record and the
    output tar, ``{"discarded": True}``, or the error the prepare or run raised (by
    class name). One task, one container, one case: nothing here is ever reused."""
    node = node_id()
    base = own_base(node)
    work = _scratch(base)
    relay: NodeRelay | None = None
    prepared: Any = None
    try:
        node_spec, relay = _stage(spec, inputs, seed, ticket, base, work)
        if _peek(mailbox, key) not in ("", RUN):  # discarded while it waited for a slot
            return {"discarded": True, "node": node}
        try:
            prepared = _sandbox().prepare(node_spec)
        except CycleboxError as exc:
            return _refusal(exc, node)
        if _word(mailbox, key) != RUN:
            return {"discarded": True, "node": node}
        try:
            rec = prepared.run()
        except CycleboxError as exc:
            return _refusal(exc, node)
        return _answer(spec, node_spec, rec, node)
    finally:
        try:
            if prepared is not None:
                prepared.discard()  # a no-op once it ran: removed unrun otherwise
        finally:
            _drop(relay, work)


def _word(mailbox: Any, key: str) -> str:
    """The head's word on ``key`` (blocks; the task keeps its node slot meanwhile)."""
    import ray

    return str(ray.get(mailbox.wait.remote(key)))


def _peek(mailbox: Any, key: str) -> str:
    import ray

    return str(ray.get(mailbox.peek.remote(key)))


class Mailbox:
    """The head's words to the node tasks holding its prepared containers (a Ray actor
    on the head's node, owned by the head: should the head die, every waiting task's
    ``wait`` fails and its container is removed unrun). Keys are 128-bit secrets, one per
    prepared container; a word is delivered once, whichever of ``put`` and ``wait``
    comes first."""

    def __init__(self) -> None:
        self._words: dict[str, str] = {}
        self._events: dict[str, Any] = {}

    def _event(self, key: str) -> Any:
        import asyncio

        return self._events.setdefault(key, asyncio.Event())

    async def wait(self, key: str) -> str:
        try:
            await self._event(key).wait()
            return self._words.get(key, "")
        finally:
            self._events.pop(key, None)
            self._words.pop(key, None)

    async def put(self, key: str, word: str) -> None:
        self._words[key] = word
        self._event(key).set()

    async def peek(self, key: str) -> str:
        """The word on ``key`` if one came (a task checks before it builds anything)."""
        return self._words.get(key, "")

    async def drop(self, key: str, _after: object = None) -> None:
        """Forget ``key`` (its task ended; ``_after`` is the ``put``'s result, so this
        runs after it)."""
        self._events.pop(key, None)
        self._words.pop(key, None)

    async def size(self) -> int:
        return len(self._events)


def _drop(relay: NodeRelay | None, work: Path | None) -> None:
    try:
        if relay is not None:
            relay.close()
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def image_id(ref: str) -> tuple[str, str | None]:
    """(node id, the image's id on this node's engine or None)."""
    return node_id(), _sandbox().image_id(ref)


class ImageEngine(Protocol):
    """What a loader needs of this node's engine (:class:`DockerSandbox`)."""

    def load_image(self, archive: Path) -> None: ...
    def image_id(self, ref: str) -> str | None: ...
    def tag_image(self, image_id: str, ref: str) -> None: ...


class ImageLoader:
    """One image on its way from the head into this node's engine (a Ray actor pinned
    to the node): ``write`` each chunk in order, then ``finish``; ``abort`` (or the
    owner record, once this process is gone) removes what was written."""

    def __init__(self, node: str, image_id: str, ref: str, *,
                 max_bytes: int = MAX_IMAGE_BYTES, max_chunks: int = MAX_CHUNKS) -> None:
        self.node, self.image_id, self.ref = node, image_id, ref
        self.received = Received(max_bytes=max_bytes, max_chunks=max_chunks)
        self.work = _scratch(own_base(node), LOADS, mode=0o700)
        self.path = self.work / LOAD_FILE
        self._file: BinaryIO | None = self.path.open("xb")

    def write(self, data: bytes) -> int:
        """Append one chunk; the bytes received so far. Past a cap, everything written
        is removed and PrerequisiteError raised."""
        if self._file is None:
            raise PrerequisiteError("image transfer refused: the load already ended")
        try:
            self.received.take(len(data))
            self._file.write(data)
        except BaseException:
            self.abort()
            raise
        return self.received.bytes

    def finish(self, engine: ImageEngine | None = None) -> str:
        """``docker load`` the file (streamed), remove it, and return the id ``ref`` now
        names here: the head's id, or PrerequisiteError. ``ref`` is only ever given a
        name where it named nothing: a different image under it is never replaced."""
        try:
            if self._file is None:
                raise PrerequisiteError("image transfer refused: the load already ended")
            self._file.close()
            self._file = None
            if engine is None:
                from runner.isolation.docker.backend import DockerSandbox

                engine = DockerSandbox(timeout=int(LOAD_TIMEOUT_S))
            engine.load_image(self.path)
            loaded = engine.image_id(self.image_id)
            if loaded != self.image_id:
                raise PrerequisiteError(f"the image loaded on node {self.node[:12]} is not "
                                        f"{self.image_id} (found {loaded})")
            now = engine.image_id(self.ref)
            if now is None and not self.ref.startswith("sha256:"):
                engine.tag_image(self.image_id, self.ref)
                now = engine.image_id(self.ref)
            if now != self.image_id:
                raise PrerequisiteError(
                    f"on node {self.node[:12]} {self.ref} names {now}, not the head's "
                    f"{self.image_id}; it was left as it is")
            return now
        finally:
            self.abort()

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        shutil.rmtree(self.work, ignore_errors=True)


def leftovers(run_id: str) -> list[str]:
    return list(_sandbox().leftovers(run_id))


def sweep(only_orphans: bool, dry_run: bool) -> list[SweepResult]:
    """This host's labelled containers and Docker staging copies, then the scratch
    directories (a run's output and relay socket, an image on its way to ``docker
    load``) of node processes that are gone: those of every node this host ran, so a
    node that was lost is cleaned by one that is alive. Owners are judged by pid, start
    time and boot id, so only this host's are ever removed."""
    found = list(_sandbox().sweep(only_orphans=only_orphans, dry_run=dry_run))
    return found + sweep_scratch(dry_run=dry_run)


def sweep_scratch(*, dry_run: bool) -> list[SweepResult]:
    """The node scratch directories (``runs``, ``loads``) of processes that are gone."""
    from runner.isolation.gc import sweep_staging_dirs

    found: list[SweepResult] = []
    root = node_root()
    if not root.is_dir() or root.is_symlink() or root.stat().st_uid != os.getuid():
        return found
    for base in sorted(root.iterdir()):
        for sub, (kind, role) in SCRATCH_KINDS.items():
            d = base / sub
            if base.is_symlink() or d.is_symlink() or not d.is_dir():
                continue
            found += [SweepResult(**{**asdict(r), "kind": kind, "role": role})
                      for r in sweep_staging_dirs(d, owner_name=OWNER_NAME,
                                                  dry_run=dry_run)]
    return found
