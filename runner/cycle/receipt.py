"""Receipts (SPEC §10): one canonical JSON file binding every input, output and run record.

``files`` maps every file of the run directory (except the receipt itself) to its
sha256, and ``external`` the data stores outside it; ``verify`` re-hashes all of them.
``outcome`` holds digests that do not depend on time (inputs, proposal, patch,
verdict, grades, call request/response hashes), so that a replayed run can be shown
to reproduce them; timings live apart in ``timing``.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import stat
import zlib
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue
from pydantic_core import to_jsonable_python

from runner import fswalk, interrupts
from runner.cycle.dream import DreamSummary
from runner.cycle.models import (
    CUT_SHORT,
    ENVELOPE,
    NO_RECEIPT_VERDICT,
    RECORDS_MAX_BYTES,
    ComparisonResult,
)
from runner.cycle.plan import read_plan_doc
from runner.errors import ConfigError, EnvironmentFailure, IntegrityError, OutputRejected
from runner.failures import is_environment_error
from runner.gateway.calllog import CallLog
from runner.gateway.report import UsageReport, summarize
from runner.hashing import MAX_WRITE_DEPTH, canonical_bytes, sha256_json
from runner.isolation.collect import loads_strict
from runner.isolation.sandbox import Frozen, StopReason
from runner.loading import MAX_BYTES, load_lines, load_model, parse_model, read_capped, show

SCHEMA = 1
RECEIPT = "receipt.json"
CALL_LOG = "gateway/calls.jsonl"
PROPOSAL_FILE = "stages/propose/out/proposal.json"
PATCH_FILE = "stages/apply/candidate.patch"
CANDIDATE_GIT = "stages/apply/candidate.git"
APPLY_RESULT = "stages/apply/result.json"
_UNBOUND_FILES = frozenset({RECEIPT, ENVELOPE})
WORK_GIT = "stages/apply/work/repo/.git/"
"""The apply container's repository, which copy-out no longer writes
(runner.isolation.copyout.SCRATCH); still there in runs made before, and the host's own
seed of it when the container never ran. No recipe reads it."""
BUNDLE_SUFFIX = ".intoto.jsonl"
"""Attestation bundles (runner.attest) written beside the receipt after it: a top-level
file with this suffix is made from the receipt, so the receipt cannot bind it."""


_WRITE_ONCE_TMP = re.compile(r"\.(?:receipt\.dsse\.json|[^/]*\.intoto\.jsonl)\.[0-9a-f]{12}\.tmp")
"""The name :func:`runner.outdir.write_once` writes beside a signature or bundle first."""


def _unbound(rel: str, *, legacy_git: bool = False) -> bool:
    """Files of a run directory the receipt does not bind, one rule for the writer's walk
    and ``verify``: the top-level receipt and its signature, matched by exact path (a
    role's ``out/receipt.json`` is bound like any other output), and top-level
    attestation bundles (``*.intoto.jsonl``; no role writes at the top level).

    The two git directories of the apply stage (the host's bare clone
    ``stages/apply/candidate.git`` and :data:`WORK_GIT`) are bound file by file (config,
    objects and refs: anything added there, a ``commondir`` or an ``fsmonitor`` command
    or an object swapped under its id, fails ``verify``), but in a receipt written before
    they were (``legacy_git``: the receipt's ``candidate_git_bound`` is absent)."""
    return (rel in _UNBOUND_FILES
            or (legacy_git and rel.startswith((CANDIDATE_GIT + "/", WORK_GIT)))
            or ("/" not in rel and rel.endswith(BUNDLE_SUFFIX)))


def _files(root: Path) -> tuple[dict[str, str], dict[str, str]]:
    """sha256 of every regular file under ``root``, as (UTF-8 named, other).

    One walk by directory descriptor (:mod:`runner.fswalk`): a path longer than
    ``PATH_MAX`` is hashed like any other, no symlink is followed, and a directory or
    file that cannot be read is an IntegrityError naming it, never left out. A path that
    is not UTF-8 (only a container writes one; collect refuses it) goes into the second
    map under its backslash-escaped form: hashed, but not a name ``verify`` could open."""
    out: dict[str, str] = {}
    escaped: dict[str, str] = {}
    try:
        for e in fswalk.walk(root, descend=lambda e: not _unbound(e.rel + "/"),
                             max_depth=_MAX_DEPTH, max_entries=_MAX_ENTRIES):
            if not e.is_file:
                continue
            raw = os.fsencode(e.rel)
            rel = raw.decode("utf-8", "backslashreplace")
            if _unbound(rel):
                continue  # the receipt itself; git internals bound through commit/tree ids
            try:
                raw.decode("utf-8")
                target = out
            except UnicodeDecodeError:
                target = escaped
            target[rel] = e.sha256()
    except fswalk.WalkError as exc:
        raise IntegrityError(f"{root}: cannot bind the run directory into a receipt: {exc}. "
                             "Fix: make every file under it readable by this user") from None
    return dict(sorted(out.items())), dict(sorted(escaped.items()))


def _records_digest(path: Path) -> str | None:
    """sha256_json of the records' outcome fields, a line at a time (the same bytes as the
    list's canonical JSON): memory is one line's, not the file's (a records file of
    ``[[],[],...]`` lines once took 27 GB to verify), and a line of more than
    :data:`RECORD_MAX_CONTAINERS` objects and arrays is refused unparsed."""
    if not path.is_file():
        return None
    h = hashlib.sha256(b"[")
    first = True
    # "\n" only: a record's strings may hold U+2028, U+2029 or U+0085 raw, which
    # str.splitlines() would also split on (JSON Lines ends a line at "\n" alone)
    data = read_capped(path, max_bytes=RECORDS_MAX_BYTES, what="records file")
    for n, line in enumerate(data.split(b"\n"), start=1):
        if not line:
            continue
        r = loads_strict(line, source=f"{path.name}:{n}", max_containers=RECORD_MAX_CONTAINERS,
                         max_depth=RECORD_MAX_DEPTH)
        if not isinstance(r, dict):
            raise OutputRejected(f"{path.name}:{n}: not a JSON object")
        h.update(b"" if first else b",")
        h.update(canonical_bytes({k: r.get(k) for k in (
            "case_id", "trial", "status", "reason", "answer", "grades", "identities")}))
        first = False
    h.update(b"]")
    return h.hexdigest()


RECORD_MAX_DEPTH = 4 * MAX_WRITE_DEPTH
"""Deepest record line read back: the writer cuts values at :data:`MAX_WRITE_DEPTH`
below the record (an answer may nest as deep as its reader allowed, 64 levels, and sits
one level down), so no record the host wrote comes near it."""
RECORD_MAX_CONTAINERS = 1_000_000
"""Most JSON objects and arrays one record line may hold (a record holds about 8; its
answer, the largest part, is at most 256 KiB of JSON when written)."""


# -- the document -----------------------------------------------------------------------------
# Field order follows the order the writer has always used; the file itself is canonical
# JSON (sorted keys), so a field's presence, name and value are what must never drift.

class ReceiptIdentities(Frozen):
    """What the results were graded against (copied from the plan)."""

    reference_hash: str
    data_hash: str
    scorer: str
    judge_id: str | None
    manifest_sha256: str

if TYPE_CHECKING:
    from runner.cycle.run import Outcome


class ReceiptUpstream(Frozen):
    """One upstream as the receipt shows it: never a credential value."""

    provider: str
    credential: str | None
    """The credential's env var name or file path (openai); None otherwise."""
    fixture: bool
    """Answered by the scripted provider (never a real model)."""
    id: str | None
    """The plan's upstream id (definition plus script or replay log bytes)."""


class ContainerRow(Frozen):
    """One line of ``containers.jsonl``: a run record without its output tails, plus where
    in the cycle it ran."""

    stage: str
    case: str | None
    trial: int | None
    run_id: str
    role: str
    image_id: str
    container_name: str
    exit_code: int | None
    stop_reason: StopReason
    detail: str
    wall_s: float
    stdout_bytes: int
    stderr_bytes: int
    cleanup_confirmed: bool
    labels: dict[str, str]
    egress_refused: tuple[str, ...] = Field(default=(), exclude_if=lambda v: not v)
    """Hosts the role asked the container's deny-all proxy for, each refused (a run
    record's ``egress_refused``; absent in runs recorded before it existed)."""
    egress_refused_count: int = Field(default=0, exclude_if=lambda v: v == 0)


class ReceiptOutcome(Frozen):
    """Digests that do not depend on time: a replay must reproduce every one."""

    inputs: str
    """sha256 over the plan's section hashes."""
    proposal_sha256: str | None
    patch_sha256: str | None
    candidate_tree: str | None
    """Tree id of the candidate commit; ``verify`` recomputes it from the bare clone."""
    verdict: str
    verdict_sha256: str
    """sha256 of the verdict without its usage totals."""
    baseline_records_sha256: str | None
    candidate_records_sha256: str | None
    calls_sha256: str
    """sha256 over every call's (role, stage, case, trial, turn, status, request and
    response hashes), in a time-independent order. A replayed call counts with the
    request of the recording that answered it (``replay_of``)."""


class ExternalFile(Frozen):
    """A file outside the run directory the run read (a data store)."""

    path: str
    sha256: str


class Receipt(Frozen):
    """``receipt.json`` (SPEC §10), as :func:`build` writes it."""

    schema_: int = Field(alias="schema")
    generated_at: str
    """UTC time the receipt was written (ISO 8601, seconds)."""
    plan_hash: str
    inputs: dict[str, str]
    """The plan's section -> sha256."""
    identities: ReceiptIdentities
    base_tree: str
    images: dict[str, str]
    """role -> image id the plan froze."""
    upstreams: dict[str, ReceiptUpstream]
    containers: tuple[ContainerRow, ...]
    usage: UsageReport
    fixture: bool
    """Some call was answered by the scripted provider."""
    proposal_sha256: str | None
    patch_sha256: str | None
    verdict: ComparisonResult
    leftovers: tuple[str, ...]
    """Containers or directories removed after the run (empty when it left nothing)."""
    dream: DreamSummary | None
    timing: dict[str, float]
    """Seconds per stage; kept out of ``outcome``."""
    outcome: ReceiptOutcome
    external: dict[str, ExternalFile]
    files: dict[str, str]
    """Every regular file of the run directory (UTF-8 name) -> sha256, but the unbound."""
    files_not_utf8: dict[str, str]
    """Files whose names are not UTF-8, under their backslash-escaped names."""
    candidate_git_bound: bool = False
    """``files`` names the files of the apply stage's git directories too (every receipt
    written now; absent in older ones, which bound the bare clone by its commit and tree
    and left the container's repository out)."""


CONTAINERS_FIX = "containers.jsonl as the cycle runner writes it (one run record a line)"


def _derived(d: Path, bound: dict[str, str] | None = None) -> dict[str, Any]:
    """The receipt's fields that follow from the run directory's own (bound) files: the
    plan, the call log, the records, the container rows and the dream summary. One
    function for :func:`build` and :func:`verify`, so a field edited in receipt.json
    after the run no longer matches what its files give.

    ``bound`` (verify): the receipt's ``files``, each already re-hashed as a regular file
    reached without a link; a file not among them is read as absent, never followed."""
    def has(rel: str) -> bool:
        return (d / rel).exists() if bound is None else rel in bound

    doc = read_plan_doc(d / "plan.json")
    plan = doc.plan
    calls = CallLog.reader(d / "gateway").records() if has(CALL_LOG) else []
    stages = d / "stages"
    containers = (load_lines(d / "containers.jsonl", ContainerRow, what="container records",
                             fix=CONTAINERS_FIX)
                  if has("containers.jsonl") else [])
    summary = stages / "dream" / "summary.json"
    records = {side: _records_digest(stages / side / "records.jsonl")
               if has(f"stages/{side}/records.jsonl") else None
               for side in ("baseline", "candidate")}
    return {
        "inputs": doc.hashes,
        "identities": ReceiptIdentities(reference_hash=plan.reference_hash,
                                        data_hash=plan.data_hash, scorer=plan.scorer,
                                        judge_id=plan.judge_id,
                                        manifest_sha256=plan.manifest_sha256),
        "base_tree": plan.project.base_tree,
        "images": plan.images,
        "upstreams": {n: ReceiptUpstream(provider=u.provider,
                                         credential=(u.credential.env or u.credential.file)
                                         if u.credential else None,
                                         fixture=u.provider == "scripted",
                                         id=plan.upstream_ids.get(n))
                      for n, u in plan.upstreams.items()},
        "containers": tuple(containers),
        "usage": summarize(calls),
        "fixture": any(c.fixture for c in calls),
        "dream": load_model(summary, DreamSummary, fmt="json", what="dream summary",
                            fix="the summary.json the dream stage wrote")
        if has("stages/dream/summary.json") else None,
        "external": {f"store:{sid}": ExternalFile(path=str(Path(plan.data_dir) / s.path),
                                                  sha256=s.sha256)
                     for sid, s in plan.stores.items()},
        "outcome": {
            "inputs": sha256_json(doc.hashes),
            "baseline_records_sha256": records["baseline"],
            "candidate_records_sha256": records["candidate"],
            "calls_sha256": sha256_json([
                [c.role, c.stage, c.case, c.trial, c.turn, c.status,
                 c.replay_of or c.request_sha256, c.response_sha256]
                for c in sorted(calls, key=lambda c: (c.stage, c.case or "", c.trial or 0,
                                                      c.turn, c.role))]),
        },
    }


def build(outcome: Outcome) -> Receipt:
    """Assemble and write ``receipt.json``; returns it."""
    d = outcome.run_dir
    got = _derived(d)
    files, files_not_utf8 = _files(d)
    # the hashes of the files as bound (verify recomputes them so): a proposal the host
    # refused on its shape, or a stage that drifted after it, still has its file hashed
    proposal_sha, patch_sha = files.get(PROPOSAL_FILE), files.get(PATCH_FILE)
    verdict = outcome.result.model_dump(mode="json")
    verdict_core = {k: v for k, v in verdict.items() if k != "usage"}
    outcome_digests = ReceiptOutcome(
        **got.pop("outcome"),
        proposal_sha256=proposal_sha,
        patch_sha256=patch_sha,
        candidate_tree=outcome.candidate_tree or _applied_tree(d),
        verdict=outcome.result.verdict,
        verdict_sha256=sha256_json(verdict_core),
    )
    receipt = Receipt(
        schema=SCHEMA,
        generated_at=datetime.now(UTC).isoformat(timespec="seconds"),
        plan_hash=outcome.plan_hash,
        **got,
        proposal_sha256=proposal_sha,
        patch_sha256=patch_sha,
        verdict=outcome.result,
        leftovers=tuple(outcome.leftovers),
        timing=outcome.timings,
        outcome=outcome_digests,
        files=files,
        files_not_utf8=files_not_utf8,
        candidate_git_bound=True,
    )
    data = canonical_bytes(receipt)
    _write_atomic(d / RECEIPT, data)  # kept as evidence whatever its size
    if len(data) > MAX_BYTES:
        raise IntegrityError(
            f"{d / RECEIPT}: the receipt is {len(data)} bytes, more than `receipt verify` "
            f"reads ({MAX_BYTES}): no one could verify this run. It binds every file by its "
            f"name; the most named are under {_heaviest(files, files_not_utf8)}. Fix: keep "
            "the run as evidence; an agent that writes thousands of files with long names "
            "into its output should write an archive instead")
    return receipt


def _heaviest(*maps: dict[str, str]) -> str:
    """The directories (four levels deep: a case) whose bound names cost the receipt most."""
    cost: dict[str, int] = {}
    for m in maps:
        for rel in m:
            top = "/".join(rel.split("/")[:4])
            cost[top] = cost.get(top, 0) + len(rel) + 70
    worst = sorted(cost.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{show(k)} ({v} bytes)" for k, v in worst)


def _applied_tree(d: Path) -> str | None:
    """The tree of the commit the apply stage recorded as applied, when the run stopped
    before it took it (drift found after apply): verify requires it whenever
    stages/apply/result.json says applied."""
    try:
        result = json.loads((d / APPLY_RESULT).read_text())
        if result.get("status") != "applied":
            return None
        fd = os.open(d, _DIR_FLAGS)
        try:
            return _commit_tree_in(fd, str(result["commit"]))
        finally:
            os.close(fd)
    except (OSError, ValueError, KeyError, AttributeError, _Unreadable, IntegrityError):
        return None


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file and rename, so a full disk leaves no partial receipt."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


class _OutcomeHead(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")

    candidate_tree: str | None = None


class ReceiptHead(BaseModel):
    """The parts of receipt.json that ``verify`` reads; the rest is carried along, so a
    partial or older receipt is still checked file by file."""

    model_config = ConfigDict(frozen=True, extra="allow")

    schema_: int = Field(alias="schema")
    plan_hash: str
    files: dict[str, str]
    files_not_utf8: dict[str, str] = Field(default_factory=dict)
    candidate_git_bound: bool = False
    external: dict[str, ExternalFile] = Field(default_factory=dict)
    outcome: _OutcomeHead = _OutcomeHead()


RECEIPT_FIX = "pass a cycle run directory holding the receipt.json a run wrote"


def read_receipt_bytes(run_dir: Path, cap: int = MAX_BYTES) -> bytes:
    """receipt.json's exact bytes, opened relative to the run directory without following
    a link; IntegrityError naming why it cannot be read so."""
    try:
        root_fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise IntegrityError(f"{show(str(run_dir))}: cannot open the run directory "
                             f"({exc.strerror})") from None
    try:
        return _read_in(root_fd, RECEIPT, cap)
    except _Unreadable as exc:
        raise IntegrityError(f"{show(str(run_dir / RECEIPT))}: {exc}") from None
    finally:
        os.close(root_fd)


def load_receipt(run_dir: Path) -> Receipt:
    """receipt.json of a run directory, typed and bounded (runner.loading); ConfigError
    (bad input) when it is missing or is not a whole receipt (a JSON list, ``{}``, ...)."""
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a directory", field="DIR", fix=RECEIPT_FIX)
    return load_model(run_dir / RECEIPT, Receipt, fmt="json", what="receipt", schema=SCHEMA,
                      fix=RECEIPT_FIX)


class ReceiptRow(Frozen):
    """One hash ``receipt compare`` puts side by side."""

    key: str
    """``identities``, ``inputs.<section>``, ``outcome.<digest>``, ..."""
    recorded: JsonValue
    replayed: JsonValue
    equal: bool


def compare_receipts(recorded: Receipt, replayed: Receipt) -> tuple[ReceiptRow, ...]:
    """Input and outcome hashes of two runs side by side (timings aside). Every frozen
    input section is compared except how model calls are answered (a replay answers from
    the recording instead of the original provider) and how many cases ran at once (no
    outcome depends on it: a run at ``concurrency: auto`` compares equal to one at 2)."""
    a, b = recorded.model_dump(mode="json"), replayed.model_dump(mode="json")
    keys = ["identities", "base_tree", "images"]
    skip = {"upstreams", "upstream_ids", "inputs", "concurrency"}
    keys += [f"inputs.{k}" for k in sorted(a["inputs"]) if k not in skip]
    keys += [f"outcome.{k}" for k in a["outcome"] if k != "inputs"]

    def value(doc: dict[str, Any], key: str) -> JsonValue:
        head, _, rest = key.partition(".")
        got: JsonValue = doc[head].get(rest) if rest else doc[head]
        return got

    return tuple(ReceiptRow(key=k, recorded=value(a, k), replayed=value(b, k),
                            equal=value(a, k) == value(b, k)) for k in keys)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_MAX_ENTRIES = 1_000_000
_MAX_DEPTH = 64


class _Unreadable(Exception):
    """A named file cannot be opened safely; the message says why."""


def _name_problem(rel: str) -> str | None:
    """Why ``rel`` is not a plain relative name inside the run directory, or None."""
    if not rel:
        return "empty name refused"
    if "\0" in rel:
        return "NUL in name refused"
    if rel.startswith("/"):
        return "absolute name refused; names are relative to the run directory"
    parts = rel.split("/")
    if ".." in parts:
        return "'..' component refused; names must stay inside the run directory"
    if any(p in ("", ".") for p in parts):
        return "empty or '.' component refused; names are normalised relative paths"
    return None


def _open_in(root_fd: int, rel: str) -> int:
    """Open ``rel`` under the directory fd ``root_fd``, one component at a time, following
    no symlink (``O_NOFOLLOW`` per component); only a regular file is returned."""
    parts = rel.split("/")
    dfd = os.dup(root_fd)
    try:
        for i, part in enumerate(parts):
            where = "/".join(parts[:i + 1])
            try:
                st = os.lstat(part, dir_fd=dfd)
            except FileNotFoundError:
                raise _Unreadable("missing") from None
            except OSError as exc:
                raise _Unreadable(f"cannot stat {where}: {exc.strerror}") from None
            last = i == len(parts) - 1
            if stat.S_ISLNK(st.st_mode):
                raise _Unreadable("symlink refused (never followed)" if last else
                                  f"symlinked directory component {where!r} refused")
            if not last:
                if not stat.S_ISDIR(st.st_mode):
                    raise _Unreadable(f"component {where!r} is not a directory")
                try:
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=dfd)
                except OSError as exc:
                    raise _Unreadable(f"cannot open {where!r}: {exc.strerror}") from None
                os.close(dfd)
                dfd = nfd
                continue
            if not stat.S_ISREG(st.st_mode):
                raise _Unreadable("not a regular file (refused without reading)")
            try:
                fd = os.open(part, _FILE_FLAGS, dir_fd=dfd)
            except OSError as exc:
                raise _Unreadable(f"cannot open: {exc.strerror}") from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise _Unreadable("changed type while opening; refused")
            return fd
        raise _Unreadable("empty name")
    finally:
        os.close(dfd)


def _read_in(root_fd: int, rel: str, cap: int = MAX_BYTES) -> bytes:
    fd = _open_in(root_fd, rel)
    with os.fdopen(fd, "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise _Unreadable(f"larger than {cap} bytes; refused")
    return data


def _sha256_in(root_fd: int, rel: str) -> str:
    fd = _open_in(root_fd, rel)
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def sha256_in_run(run_dir: Path, rel: str) -> str | None:
    """sha256 of the regular file ``rel`` of a run directory, as ``verify`` hashes it (no
    link followed in any component); None when it cannot be read so."""
    try:
        root_fd = os.open(run_dir, _DIR_FLAGS)
    except OSError:
        return None
    try:
        return _sha256_in(root_fd, rel)
    except (_Unreadable, OSError):
        return None
    finally:
        os.close(root_fd)


def _present(root_fd: int, *, legacy_git: bool = False) -> tuple[set[str], list[str]]:
    """Regular files under the run directory (by dir fd, no link followed), minus the
    unbound ones, and the problems met walking it. Symlinks and special files are
    skipped, as the writer skips them (a receipt naming one fails on its own entry; a
    project's own symlinks are exported as symlinks), but in the apply stage's git
    directories, which hold none: git follows a link there (a ``commondir`` or ``config``
    pointing elsewhere), so each is a problem naming it. A directory that cannot be read is a
    problem naming it, never left out."""
    found: set[str] = set()
    problems: list[str] = []
    try:
        for e in fswalk.walk(root_fd, descend=lambda e: not _unbound(e.rel + "/",
                                                                     legacy_git=legacy_git),
                             max_depth=_MAX_DEPTH, max_entries=_MAX_ENTRIES):
            if _unbound(e.rel, legacy_git=legacy_git):
                continue
            if e.is_file:
                found.add(e.rel)
            elif not e.is_dir and e.rel.startswith((CANDIDATE_GIT + "/", WORK_GIT)):
                problems.append(f"{e.rel}: not a regular file or directory (a git "
                                "directory of the apply stage holds none)")
    except fswalk.WalkError as exc:
        return found, [*problems, f"{exc} (the run directory could not be checked in full)"]
    return found, problems


def verify(run_dir: Path, *, external: bool = True,
           receipt_bytes: bytes | None = None) -> list[str]:
    """Problems found re-hashing everything the receipt names; empty when all match.
    ``external=False``: the run directory only, not the data stores the receipt binds
    under the plan's ``data_dir`` (a reader of the run alone: export, compare).

    Names must be plain relative paths (no ``..``, not absolute); each is opened relative
    to the run directory with ``O_NOFOLLOW`` on every component; and the run directory's
    files must equal the receipt's list in both directions (only the receipt and its
    signature are left out, plus the git internals the writer binds by commit and tree)."""
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a directory", field="DIR", fix=RECEIPT_FIX)
    try:
        root_fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise IntegrityError(f"{run_dir}: cannot open the run directory ({exc.strerror})"
                             ) from None
    try:
        return _verify_at(root_fd, run_dir, external=external, raw=receipt_bytes)
    finally:
        os.close(root_fd)


def require_unaltered(run_dir: Path, *, what: str, receipt_bytes: bytes | None = None
                      ) -> None:
    """The run directory is what its receipt binds (:func:`verify`, the data stores
    outside it aside): for a reader that trusts what it reads there (``what`` it does).
    ``receipt_bytes``: check against these bytes of receipt.json (the ones the caller read
    and goes on to use), not a second read. IntegrityError ``run_altered`` naming the
    first problems otherwise."""
    problems = verify(run_dir, external=False, receipt_bytes=receipt_bytes)
    if problems:
        shown = "; ".join(show(p, 300) for p in problems[:3])
        raise IntegrityError(f"run_altered: {run_dir} no longer matches its receipt "
                             f"({len(problems)} problem(s): {shown}); `cyclebox receipt "
                             f"verify` lists them all; {what}")


def _verify_at(root_fd: int, run_dir: Path, *, external: bool,
               raw: bytes | None = None) -> list[str]:
    path = run_dir / RECEIPT
    try:
        raw = _read_in(root_fd, RECEIPT) if raw is None else raw
    except _Unreadable as exc:
        if str(exc) == "missing":
            raise ConfigError(f"{path}: does not exist", fix=RECEIPT_FIX) from None
        raise IntegrityError(f"{path}: unreadable ({exc})") from None
    # a JSON list, ``{}`` or a wrong field is bad input (ConfigError naming the field),
    # not a verification failure
    receipt = parse_model(raw, ReceiptHead, path=show(str(path)), schema=SCHEMA,
                          fix=RECEIPT_FIX)
    files = receipt.files
    legacy = not receipt.candidate_git_bound
    problems = []
    for rel, digest in sorted(files.items()):
        why = _name_problem(rel)
        if why is None and _unbound(rel, legacy_git=legacy):
            why = "names a file the receipt never binds (the receipt, its signature, git data)"
        if why is not None:
            problems.append(f"{rel}: {why}")
            continue
        try:
            if _sha256_in(root_fd, rel) != digest:
                problems.append(f"{rel}: sha256 differs from the receipt")
        except _Unreadable as exc:
            problems.append(f"{rel}: {exc}")
    not_utf8 = receipt.files_not_utf8
    present, walk_problems = _present(root_fd, legacy_git=legacy)
    problems += walk_problems
    for name in sorted(present - set(files)):
        rel = name
        try:
            rel.encode("utf-8")
        except UnicodeEncodeError:  # a name that is not UTF-8: bound under its escaped form
            shown = os.fsencode(rel).decode("utf-8", "backslashreplace")
            if shown in not_utf8:
                try:
                    if _sha256_in(root_fd, name) != not_utf8[shown]:
                        problems.append(f"{shown}: sha256 differs from the receipt")
                except _Unreadable as exc:
                    problems.append(f"{shown}: {exc}")
                continue
            rel = shown
        problems.append(f"{rel}: present in the run directory but not named by the receipt"
                        + (" (a temporary file a killed `receipt sign` or `receipt attest` "
                           "left: delete it and run that command again)"
                           if _WRITE_ONCE_TMP.fullmatch(rel) else ""))
    shown_present = {os.fsencode(n).decode("utf-8", "backslashreplace")
                     for n in present if not _is_utf8(n)}
    # (a UTF-8 name spelt with a backslash, "x" "\\" "xff", is not the file named x\xff:
    # it cannot stand in for one that was deleted)
    problems += [f"{shown}: missing" for shown in sorted(set(not_utf8) - shown_present)]
    problems += _candidate_problems(root_fd, receipt.outcome.candidate_tree)
    plan: Any = None
    try:
        plan = loads_strict(_read_in(root_fd, "plan.json"), source="plan.json")
        ok = (plan.get("plan_hash") == receipt.plan_hash
              and sha256_json(plan.get("plan")) == receipt.plan_hash)
    except (_Unreadable, OutputRejected, AttributeError):
        ok = False
    if not ok:
        problems.append("plan.json: plan_hash differs from the receipt")
    data_dir = plan.get("plan", {}).get("data_dir") if isinstance(plan, dict) and isinstance(
        plan.get("plan"), dict) else None
    for name, ext in sorted(receipt.external.items()) if external else ():
        why = _external_problem(data_dir, ext)
        if why is not None:
            problems.append(f"{name} ({ext.path}): {why}")
    problems += _envelope_problems(root_fd, raw)
    if not problems:  # the files are the ones bound: what they give must be what it says
        problems += _derived_problems(root_fd, run_dir, raw, files)
    return problems


def _envelope_problems(root_fd: int, raw: bytes) -> list[str]:
    """A signature envelope beside the receipt must carry these exact bytes: a receipt
    edited after it was signed fails here even without the public key (``--pubkey``
    then checks who signed)."""
    try:
        env = loads_strict(_read_in(root_fd, ENVELOPE), source=ENVELOPE)
    except _Unreadable as exc:
        return [] if str(exc) == "missing" else [f"{ENVELOPE}: {exc}"]
    except OutputRejected as exc:
        return [f"{ENVELOPE}: not a signature envelope ({exc})"]
    payload = env.get("payload") if isinstance(env, dict) else None
    try:
        signed = base64.b64decode(payload, validate=True) if isinstance(payload, str) else None
    except ValueError:
        signed = None
    if signed != raw:
        return [f"{ENVELOPE}: its payload is not this receipt.json (the receipt was changed "
                "after it was signed)"]
    return []


_DERIVED = frozenset({"inputs", "identities", "base_tree", "images", "upstreams", "containers",
                      "usage", "fixture", "dream", "external", "outcome", "verdict",
                      "proposal_sha256", "patch_sha256"})


def _derived_problems(root_fd: int, run_dir: Path, raw: bytes,
                      files: dict[str, str]) -> list[str]:
    """Every receipt field that follows from bound files, recomputed from them: the
    verdict and its digest from stages/compare/verdict.json, usage, fixture and the calls
    digest from the call log, the records digests, the plan's inputs, identities, images
    and upstreams, the container rows, the dream summary, and the proposal and patch
    hashes from their files. A field absent from the receipt (an older one) is skipped."""
    doc = loads_strict(raw, source=RECEIPT)
    if not isinstance(doc, dict) or not set(doc) & (_DERIVED - {"external", "outcome"}):
        # a receipt of files alone (external and the candidate tree are checked on their
        # own); attest and compare read only a whole receipt
        return []
    try:
        got = _derived(run_dir, files)
        verdict = loads_strict(_read_in(root_fd, "stages/compare/verdict.json"),
                               source="stages/compare/verdict.json")
        result = (loads_strict(_read_in(root_fd, APPLY_RESULT), source=APPLY_RESULT)
                  if APPLY_RESULT in files else None)
    except Exception as exc:  # whatever the files hold: a named problem, never a crash
        return [f"the files the receipt binds could not be read back "
                f"({type(exc).__name__}: {str(exc)[:300]})"]
    outcome = got.pop("outcome")
    want: dict[str, Any] = {k: json.loads(canonical_bytes(to_jsonable_python(v, by_alias=True)))
                            for k, v in got.items()}
    want["verdict"] = verdict
    want["proposal_sha256"] = files.get(PROPOSAL_FILE)
    want["patch_sha256"] = files.get(PATCH_FILE)
    core = ({k: v for k, v in verdict.items() if k != "usage"}
            if isinstance(verdict, dict) else verdict)
    outcome |= {"verdict": verdict.get("verdict") if isinstance(verdict, dict) else None,
                "verdict_sha256": sha256_json(core),
                "proposal_sha256": want["proposal_sha256"],
                "patch_sha256": want["patch_sha256"]}
    said_any = doc.get("outcome")
    said: dict[str, Any] = said_any if isinstance(said_any, dict) else {}
    # a receipt written before build took these two from the files left them null when
    # the stage's file existed but was refused or drifted: null is not a claim
    older = {k for k in ("proposal_sha256", "patch_sha256")
             if doc.get(k) is None and said.get(k) is None}
    problems = [f"{k}: differs from what the run's files give" for k, v in want.items()
                if k in doc and k not in older and doc[k] != v]
    problems += [f"outcome.{k}: differs from what the run's files give"
                 for k, v in outcome.items() if k in said and k not in older and said[k] != v]
    applied = isinstance(result, dict) and result.get("status") == "applied"
    if "candidate_tree" in said and applied != (said["candidate_tree"] is not None):
        problems.append("outcome.candidate_tree: "
                        + ("null, but stages/apply/result.json says applied" if applied
                           else "set, but stages/apply/result.json says nothing was applied"))
    return problems


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_MAX_EXTERNAL_BYTES = 1 << 32
"""Largest data store ``verify`` hashes; a receipt naming a larger file fails on it."""


def _external_problem(data_dir: object, ext: ExternalFile) -> str | None:
    """Why an ``external`` entry does not match, or None. Only a file under the plan's
    ``data_dir`` is read (a hostile receipt cannot make verify hash arbitrary host files),
    opened with ``O_NOFOLLOW`` on every component below it, regular and size-capped."""
    if not isinstance(data_dir, str) or not data_dir.startswith("/"):
        return "plan.json names no absolute data_dir; external files are not read"
    root = data_dir.rstrip("/") or "/"
    path = ext.path
    prefix = root if root.endswith("/") else root + "/"
    if not path.startswith(prefix):
        return f"outside the plan's data_dir {data_dir}; refused without reading"
    rel = path[len(prefix):]
    why = _name_problem(rel)
    if why is not None:
        return why
    try:
        dfd = os.open(root, _DIR_FLAGS & ~os.O_NOFOLLOW)
    except OSError as exc:
        return f"cannot open data_dir: {exc.strerror}"
    try:
        fd = _open_in(dfd, rel)
    except _Unreadable as exc:
        return str(exc)
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_size > _MAX_EXTERNAL_BYTES:
            return f"larger than {_MAX_EXTERNAL_BYTES} bytes; refused"
        h = hashlib.sha256()
        left = _MAX_EXTERNAL_BYTES + 1
        while left > 0 and (chunk := f.read(min(1 << 20, left))):
            h.update(chunk)
            left -= len(chunk)
    if left <= 0:
        return f"larger than {_MAX_EXTERNAL_BYTES} bytes; refused"
    return None if h.hexdigest() == ext.sha256 else "sha256 differs from the receipt"


_MAX_COMMIT_BYTES = 1 << 20
"""Largest commit object read (the host's candidate commit: a tree, a parent, two
identities and a message of at most 2000 characters)."""
_OBJECT_ID = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def _commit_tree_in(root_fd: int, commit: str) -> str:
    """The tree a commit of the run's ``candidate.git`` names, read without git: the
    loose object file (the host writes its candidate commit loose), opened component by
    component with no link followed, inflated to at most :data:`_MAX_COMMIT_BYTES`, and
    its bytes hashed to ``commit``. git is never run on a run directory under verify: its
    config is the directory's own, and one naming a promisor remote with an ``ext::``
    url ran a command of the directory's author to fetch a missing object. _Unreadable
    or IntegrityError naming why."""
    if not _OBJECT_ID.fullmatch(commit):
        raise IntegrityError(f"{show(commit, 80)} is not a git object id")
    rel = f"{CANDIDATE_GIT}/objects/{commit[:2]}/{commit[2:]}"
    try:
        packed = _read_in(root_fd, rel, _MAX_COMMIT_BYTES)
    except _Unreadable as exc:
        if str(exc) != "missing":
            raise
        # runs before 2026-12-05 kept the candidate clone's commit in a pack
        body = _packed_commit(root_fd, commit)
        raw = b"commit %d\0" % len(body) + body
    else:
        inflate = zlib.decompressobj()
        try:
            raw = inflate.decompress(packed, _MAX_COMMIT_BYTES + 1)
        except zlib.error as exc:
            raise IntegrityError(f"commit {commit} is not a readable loose object ({exc})"
                                 ) from None
        if len(raw) > _MAX_COMMIT_BYTES or inflate.unconsumed_tail:
            raise IntegrityError(f"commit {commit} is larger than {_MAX_COMMIT_BYTES} bytes")
    algo = hashlib.sha1 if len(commit) == 40 else hashlib.sha256
    if algo(raw).hexdigest() != commit:
        raise IntegrityError(f"commit {commit} does not hash to its id (edited object)")
    header, _, body = raw.partition(b"\0")
    if header != b"commit %d" % len(body):
        raise IntegrityError(f"object {commit} is not a commit")
    first = body.split(b"\n", 1)[0]
    if not re.fullmatch(rb"tree [0-9a-f]{40}(?:[0-9a-f]{24})?", first):
        raise IntegrityError(f"commit {commit} names no tree")
    return first[5:].decode("ascii")


_MAX_PACKS = 64
_MAX_IDX_BYTES = 64 << 20


def _packed_commit(root_fd: int, commit: str) -> bytes:
    """The body of commit ``commit`` from a pack of the candidate clone (index version 2,
    a whole, undeltified commit object), read without git and without following a link:
    its index searched, the object's header checked, inflated to at most
    :data:`_MAX_COMMIT_BYTES`. The caller hashes it to ``commit``. _Unreadable when no
    pack holds it."""
    want = bytes.fromhex(commit)
    width = len(want)
    dfd = os.dup(root_fd)
    try:
        for part in (*CANDIDATE_GIT.split("/"), "objects", "pack"):
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=dfd)
            except OSError:
                raise _Unreadable("missing") from None
            os.close(dfd)
            dfd = nfd
        names = sorted(n for n in os.listdir(dfd) if n.endswith(".idx"))[:_MAX_PACKS]
        return _first_packed(dfd, names, commit, want, width)
    except (OSError, ValueError) as exc:  # a read the pack's own numbers made fail
        raise IntegrityError(f"the pack holding {commit} cannot be read ({exc})") from None
    finally:
        os.close(dfd)


def _first_packed(dfd: int, names: list[str], commit: str, want: bytes, width: int) -> bytes:
    """:func:`_packed_commit` over the pack indexes ``names`` of the directory ``dfd``."""
    for name in names:
        idx = _read_in(dfd, name, _MAX_IDX_BYTES)
        offset = _idx_offset(idx, want, width)
        if offset is None:
            continue
        fd = _open_in(dfd, name[:-4] + ".pack")
        with os.fdopen(fd, "rb") as f:
            if not 12 <= offset < os.fstat(f.fileno()).st_size - 2:  # past the header
                raise IntegrityError(f"{show(name, 120)}: offset {offset} of {commit} "
                                     "is outside its pack")
            f.seek(offset)
            head = f.read(16)
            if not head:
                raise IntegrityError(f"{name}: offset {offset} is past the pack's end")
            kind, size, shift, used = (head[0] >> 4) & 7, head[0] & 15, 4, 1
            while head[used - 1] & 0x80:
                if used >= len(head):
                    raise IntegrityError(f"{name}: object header too long")
                size |= (head[used] & 0x7F) << shift
                shift += 7
                used += 1
            if kind != 1:
                raise IntegrityError(f"object {commit} in {name} is not a whole commit "
                                     f"(pack type {kind})")
            if size > _MAX_COMMIT_BYTES:
                raise IntegrityError(f"commit {commit} is larger than "
                                     f"{_MAX_COMMIT_BYTES} bytes")
            f.seek(offset + used)
            inflate = zlib.decompressobj()
            body = b""
            while len(body) < size + 1 and not inflate.eof:
                chunk = f.read(1 << 16)
                if not chunk:
                    break
                try:
                    body += inflate.decompress(chunk, size + 1 - len(body))
                except zlib.error as exc:
                    raise IntegrityError(f"commit {commit} in {name} does not inflate "
                                         f"({exc})") from None
            if len(body) != size:
                raise IntegrityError(f"commit {commit} in {name} is not {size} bytes")
            return body
    raise _Unreadable("missing (neither loose nor in a pack)")


def _idx_offset(idx: bytes, want: bytes, width: int) -> int | None:
    """The pack offset a version 2 pack index gives ``want``; None when it has none."""
    if idx[:8] != b"\xfftOc\x00\x00\x00\x02" or len(idx) < 8 + 256 * 4:
        raise IntegrityError("a pack index that is not version 2")
    fan = [int.from_bytes(idx[8 + 4 * i: 12 + 4 * i], "big") for i in range(256)]
    n = fan[255]
    ids, crcs = 8 + 1024, 8 + 1024 + n * width
    offs = crcs + 4 * n
    if len(idx) < offs + 4 * n:
        raise IntegrityError("a pack index shorter than its object count")
    lo, hi = (fan[want[0] - 1] if want[0] else 0), fan[want[0]]
    while lo < hi:
        mid = (lo + hi) // 2
        got = idx[ids + mid * width: ids + (mid + 1) * width]
        if got == want:
            off = int.from_bytes(idx[offs + 4 * mid: offs + 4 * mid + 4], "big")
            if off & 0x80000000:
                big = offs + 4 * n + 8 * (off & 0x7FFFFFFF)
                if len(idx) < big + 8:
                    raise IntegrityError("a pack index whose large offset is missing")
                off = int.from_bytes(idx[big: big + 8], "big")
            return off
        if got < want:
            lo = mid + 1
        else:
            hi = mid
    return None


def _candidate_problems(root_fd: int, tree: str | None) -> list[str]:
    """The candidate tree recomputed from the apply stage's bare clone (left out of
    ``files``, bound by this id instead; read without git, :func:`_commit_tree_in`): the
    commit comes from the bound stages/apply/result.json, its tree must equal the
    receipt's ``candidate_tree``."""
    if tree is None:
        return []
    where = f"{CANDIDATE_GIT} (outcome.candidate_tree)"
    try:
        result = loads_strict(_read_in(root_fd, "stages/apply/result.json"),
                              source="stages/apply/result.json")
    except (_Unreadable, OutputRejected) as exc:
        return [f"{where}: no readable stages/apply/result.json ({exc})"]
    commit = result.get("commit") if isinstance(result, dict) else None
    if not isinstance(commit, str):
        return [f"{where}: stages/apply/result.json names no commit"]
    parts = CANDIDATE_GIT.split("/")
    for i in range(len(parts)):
        try:
            st = os.lstat("/".join(parts[:i + 1]), dir_fd=root_fd)
        except OSError as exc:
            return [f"{where}: {'/'.join(parts[:i + 1])}: {exc.strerror or 'missing'}"]
        if not stat.S_ISDIR(st.st_mode):
            return [f"{where}: {'/'.join(parts[:i + 1])} is not a directory (links refused)"]
    try:
        got = _commit_tree_in(root_fd, commit)
    except (_Unreadable, IntegrityError) as exc:
        return [f"{where}: cannot recompute the tree of {show(commit, 80)}: {exc}"]
    if got != tree:
        return [f"{where}: tree of commit {commit} is {got}, the receipt says {tree}"]
    return []


def build_receipt(outcome: Outcome) -> Receipt:
    """:func:`build`, for a command that ends on it: when the machine refuses to write the
    receipt (a full disk), an EnvironmentFailure (exit 9) after the verdict is set aside
    (:func:`unclaim`), and a second signal meanwhile sets it aside too (the process then
    exits at once): a verdict never says accept_for_review with no receipt beside it."""
    d = outcome.run_dir

    def cut_short() -> None:
        if (d / RECEIPT).is_file():
            return  # written whole (renamed into place): the run is complete, left as is
        with contextlib.suppress(OSError):
            (d / f".{RECEIPT}.tmp").unlink()
        (d / CUT_SHORT).write_text(
            "a second signal ended the controller while the receipt was written: no "
            f"receipt; {unclaim(d)}\n")

    with interrupts.on_exit(cut_short):
        try:
            return build(outcome)
        except OSError as exc:
            if not is_environment_error(exc):
                if not (d / RECEIPT).is_file():
                    unclaim(d)
                raise
            raise EnvironmentFailure(
                f"the receipt could not be written ({exc.strerror or exc}): "
                f"{unclaim(d)}. Fix: free space, keep the run as evidence (no receipt: it "
                "is not a complete run) and run the cycle again") from None
        except Exception:
            # whatever stopped it (a file it could not read back, say): no receipt, so
            # no verdict that claims anything
            if not (d / RECEIPT).is_file():
                unclaim(d)
            raise


def unclaim(run_dir: Path) -> str:
    """A run whose receipt could not be written claims nothing: its verdict is renamed
    (a rename needs no free space), so no ``verdict.json`` says accept_for_review
    without a receipt. Returns what was done, for the message."""
    v = run_dir / "stages" / "compare" / "verdict.json"
    kept = v.with_name(NO_RECEIPT_VERDICT)
    try:
        os.replace(v, kept)
    except OSError as exc:
        return f"its verdict could not be set aside either ({exc.strerror}): {v}"
    return f"its verdict is kept as {kept}"
