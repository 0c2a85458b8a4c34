"""Apply stage (SPEC §5): the apply container edits a throwaway repository; the host then
commits the same proposal in a repository of its own and checks the container named it.

Invariant: the host never runs git on anything a container wrote (its objects,
.git/config or alternates could carry commands or other repositories' data). Before the
container starts, the host clones the base into its own ``candidate.git``; afterwards it
commits the proposal there with git's plumbing (:func:`gitops.commit_files`) and the
container's claim must name that very commit. Every field of the result and the patch are
the host's.

The container's ``result.json`` is read through :func:`runner.isolation.collect.collect`
(no symlink followed, no FIFO opened, sizes capped). The candidate tree is then exported
(:func:`gitops.export_tree`: the committed blobs exactly, whatever the tree's own
``.gitattributes`` say) and the export compared with the blobs; a difference is a named
refusal, ``export_mismatch``. The throwaway repository's ``info/attributes``
(:data:`gitops.RAW_ATTRIBUTES`) keeps the container's ``git add`` from converting what it
stores, so an honest edit of a CRLF file under ``text=auto`` or of a ``$Id$`` line under
``ident`` commits the proposal's bytes, as the host does.
The path set and allowlist always come from the operator (plan or flags), never from the
proposal (:func:`invocation_for`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from runner import fswalk, gitops
from runner.cycle.models import (
    Applied,
    ApplyRefusal,
    ApplyResult,
    Invocation,
    Proposal,
    ProposalFile,
)
from runner.errors import ConfigError, EnvironmentFailure, IntegrityError, OutputRejected
from runner.failures import one_line
from runner.hashing import write_json
from runner.isolation.collect import Limits, collect
from runner.isolation.sandbox import Mount, RunRecord, Sandbox, StopReason
from runner.loading import field_path, load_model, load_with_bytes, parse_model, show
from sandbox.apply import BRANCH, GIT_ENV
from sandbox.proposal import Change, Refused, check_changes

OUTPUT_LIMITS = Limits(max_file_bytes=8 * 1024 * 1024, max_total_bytes=16 * 1024 * 1024,
                       max_files=16, max_depth=2)
"""Caps on the apply container's /out (result.json and candidate.patch)."""

OPERATOR_FIELDS = ("paths", "allowlist")
"""Proposal fields that only the operator may set; a proposal carrying one is refused."""


def invocation_for(proposal: Path, *, repo: Path | None, ref: str | None, subdir: str | None,
                   paths: list[str] | None, allowlist: list[str] | None, plan: Path | None,
                   max_file_bytes: int) -> tuple[Invocation, Path, str, bytes]:
    """The invocation (path set, allowlist, base hashes, size cap) for a standalone apply.

    Returns (invocation, repository, base tree, the proposal's exact bytes). ConfigError
    naming the field when the operator gave no path set or allowlist, or when the proposal
    carries its own."""
    prop, raw = load_proposal(proposal)
    for name in OPERATOR_FIELDS:
        if name in prop.model_fields_set:
            raise ConfigError(f"the proposal carries its own {name!r}; the edit's path set "
                              "and allowlist are the operator's, never the proposal's",
                              path=str(proposal), field=name,
                              fix=f"remove {name!r} from the proposal and pass --paths and "
                                  "--allowlist (or --plan)")
    if plan is not None:
        from runner.cycle.plan import load_plan

        frozen, _ = load_plan(plan)
        if paths or allowlist:
            raise ConfigError("--paths/--allowlist and --plan both given", field="--plan",
                              fix="use the plan's path set and allowlist, or drop --plan")
        paths, allowlist = list(frozen.edit.paths), list(frozen.edit.allowlist)
        max_file_bytes = frozen.edit.max_file_bytes
        repo_path = (repo or Path(frozen.project.repo)).resolve()
        tree = (gitops.resolve_tree(repo_path, ref, subdir) if ref is not None
                else frozen.project.base_tree)
    else:
        for name, given in (("--paths", paths), ("--allowlist", allowlist)):
            if not given:
                raise ConfigError(f"{name} is required: the operator sets the path set and "
                                  "allowlist, never the proposal", field=name,
                                  fix=f"pass {name} (repeatable) or --plan DIR/plan.json")
        if repo is None or ref is None:
            raise ConfigError("--repo and --ref are required without --plan",
                              field="--repo" if repo is None else "--ref",
                              fix="pass --repo R --ref REF, or --plan DIR/plan.json")
        from runner.cycle.config import check_repo

        repo_path = Path(os.path.abspath(repo))
        tree = check_repo(repo_path, ref, subdir, path=None,
                          fields=("--repo", "--ref", "--subdir"))
    if not paths or not allowlist:  # the plan's EditSpec requires both; checked for mypy
        raise ConfigError("empty path set or allowlist", field="edit", fix="freeze again")
    if max_file_bytes <= 0:
        raise ConfigError(f"must be a positive number of bytes, got {max_file_bytes}",
                          field="--max-file-bytes", fix="pass e.g. --max-file-bytes 262144")
    # Base hashes: the proposal's claim when it makes one (the apply container refuses a
    # claim that differs from the tree), otherwise the operator's tree itself.
    base = prop.base
    if "base" not in prop.model_fields_set:
        base = {}
        for p in paths:
            data = gitops.read_blob(repo_path, tree, p)
            base[p] = None if data is None else hashlib.sha256(data).hexdigest()
    return (Invocation(paths=tuple(paths), allowlist=tuple(allowlist), base=base,
                       max_file_bytes=max_file_bytes), repo_path, tree, raw)


_RESULT: TypeAdapter[Applied | ApplyRefusal] = TypeAdapter(ApplyResult)
_OID = frozenset("0123456789abcdef")


def _is_object_id(value: object) -> bool:
    return isinstance(value, str) and len(value) in (40, 64) and set(value) <= _OID


def read_claim(data: object, rec: RunRecord) -> Applied | ApplyRefusal:
    """The apply container's result.json, typed; anything else is an ``output_refused``
    refusal naming what was wrong (container output is hostile input)."""
    def refused(message: str) -> ApplyRefusal:
        return ApplyRefusal(status="refused", reason="output_refused", message=message)

    if not isinstance(data, dict):
        return refused(f"result.json: expected a JSON object; container "
                       f"{rec.stop_reason.value}" + (f" ({rec.detail})" if rec.detail else ""))
    if data.get("status") == "applied" and rec.stop_reason is StopReason.OK \
            and not _is_object_id(data.get("commit")):
        # checked first: the host runs git with this value
        return refused("result.json: commit is not a git object id")
    try:
        claim = _RESULT.validate_python(data)
    except ValidationError as exc:
        e = exc.errors(include_url=False)[0]
        return refused(f"result.json: {field_path(e['loc'])}: {show(e['msg'], 200)}")
    if isinstance(claim, ApplyRefusal):
        # the reason and message reach the verdict's reasons and the receipt: a rule the
        # container applies, or output_refused; the message one bounded line
        message = one_line(claim.message, MAX_REFUSAL_MESSAGE)
        if claim.reason not in CONTAINER_REASONS:
            return refused(f"result.json: reason {show(claim.reason, 80)} is not a rule the "
                           f"apply container applies ({message})")
        return claim.model_copy(update={"message": message})
    return claim


CONTAINER_REASONS = frozenset({
    "absolute_path", "base_hash_mismatch", "duplicate_path", "git_failed", "git_path",
    "malformed_proposal",
    "not_a_regular_file", "not_normalized", "not_utf8", "nul_in_path", "outside_allowlist",
    "outside_invocation_set", "oversize_file", "path_through_file", "path_traversal",
    "symlink_in_path"})
"""The refusals the apply container names (``sandbox.proposal.Refused``); a unit test
holds this set equal to the names in its source."""
MAX_REFUSAL_MESSAGE = 2000
"""Characters of a container's refusal message kept (one line, escaped)."""


def apply_proposal(stage_dir: Path, repo: Path, tree: str, *,
                   run: Callable[[Path], RunRecord], uid: int,
                   export_to: Path | None = None) -> Applied | ApplyRefusal:
    """Run the apply container on a throwaway repo, then check its claim against the host's
    own commit of the proposal.

    ``stage_dir/in`` holds proposal.json and invocation.json. The host never runs git on
    anything the container wrote: before the container starts it clones the base into
    its own ``candidate.git``, and afterwards commits the proposal there itself
    (:func:`runner.gitops.commit_files`); the container's claim must name that very
    commit, and the patch kept is the host's diff. With
    ``export_to``, the candidate tree is exported there and checked against its blobs.
    The git readers of the stage's own repositories are stopped when it ends (nothing
    reads them again in this process; cached, each held two processes and four pipes).
    """
    try:
        return _apply_proposal(stage_dir, repo, tree, run=run, uid=uid, export_to=export_to)
    finally:
        gitops.close_readers_under(stage_dir)


def _apply_proposal(stage_dir: Path, repo: Path, tree: str, *,
                    run: Callable[[Path], RunRecord], uid: int,
                    export_to: Path | None) -> Applied | ApplyRefusal:
    work = stage_dir / "work"
    work.mkdir(mode=0o700)
    base_commit = gitops.throwaway_repo(repo, tree, work / "repo")
    # The host's own repository, cloned before the container sees the work repository:
    # the candidate is rebuilt in it from the proposal, and nothing the container wrote
    # into its repository (objects, config, alternates, modes) is ever read by git here.
    bare = stage_dir / ".candidate.git"  # named candidate.git once the candidate is in it
    gitops.clone_bare_untrusted(work / "repo", bare, branch="cyclebox/base")
    try:
        result = _run_and_check(stage_dir, work, bare, base_commit, run=run, uid=uid,
                                export_to=export_to)
        if isinstance(result, Applied):
            gitops.close_readers_under(bare)
            bare.rename(stage_dir / "candidate.git")
        return result
    finally:
        if bare.exists():
            gitops.close_readers_under(bare)
            shutil.rmtree(bare, ignore_errors=True)


def _run_and_check(stage_dir: Path, work: Path, bare: Path, base_commit: str, *,
                   run: Callable[[Path], RunRecord], uid: int,
                   export_to: Path | None) -> Applied | ApplyRefusal:
    (work / "out").mkdir()
    if os.getuid() == 0 and uid != 0:
        _give(work, uid)
    rec = run(work)
    try:
        claim = read_claim(collect(work / "out", OUTPUT_LIMITS).json("result.json"), rec)
    except OutputRejected as exc:
        # A planted symlink, FIFO, hard link or oversize file: recorded, never followed.
        claim = ApplyRefusal(status="refused", reason="output_refused",
                             message=f"{exc}; container {rec.stop_reason.value}"
                                     + (f" ({rec.detail})" if rec.detail else ""))
    if not isinstance(claim, Applied):
        _write_result(stage_dir, claim)
        return claim
    # The container's "applied" is never written as the stage's result: result.json says
    # applied only once the host rebuilt that commit and exported its tree (a failure in
    # between once left the container's claim, fields and all, as the host's record).
    if rec.stop_reason is not StopReason.OK:
        return _refuse(stage_dir, "apply_failed", rec.detail)
    fix = "the stage's in/ files are the host's own; run the cycle again"
    proposal = load_model(stage_dir / "in" / "proposal.json", Proposal, fmt="json",
                          what="proposal", fix=fix)
    inv = load_model(stage_dir / "in" / "invocation.json", Invocation, fmt="json",
                     what="invocation", fix=fix)
    try:
        result, patch = _rebuild(bare, base_commit, claim, proposal, inv)
    except (ConfigError, IntegrityError) as exc:
        return _refuse(stage_dir, "host_verification_failed",
                       f"the host could not rebuild the candidate: {one_line(str(exc), 2000)}")
    if isinstance(result, str):
        return _refuse(stage_dir, "host_verification_failed", result)
    # The commit is the host's own, so is the patch kept: the container's candidate.patch
    # is not compared (its diff read the work tree's .gitattributes, e.g. diff=python
    # hunk headers, which the host's bare repository does not, and refused honest edits).
    if export_to is not None:
        try:
            gitops.export_tree(bare, result.tree, export_to)
        except (IntegrityError, ConfigError) as exc:  # a blob differs; a bound was passed
            return _refuse(stage_dir, "export_mismatch", one_line(str(exc), 2000))
    (stage_dir / "candidate.patch").write_bytes(patch)
    _write_result(stage_dir, result)
    return result


def _rebuild(bare: Path, base: str, claim: Applied, proposal: Proposal,
             inv: Invocation) -> tuple[Applied | str, bytes]:
    """The candidate the proposal makes, committed by the host in its own repository as
    the apply container commits it (same bytes, modes, identity, dates and message), and
    its patch. The container's claim must name that very commit; every field of the
    result is the host's own. A str is the refusal's message."""
    changes = [Change(f.path, f.content) for f in proposal.files]
    try:
        check_changes(changes, paths=set(inv.paths), allowlist=list(inv.allowlist),
                      max_bytes=inv.max_file_bytes)
    except Refused as exc:
        return str(exc), b""
    for c in changes:  # the source the proposal was made against (check_tree's rule)
        data = gitops.read_blob(bare, base, c.path)
        actual = None if data is None else hashlib.sha256(data).hexdigest()
        expected = inv.base.get(c.path, "missing")
        if actual != expected:
            return (f"base_hash_mismatch: {c.path}: source is {actual} but the proposal was "
                    f"made against {expected}"), b""
    commit = gitops.commit_files(
        bare, base, [(c.path, c.content.encode("utf-8")) for c in changes],
        "cyclebox candidate\n\n" + proposal.rationale[:2000], branch=CANDIDATE_BRANCH,
        env=CANDIDATE_GIT_ENV)
    if claim.commit != commit:
        return (f"the container's commit {claim.commit} is not the commit the proposal makes "
                f"({commit}): its tree, modes, parents or message differ"), b""
    patch = gitops.diff(bare, base, commit)
    return Applied(status="applied", base_commit=base, commit=commit,
                   tree=gitops.head_tree(bare, commit), branch=CANDIDATE_BRANCH,
                   changed=tuple(gitops.changed_paths(bare, base, commit))), patch


CANDIDATE_BRANCH = BRANCH
CANDIDATE_GIT_ENV = {k: v for k, v in GIT_ENV.items()
                     if k.startswith(("GIT_AUTHOR_", "GIT_COMMITTER_"))}
"""The apply container's own commit identity and dates (``sandbox.apply.GIT_ENV``)."""


def _give(work: Path, uid: int) -> None:
    """Hand the host-made work directory to the apply role's uid, walked by directory
    descriptor (:mod:`runner.fswalk`): a path past ``PATH_MAX`` in the checkout is handed
    over like any other, no link is followed, and nothing is left out silently."""
    os.lchown(work, uid, uid)
    try:
        for e in fswalk.walk(work, max_depth=4096):
            try:
                os.chown(e.name, uid, uid, dir_fd=e.parent_fd, follow_symlinks=False)
            except OSError as exc:
                raise fswalk.WalkError(e.rel, f"cannot change its owner: {exc.strerror}"
                                       ) from None
    except fswalk.WalkError as exc:
        raise EnvironmentFailure(f"{work}/{exc}: the apply stage's work directory "
                                 "cannot be handed to its role") from None


def _write_result(stage_dir: Path, result: Applied | ApplyRefusal) -> None:
    write_json(stage_dir / "result.json", result.model_dump(mode="json"))


APPLY_COMMAND = ["python", "-m", "sandbox.apply_main"]
"""The apply container's command; it reads ``/in`` and edits the repository in ``/work``."""


def apply_standalone(proposal: Path, out_dir: Path, *, sandbox: Sandbox,
                     image: Callable[[], str], repo: Path | None, ref: str | None,
                     subdir: str | None, paths: list[str] | None, allowlist: list[str] | None,
                     plan: Path | None, max_file_bytes: int) -> Applied | ApplyRefusal:
    """``cyclebox apply``: apply one proposal outside a cycle, into a fresh ``out_dir``.

    ``sandbox`` runs the apply container; ``image()`` gives the apply role's image id and
    is called once the invocation is valid, so bad input is named before a missing image
    (as in freeze).

    The invocation comes from the operator (:func:`invocation_for`); ``out_dir`` is
    created only once it is valid (an existing one is refused) and removed again if
    staging the inputs fails. Returns the result as :func:`apply_proposal` records it in
    ``out_dir/result.json`` (``status`` applied or refused, with the named reason); the
    verified tree is exported to ``out_dir/candidate-src``."""
    from runner.isolation.launcher import launch
    from runner.isolation.policy import load_policies
    from runner.outdir import make_fresh_dir, refuse_existing, remove_created
    from runner.paths import default_policies

    refuse_existing(out_dir)
    inv, repo_path, tree, raw = invocation_for(
        proposal, repo=repo, ref=ref, subdir=subdir, paths=paths, allowlist=allowlist,
        plan=plan, max_file_bytes=max_file_bytes)
    policy = load_policies(default_policies()).roles["apply"]
    image_id = image()
    created = make_fresh_dir(out_dir)
    try:
        (out_dir / "in").mkdir()
        (out_dir / "in" / "proposal.json").write_bytes(raw)
        (out_dir / "in" / "invocation.json").write_text(json.dumps(inv.model_dump(mode="json")))
    except BaseException:
        remove_created(created)
        raise

    def run(work: Path) -> RunRecord:
        return launch(sandbox, policy, role="apply", run_id="apply", image=image_id,
                      command=APPLY_COMMAND, output_dir=work, output_target="/work",
                      mounts=[Mount(source=(out_dir / "in").resolve(), target="/in")])

    return apply_proposal(out_dir.resolve(), repo_path, tree, run=run, uid=policy.uid,
                          export_to=out_dir.resolve() / "candidate-src")


def _refuse(stage_dir: Path, reason: str, message: str) -> ApplyRefusal:
    """Record a host-side refusal in result.json (it replaces the container's claim)."""
    refused = ApplyRefusal(status="refused", reason=reason, message=message)
    _write_result(stage_dir, refused)
    return refused


PROPOSAL_FIX = "a proposal.json as the worker writes it: {files: [{path, content}], ...}"
WORKER_PROPOSAL = "stages/propose/out/proposal.json"


def read_proposal(raw: bytes) -> Proposal:
    """The worker's proposal.json (already read by the bounded collector), typed;
    OutputRejected naming the field for a shape the worker never writes."""
    try:
        return parse_model(raw, Proposal, path=WORKER_PROPOSAL, fix=PROPOSAL_FIX)
    except ConfigError as exc:
        raise OutputRejected(str(exc)) from None


def load_proposal(path: Path) -> tuple[ProposalFile, bytes]:
    """A proposal file's shape (runner.loading rules) and its exact bytes, which are what
    the apply container gets: the bytes checked are the bytes used."""
    return load_with_bytes(path, ProposalFile, fmt="json", what="proposal", fix=PROPOSAL_FIX)
