"""The sandbox interface the orchestrator sees, and the typed values it trades in.

Docker is one implementation (:mod:`runner.isolation.docker.backend`); nothing outside that
module knows it is Docker. Specs and records are frozen pydantic models so that
they can be hashed into plans and receipts as they are.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from runner.errors import SandboxError

WARM_MODULES_MAX = 64
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_PYTHON = re.compile(r"^python(3(\.[0-9]+)?)?$")


def warm_refusal(command: Sequence[str], modules: Sequence[str]) -> str | None:
    """Why ``command`` cannot be warm-started with ``modules`` (None when it can): the
    interpreter must be ``python``/``python3``/``python3.N`` given a script or ``-m
    MODULE`` and nothing else before it (an interpreter flag would change what the warm
    interpreter is); each module a dotted Python name."""
    if not modules:
        return None
    if len(modules) > WARM_MODULES_MAX:
        return f"at most {WARM_MODULES_MAX} modules may be warmed ({len(modules)} given)"
    bad = [m for m in modules if not _MODULE.match(m) or len(m) > 200]
    if bad:
        return f"not a Python module name: {bad[0][:80]!r}"
    argv = list(command)
    if len(argv) < 2 or not _PYTHON.match(argv[0].rsplit("/", 1)[-1]):
        return ("a warm start needs an entry run by python: [python, SCRIPT, ...] or "
                f"[python, -m, MODULE, ...] (got {argv[:2]!r})")
    if argv[1] == "-m":
        if len(argv) < 3 or not _MODULE.match(argv[2]):
            return "a warm start's [python, -m, MODULE, ...] needs a module name"
        entry = argv[2]
    elif argv[1].startswith("-"):
        return (f"a warm start takes no interpreter option ({argv[1]!r}): "
                "[python, SCRIPT, ...] or [python, -m, MODULE, ...]")
    else:
        entry = argv[1].rsplit("/", 1)[-1].removesuffix(".py")
    own = [m for m in modules if m == entry or m.startswith(entry + ".")]
    if own:
        return (f"{own[0]!r} is the entry itself: warming it would run its top-level code "
                "before the case and again as __main__; list the libraries it imports")
    return None


LABEL_PREFIX = "io.cyclebox"
"""Every label a backend puts on what it creates starts with this."""
MANAGED_LABEL = f"{LABEL_PREFIX}.managed"
"""Set to ``1`` on every container a backend starts; gc looks at nothing else."""


class Frozen(BaseModel):
    """Base for every cyclebox value: immutable, unknown keys refused. The docstring under
    a field is its description in the JSON schema (``cyclebox schema NAME``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class StopReason(StrEnum):
    """Why a role container stopped (SPEC §2)."""

    OK = "ok"
    TIMEOUT = "timeout"
    OOM = "oom"
    OUTPUT_LIMIT = "output_limit"
    PROCESS_FAILED = "process_failed"
    INVALID_OUTPUT = "invalid_output"
    CLEANUP_UNCONFIRMED = "cleanup_unconfirmed"
    NODE_LOST = "node_lost"
    """A cluster backend lost the node (or its answer) during the run: the case is
    ``infra_invalid``; the container's fate is unknown until gc runs on that node.
    Never produced by :func:`classify_stop` (the local engine has no nodes)."""


GATEWAY_SOCKET = "gateway.sock"
"""The socket's name in a gateway mount (:data:`runner.gateway.server.SOCKET_NAME`)."""


class Mount(Frozen):
    """A host directory or file bound into the container."""

    source: Path
    """Absolute host path; it must exist (bind mounts never create host paths)."""
    target: str
    """Absolute path inside the container."""
    read_only: bool = True
    """Inputs are always read-only; only a stage's fresh output directory is writable."""
    gateway: bool = False
    """Set only by the controller for its own gateway socket directory, the one place
    a unix socket may be mounted."""


class Resources(Frozen):
    """Kernel-enforced limits for one container."""

    memory_bytes: int = Field(gt=0)
    """Memory limit; swap is disabled by setting memory+swap to the same value."""
    cpus: float = Field(gt=0)
    """CPU quota in cores (CFS quota)."""
    pids: int = Field(gt=0)
    """Maximum number of processes and threads (a fork loop hits this)."""
    nofile: int = Field(default=1024, gt=0)
    """Open-file limit (soft = hard)."""
    file_size_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    """Largest single file a process may write (RLIMIT_FSIZE)."""


class RunSpec(Frozen):
    """Everything needed to run one role container; hashed into plans as is."""

    run_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """The cycle run this container belongs to; goes into labels and the name."""
    role: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")
    """Role name (analyst, worker, evaluator, apply, trainer)."""
    image: str
    """Immutable local image id (``sha256:...``) or a local tag; never pulled."""
    command: tuple[str, ...]
    """argv inside the container; no shell is implied."""
    user: str = Field(pattern=r"^[1-9][0-9]*:[1-9][0-9]*$")
    """Non-root ``uid:gid``; root (0) is refused by the pattern."""
    mounts: tuple[Mount, ...] = ()
    """Read-only inputs, plus at most the writable output directory."""
    output_dir: Path | None = None
    """Host directory where the output appears after the run. The container never sees
    it: ``output_target`` is a capped tmpfs inside the container, seeded from this
    directory's content (if any) and copied back out by the host's safe extractor."""
    output_target: str = "/out"
    """Where the output directory appears inside the container."""
    tmpfs: tuple[tuple[str, int], ...] = (("/tmp", 64 * 1024 * 1024),)  # noqa: S108
    """Size-capped scratch mounts (path, bytes); everything else is read-only."""
    resources: Resources
    """Memory, CPU, pids and file limits."""
    timeout_s: float = Field(gt=0)
    """Wall-clock limit; the container is killed and removed when it passes."""
    stdout_cap_bytes: int = Field(default=1024 * 1024, gt=0)
    """stdout+stderr bytes allowed before the container is killed (``output_limit``)."""
    output_cap_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    """Size of the output tmpfs: a writer past it gets ENOSPC from the kernel, the run
    ends ``output_limit``, and the host never holds more than this many file bytes."""
    output_max_entries: int = Field(default=10_000, gt=0)
    """Files plus directories the output tmpfs can hold (its ``nr_inodes``)."""
    env: tuple[tuple[str, str], ...] = ()
    """Non-secret environment; nothing from the host environment is passed through."""
    workdir: str = "/"
    """Working directory inside the container."""
    runtime: str | None = None
    """OCI runtime (``runsc`` for gVisor); the engine default when unset."""
    seccomp: str | None = None
    """Seccomp profile JSON handed to the engine; unset: the shipped
    ``policies/seccomp.json`` (never the engine's default, which allows io_uring)."""
    labels: tuple[tuple[str, str], ...] = ()
    """Extra labels (case, trial, stage); run id, role and owner are always added."""
    warm: tuple[str, ...] = ()
    """A warm start (prepared runs only): modules the command's interpreter imports while
    the container waits for its case; ``command`` must then be ``python SCRIPT ...`` or
    ``python -m MODULE ...`` (:func:`warm_refusal`, checked where it is set: the cycle
    file and :func:`runner.isolation.launcher.prepare`)."""

    @property
    def uid(self) -> int:
        """The numeric user id of :attr:`user`."""
        return int(self.user.partition(":")[0])

    @property
    def gid(self) -> int:
        """The numeric group id of :attr:`user`."""
        return int(self.user.partition(":")[2])


class RunRecord(Frozen):
    """What one container run produced; goes into receipts as is."""

    run_id: str
    role: str
    image_id: str
    """The image id the engine actually ran."""
    container_name: str
    exit_code: int | None
    """Process exit code; None when the engine never reported one."""
    stop_reason: StopReason
    detail: str = ""
    """One line saying why, when the stop reason is not ``ok``."""
    wall_s: float
    stdout_bytes: int
    """Total bytes the container wrote to stdout (including what was dropped)."""
    stderr_bytes: int
    stdout_tail: str
    """Last bytes of stdout (capped), decoded with replacement."""
    stderr_tail: str
    cleanup_confirmed: bool
    """The engine no longer knows the container after removal."""
    labels: dict[str, str] = Field(default_factory=dict)
    egress_refused: tuple[str, ...] = Field(default=(), exclude_if=lambda v: not v)
    """Hosts the role asked the in-container deny-all proxy for (telemetry, update
    checks, fetches), each refused with a 403: at most 16, escaped, as the holder saw
    them; empty when nothing asked or the role had no gateway binding."""
    egress_refused_count: int = Field(default=0, exclude_if=lambda v: v == 0)
    """Requests the proxy refused (every attempt, also beyond the named hosts)."""


class RunFlags(Frozen):
    """Observations the backend gathered, input to :func:`classify_stop`."""

    exit_code: int | None
    oom_killed: bool = False
    timed_out: bool = False
    stream_exceeded: bool = False
    output_dir_exceeded: bool = False
    output_detail: str = ""
    """Why the output directory hit its cap, or why its copy-out was refused."""
    output_invalid: bool = False
    """The copy-out refused an entry (link, device, bad name) or failed."""
    cleanup_confirmed: bool = True


def classify_stop(flags: RunFlags) -> tuple[StopReason, str]:
    """Decide the stop reason from what was observed; pure, tested on captured cases.

    Leftover containers outrank everything (the run cannot be trusted while one may
    still be running); then what *we* did to the container (timeout, output kill),
    since our kill shows up as exit 137 just like an OOM kill; then the kernel's OOM
    flag; then the process's own exit code.
    """
    if not flags.cleanup_confirmed:
        return StopReason.CLEANUP_UNCONFIRMED, "container still known to the engine after removal"
    if flags.timed_out:
        return StopReason.TIMEOUT, "wall-clock limit reached; container killed"
    if flags.stream_exceeded:
        return StopReason.OUTPUT_LIMIT, "stdout/stderr exceeded the cap; container killed"
    if flags.output_dir_exceeded:
        return StopReason.OUTPUT_LIMIT, ("output directory exceeded the cap: "
                                         + (flags.output_detail or "container killed"))
    if flags.oom_killed:
        return StopReason.OOM, "killed by the kernel OOM killer at the memory limit"
    if flags.exit_code is None:
        return StopReason.PROCESS_FAILED, "engine reported no exit code"
    if flags.exit_code == 137:
        # SIGKILL from inside the container's limits (e.g. OOM on a kernel that
        # does not set the flag) is still a failure, but say what we saw.
        return StopReason.PROCESS_FAILED, "exit 137 (SIGKILL) without an OOM flag"
    if flags.exit_code != 0:
        return StopReason.PROCESS_FAILED, f"exit code {flags.exit_code}"
    if flags.output_invalid:
        return StopReason.INVALID_OUTPUT, f"output refused: {flags.output_detail}"
    return StopReason.OK, ""


@dataclass(frozen=True)
class SweepResult:
    """One labelled container (or owned directory) that a sweep looked at."""

    name: str
    run_id: str
    role: str
    removed: bool
    reason: str
    kind: str = "container"
    """container, socket_dir or staging."""
    would_remove: bool = False
    """What a --dry-run found removable (nothing is removed in a dry run)."""


OutputCallback = Callable[[str, bytes], None]
"""Receives ("stdout" | "stderr", chunk) as the container writes."""


class PreparedRun(Protocol):
    """One container made ready for exactly one RunSpec (created, its holder started and
    waiting, inputs staged, the gateway bound by the launcher): ``run`` at most once, then
    it is removed; ``discard`` removes it unrun. Either may be called after the other
    (the second is a no-op), from any thread."""

    @property
    def spec(self) -> RunSpec: ...

    def run(self, *, on_output: OutputCallback | None = None,
            cancel: threading.Event | None = None,
            ended: Callable[[], None] | None = None,
            handing: Callable[[], None] | None = None) -> RunRecord:
        """Run the spec once; ``ended`` (if given) is called on this thread once the
        command ended and its output is copied out, possibly before the container's
        removal is confirmed (never after ``run`` returns); ``handing`` just before the
        case is handed over (never when it is not: a stopping caller, a discard)."""
        ...

    def discard(self) -> None: ...


class DeferredRun:
    """The default for a backend that cannot prepare ahead: nothing happens until ``run``,
    which is ``sandbox.run(spec)``; ``discard`` before it means the spec never runs."""

    def __init__(self, sandbox: Sandbox, spec: RunSpec) -> None:
        self._sandbox = sandbox
        self._spec = spec
        self._lock = threading.Lock()
        self._used = False

    @property
    def spec(self) -> RunSpec:
        return self._spec

    def _claim(self) -> bool:
        """True for the first of ``run``/``discard`` only: one spec, one run."""
        with self._lock:
            first, self._used = not self._used, True
            return first

    def run(self, *, on_output: OutputCallback | None = None,
            cancel: threading.Event | None = None,
            ended: Callable[[], None] | None = None,
            handing: Callable[[], None] | None = None) -> RunRecord:
        if not self._claim():
            # Running twice (or after a discard) would reuse a container: refused loudly,
            # never a second record for the same spec.
            raise SandboxError(f"prepared {self._spec.role} run already used or discarded")
        if handing is not None:
            handing()
        rec = self._sandbox.run(self._spec, on_output=on_output, cancel=cancel)
        if ended is not None:  # the container is gone too: nothing overlaps here
            ended()
        return rec

    def discard(self) -> None:
        self._claim()


class Sandbox(Protocol):
    """Where role commands run: the one seam between the cycle and an isolation backend.

    The cycle, training, doctor and gc see only this protocol; a backend (Docker today,
    a cluster backend next) is chosen by name through :mod:`runner.isolation.registry`.
    Every method is safe to call from several threads.
    """

    name: str
    """Registry name of the backend (``docker``)."""

    def run(self, spec: RunSpec, *, on_output: OutputCallback | None = None,
            cancel: threading.Event | None = None) -> RunRecord:
        """Run to completion (or limit), remove the container, return the record."""
        ...

    def prepare(self, spec: RunSpec, *,
                cancel: threading.Event | None = None) -> PreparedRun:
        """Create and start the container for ``spec`` up to the point where only the role
        command is left to start; raise as ``run`` would (the caller records it).
        ``cancel`` set before or while it prepares (the run is stopping): whatever was
        created is removed and SandboxError raised, without waiting for the holder."""
        ...

    def image_id(self, ref: str) -> str | None:
        """The immutable id of a local image (tag or id), None when it is absent."""
        ...

    def leftovers(self, run_id: str) -> list[str]:
        """Remove whatever this process still holds for ``run_id``; return the names
        removed (an empty list when the run left nothing behind)."""
        ...

    def sweep(self, *, only_orphans: bool = True, dry_run: bool = False) -> list[SweepResult]:
        """Remove cyclebox containers whose owner is gone (or all with
        ``only_orphans=False``), then what the backend itself left for gone owners (Docker:
        input staging copies); with ``dry_run`` only report them."""
        ...
