"""Freezing (SPEC §3): everything that decides the outcome, hash-locked in ``plan.json``.

``plan.json`` = ``{"plan": {...}, "hashes": {section: sha256}, "plan_hash": sha256}``.
Inputs the run needs (manifest, policy, cycle file, scripts, brief) are copied into
``DIR/inputs/`` and bound by hash; data stores are bound by path, size and sha256 and
re-hashed by every stage. A hash is a drift check, not authentication.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from runner import fswalk
from runner.cycle.artifacts import AGENT_ARTIFACTS, artifact_record
from runner.cycle.compare import load_policy
from runner.cycle.config import (
    DATA_DIR_FIX,
    BriefSpec,
    CycleFile,
    CycleInputs,
    DreamSpec,
    EditSpec,
    JudgeSpec,
    ProjectSpec,
    WorkerSpec,
    check_inputs,
    check_repo,
    load_cycle,
    refuse_out_in_data,
    resolve,
    uncommitted_warning,
)
from runner.cycle.dream import dream_clashes
from runner.cycle.manifest import load_manifest, verify_stores
from runner.cycle.models import (
    DEVELOPMENT,
    SPLITS,
    ComparisonPolicy,
    Identities,
    Manifest,
    Store,
)
from runner.cycle.scoring import (
    PROJECT_SCORER_INPUT,
    check_project_source,
    project_scorer_file,
    scorer_identity,
)
from runner.errors import ConfigError, IntegrityError, PrerequisiteError
from runner.gateway.budget import BudgetPolicy
from runner.gateway.config import UpstreamPolicy, read_credential
from runner.hashing import canonical_bytes, sha256_file, sha256_json
from runner.isolation.policy import RolePolicies, RolePolicy, load_policies
from runner.isolation.sandbox import Frozen
from runner.isolation.seccomp import load_profile
from runner.loading import (
    is_inside,
    load_data,
    load_model,
    read_capped,
    relative_inside,
    show,
    validate,
)
from runner.outdir import make_fresh_dir, refuse_existing, remove_created
from runner.toolchain import AgentToolchains, DerivedAnalyst
from sandbox.proposal import Refused, check_changes, check_path

CYCLE_ROLES = ("analyst", "worker", "evaluator", "apply")


class FrozenProject(Frozen):
    spec: ProjectSpec
    repo: str
    """Absolute path of the operator's repository (read only)."""
    base_tree: str
    """git tree id of base_ref (or base_ref:subdir)."""


class Plan(Frozen):
    """The frozen plan; every field is hashed into ``plan_hash``."""

    schema_: int = Field(alias="schema")
    name: str
    project: FrozenProject
    manifest_sha256: str
    dataset: str
    reference_hash: str
    data_hash: str
    data_dir: str
    stores: dict[str, Store]
    policy: ComparisonPolicy
    scorer: str
    """Scorer identity: sha256 over the evaluator's sources as built into its image, the
    manifest's scoring config and the project scorer file (runner/cycle/scoring.py)."""
    judge: JudgeSpec | None
    judge_id: str | None
    images: dict[str, str]
    """role -> immutable image id."""
    roles: dict[str, RolePolicy]
    upstreams: dict[str, UpstreamPolicy]
    """Credential names only; script and replay paths point into inputs/."""
    upstream_ids: dict[str, str]
    """sha256 of each upstream's definition plus its script or replay log bytes."""
    budget: BudgetPolicy
    edit: EditSpec
    brief: BriefSpec
    brief_sha256: str | None
    worker: WorkerSpec
    dream: DreamSpec
    trials: int
    seeds: tuple[int, ...]
    concurrency: int | Literal["auto"]
    inputs: dict[str, str]
    """inputs/ file -> sha256."""


def _copy_input(src: Path, inputs: Path, name: str, table: dict[str, str]) -> Path:
    dest = inputs / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    table[name] = sha256_file(dest)
    return dest


ImagesArg = dict[str, str] | Callable[[], dict[str, str]]
"""Image ids, or a function giving them (called only once every input checked out)."""


@dataclass(frozen=True)
class _Checked:
    """Everything freeze validated, before anything is written."""

    cycle: CycleFile
    inputs: CycleInputs
    manifest: Manifest
    policy: ComparisonPolicy
    roles: dict[str, RolePolicy]
    """The cycle's roles; a role that reaches no model in this cycle has upstream None."""
    tree: str
    upstreams: dict[str, UpstreamPolicy]
    """Upstreams the roles use, scripts and replay paths resolved to the originals."""
    warnings: tuple[str, ...] = ()
    """Things the operator should know that do not stop the cycle (uncommitted edits)."""

    requirements: str | None = None
    """The agent's checked requirement lines (project.requirements), if it declares any."""
    toolchains: AgentToolchains = AgentToolchains()  # noqa: RUF009 - frozen, shared safely
    """Everything the agent adds to the analyst image (pip, apt, npm), checked."""


AGENT_REQUIREMENTS = "agent-requirements.txt"
"""The inputs/ copy of the agent's checked requirement lines."""
AGENT_TOOLCHAINS = "agent-toolchains.json"
"""The inputs/ record of what the derived analyst image installed (versions per
toolchain), bound by hash like every frozen input."""
AGENT_NPM_LOCK = "agent-package-lock.json"
AGENT_NPM_PACKAGE = "agent-package.json"


def _agent_requirements(cycle: CycleFile, repo: Path, tree: str, where: str) -> str | None:
    """project.requirements read from the frozen base tree and checked; None when absent.

    Refused when the edit allowlist covers it: baseline and candidate run in one derived
    image, built from the base tree's requirements."""
    if cycle.project.requirements is None:
        return None
    from runner import gitops
    from runner.requirements import check_requirements

    field = "project.requirements"
    fix = ("a pip requirements file committed in the agent's source tree, relative to "
           "project.subdir")
    rel = relative_inside(cycle.project.requirements, path=where, field=field, fix=fix)
    if any(fnmatch.fnmatchcase(rel, g) for g in cycle.edit.allowlist):
        raise ConfigError(f"{rel} matches edit.allowlist, but the agent's requirements are "
                          "installed once, from the base tree, for both arms", path=where,
                          field=field, fix="keep the requirements file outside edit.allowlist")
    from runner.requirements import MAX_REQUIREMENTS_BYTES

    try:
        data = gitops.read_blob(repo, tree, rel, max_bytes=MAX_REQUIREMENTS_BYTES)
    except ConfigError:  # larger than the cap: refused unread
        raise ConfigError(f"{rel} in the base tree {tree[:12]} has more than "
                          f"{MAX_REQUIREMENTS_BYTES} bytes", path=where, field=field,
                          fix=fix) from None
    if data is None:
        raise ConfigError(f"{rel} is not a file in the base tree {tree[:12]}", path=where,
                          field=field, fix=fix)
    return check_requirements(data, source=rel, path=where, field=field)


def _requirements_warnings(cycle: CycleFile, requirements: str | None) -> tuple[str, ...]:
    """A warning naming the requirement lines that pin no single version."""
    from runner.requirements import unpinned

    loose = unpinned(requirements or "")
    if not loose:
        return ()
    return (f"project.requirements: {cycle.project.requirements}: "
            f"{len(loose)} line(s) pin no version ({', '.join(repr(x) for x in loose[:10])}"
            f"{', ...' if len(loose) > 10 else ''}); a later freeze may resolve other "
            "releases (a new derived image). Pin each with ==",)


def _check_src_paths(repo: Path, tree: str, cycle: CycleFile, where: str) -> None:
    """The agent's tree is exported and mounted at /src in every case and checked out at
    /work/repo by apply: a path in it that would be PATH_MAX or longer there, or a name
    the export refuses (a control character), is bad input now, naming it, not an error
    in every case."""
    from runner import gitops

    # The longest place the tree is used: the apply stage's checkout at /work/repo (the
    # agent's mount /src is shorter), so a path usable in one is usable in both.
    bad = gitops.unexportable(repo, tree, "/work/repo")
    if bad is None:
        return
    path, why = bad
    sub = f":{cycle.project.subdir.strip('/')}" if cycle.project.subdir else ""
    raise ConfigError(f"{show(f'{cycle.project.base_ref}{sub}')} (tree {tree[:12]}) holds "
                      f"{fswalk.shown(path)}: {why}", path=where, field="project.base_ref",
                      fix="commit the agent's tree with shorter paths and plain names (or "
                      "without that file) and point project.base_ref at that commit")


def _not_data(root: Path, manifest: bytes, frozen: list[tuple[str, Path]]
              ) -> Callable[[fswalk.Entry], str | None]:
    """What the agent under test must not find in a tree it reads (``data_dir`` at /data,
    a role policy's mount): a frozen input (the same file, e.g. hard-linked), a copy of
    the scenario manifest (it holds the held-out references), or a cyclebox run's frozen
    inputs (``inputs/manifest.json``, or a plan beside ``inputs/``)."""
    from runner.outdir import is_run_dir

    same: dict[tuple[int, int], str] = {}
    for name, p in frozen:
        with contextlib.suppress(OSError):
            st = os.stat(p)
            same[(st.st_dev, st.st_ino)] = name
    size, digest = len(manifest), hashlib.sha256(manifest).hexdigest()

    def refuse(e: fswalk.Entry) -> str | None:
        if not e.is_file:
            return None
        if (e.st.st_dev, e.st.st_ino) in same:
            return f"is the {same[(e.st.st_dev, e.st.st_ino)]} (the same file)"
        if e.st.st_size == size and e.sha256() == digest:
            return "is a copy of the scenario manifest, held-out references included"
        parent = e.rel.rpartition("/")[0]
        if e.name == "manifest.json" and parent.rpartition("/")[2] == "inputs":
            return "is a cyclebox run's frozen manifest (inputs/manifest.json)"
        if e.name == "plan.json" and is_run_dir(root / parent):
            return "is a cyclebox run's plan: its inputs/manifest.json holds the references"
        return None

    return refuse


BLIND_ROLES = ("analyst", "worker")
"""Roles that must never read the held-out references: the agent under test, and the
coding worker that edits it (it sees the development failures of the brief only)."""


def _check_src_blind(repo: Path, tree: str, cycle: CycleFile, manifest: bytes,
                     where: str) -> None:
    """The agent's tree is mounted at /src: the scenario manifest committed in it (a
    project whose repository holds its cycle files, no ``project.subdir``) would give the
    agent its own grading. Refused by content, wherever in the tree and however named."""
    from runner import gitops

    found = gitops.find_blob(repo, tree, manifest)
    if found is not None:
        raise ConfigError(f"the agent's tree ({show(cycle.project.base_ref)}, tree "
                          f"{tree[:12]}) holds the scenario manifest as {fswalk.shown(found)}; "
                          "it is mounted at /src, where the agent under test would read the "
                          "held-out references", path=where, field="project.subdir",
                          fix="set project.subdir to the agent's own directory (the cycle "
                          "files outside it), or keep the manifest out of the repository")


def check_agent_tree(root: Path, target: str, manifest: bytes,
                     frozen: list[tuple[str, Path]], *, path: str | None, field: str) -> None:
    """``root``, mounted into the agent under test at ``target``: every entry readable and
    openable there, and nothing that grades the agent in it (:func:`_not_data`);
    ConfigError naming ``field`` otherwise. At freeze, and again when the plan runs (a
    tree changed after freeze)."""
    try:
        fswalk.check_mountable(root, target, refuse=_not_data(root, manifest, frozen))
    except fswalk.WalkError as exc:
        raise ConfigError(f"{show(str(root))}/{fswalk.shown(exc.rel)}: {exc.reason}, and "
                          f"the agent under test reads it at {target}", path=path,
                          field=field, fix="make every entry of it readable, with shorter "
                          "paths; " + DATA_DIR_FIX) from None


def check_cycle(cycle_path: Path, *, upstream_override: dict[str, UpstreamPolicy] | None = None,
                check_credentials: bool = True) -> _Checked:
    """Every check freeze makes on its inputs; reads only, writes nothing."""
    cycle, base = load_cycle(cycle_path)
    where = show(str(cycle_path))
    inputs = check_inputs(cycle, cycle_path, base)
    manifest = load_manifest(inputs.manifest, inputs.data_dir, ref=(where, "scenarios"))
    manifest_bytes = read_capped(inputs.manifest)  # loaded above: a regular file
    grading = [("scenario manifest", inputs.manifest), ("policy", inputs.policy),
               ("roles", inputs.roles), *([("brief", inputs.brief)] if inputs.brief else [])]
    # the whole tree is mounted at /data: every entry readable, nothing that grades
    check_agent_tree(inputs.data_dir, "/data", manifest_bytes, grading, path=where,
                     field="data_dir")
    policy = _policy(load_policy(inputs.policy), manifest, cycle, cycle_path)
    _check_briefable(cycle, manifest, show(str(inputs.manifest)))
    _check_dream_ids(cycle.dream, manifest, show(str(inputs.manifest)))
    _check_dream_intent(cycle.dream, manifest, where)
    pols = load_policies(inputs.roles, ref=(where, "roles"))
    missing_roles = [r for r in CYCLE_ROLES if r not in pols.roles]
    if missing_roles:
        raise ConfigError(f"no policy for roles {missing_roles}", path=show(str(inputs.roles)),
                          field="roles", fix=f"define roles {', '.join(CYCLE_ROLES)}")
    for role in BLIND_ROLES:  # their own mounts: the same rule as data_dir
        for i, m in enumerate(pols.roles[role].mounts):
            check_agent_tree(Path(m.source), m.target, manifest_bytes, grading,
                             path=show(str(inputs.roles)),
                             field=f"roles.{role}.mounts[{i}].source")
    _check_edit(cycle.edit, cycle_path)
    tree = check_repo(inputs.repo, cycle.project.base_ref, cycle.project.subdir, path=where)
    _check_src_paths(inputs.repo, tree, cycle, where)
    _check_src_blind(inputs.repo, tree, cycle, manifest_bytes, where)
    dirty = uncommitted_warning(inputs.repo, cycle.project.base_ref, cycle.project.subdir,
                                path=where)

    upstreams: dict[str, UpstreamPolicy] = {}
    for name, up in cycle.upstreams.items():
        cred = up.credential
        upstreams[name] = up.model_copy(update={
            "script": str(resolve(base, up.script)) if up.script else None,
            "replay_from": str(resolve(base, up.replay_from)) if up.replay_from else None,
            # like every path of the cycle file: against its directory, frozen absolute
            # (read against the working directory, a plan run from elsewhere read another)
            **({"credential": cred.model_copy(update={"file": str(resolve(base, cred.file))})}
               if cred is not None and cred.file else {})})
    upstreams.update(upstream_override or {})
    role_upstream = used_upstreams(cycle, pols, path=where, roles_path=show(str(inputs.roles)))
    frozen: dict[str, UpstreamPolicy] = {}
    for role, used in sorted(role_upstream.items()):
        if used is None or used in frozen:
            continue
        if used not in upstreams:
            why = "judge: is set" if role == "evaluator" else f"{role} reaches a model"
            raise ConfigError(f"upstream {used!r} is not defined; role {role} uses it ({why})",
                              path=where, field=f"upstreams.{used}",
                              fix=f"define upstreams.{used} in the cycle file (provider, "
                              "models, script or base_url and credential)"
                              + (", or remove judge:" if role == "evaluator" else ""))
        frozen[used] = upstreams[used]
    check_upstreams(frozen, path=where, check_credentials=check_credentials)
    for field, model, up_name in (("worker.model", cycle.worker.model, "optimizer"),
                                  ("judge.model", cycle.judge.model if cycle.judge else None,
                                   "judge")):
        allowed = frozen[up_name].models if up_name in frozen else None
        if model is not None and allowed is not None and model not in allowed:
            raise ConfigError(f"model {show(model)} is not in the {up_name} upstream's "
                              f"allowlist {list(allowed)}", path=where, field=field,
                              fix=f"use one of {list(allowed)} or add it to "
                              f"upstreams.{up_name}.models")
    wup = frozen.get(role_upstream.get("worker") or "")
    if wup is not None and cycle.worker.max_tokens > wup.max_tokens:
        raise ConfigError(f"worker.max_tokens {cycle.worker.max_tokens} is above the cap of "
                          f"the worker's upstream ({wup.max_tokens}): the worker's one call "
                          "would be refused after the whole baseline ran", path=where,
                          field="worker.max_tokens",
                          fix=f"set worker.max_tokens to at most {wup.max_tokens}, or raise "
                          f"upstreams.{role_upstream.get('worker')}.max_tokens")
    _check_edit_texts(inputs.repo, tree, cycle.edit, where)
    if inputs.brief is not None:
        _check_brief(inputs.brief, where)
    roles = {r: pols.roles[r].model_copy(update={"upstream": role_upstream.get(r)})
             for r in CYCLE_ROLES}
    requirements = _agent_requirements(cycle, inputs.repo, tree, where)
    from runner.cycle.toolchains import agent_toolchains

    toolchains = agent_toolchains(cycle, inputs.repo, tree, where, requirements)
    return _Checked(cycle=cycle, inputs=inputs, manifest=manifest, policy=policy, roles=roles,
                    tree=tree, upstreams=frozen,
                    warnings=((dirty,) if dirty else ()) + _requirements_warnings(
                        cycle, requirements),
                    requirements=requirements, toolchains=toolchains)


def used_upstreams(cycle: CycleFile, pols: RolePolicies, *, path: str,
                   roles_path: str) -> dict[str, str | None]:
    """Role -> the upstream it reaches in this cycle (None: no gateway socket at all).

    The roles file says which upstream a role *may* reach; the cycle decides whether it
    does: the evaluator reaches the judge only when the cycle sets ``judge:``. Only these
    upstreams are frozen, and only their credentials are read."""
    out: dict[str, str | None] = {}
    for role in CYCLE_ROLES:
        name = pols.roles[role].upstream
        if role == "evaluator" and cycle.judge is None:
            name = None
        out[role] = name
    if cycle.judge is not None and out["evaluator"] is None:
        raise ConfigError("judge: is set but the evaluator role has no model access",
                          path=path, field="judge",
                          fix=f"set roles.evaluator.upstream: judge in {roles_path}, or "
                          "remove judge: from the cycle file")
    return out


def check_upstreams(upstreams: dict[str, UpstreamPolicy], *, path: str,
                    check_credentials: bool = True) -> None:
    """Scripts load, replay logs exist and (optionally) credentials are readable on the
    host; ConfigError / PrerequisiteError naming the upstream otherwise. Reads only."""
    from runner.gateway.providers import load_script

    for name, up in sorted(upstreams.items()):
        if up.script:
            load_script(Path(up.script), ref=(path, f"upstreams.{name}.script"))
        if up.replay_from:
            log = Path(up.replay_from) / "gateway" / "calls.jsonl"
            if not log.is_file():
                raise ConfigError(f"{show(str(log))} not found", path=path,
                                  field=f"upstreams.{name}.replay_from",
                                  fix="point at a finished run directory")
        if check_credentials and up.credential is not None:  # openai and anthropic alike
            read_credential(name, up.credential)


def freeze(cycle_path: Path, out: Path, *, images: ImagesArg,
           upstream_override: dict[str, UpstreamPolicy] | None = None,
           dream_override: DreamSpec | None = None,
           check_credentials: bool = True,
           warn: Callable[[str], None] | None = None,
           derive_analyst: Callable[[str, AgentToolchains], str | DerivedAnalyst] | None
           = None) -> tuple[Plan, str]:
    """Write ``out/plan.json``; return (plan, plan_hash).

    Every input, credential and image is checked first; only then is ``out`` created, with
    an exclusive mkdir (an existing directory is refused, and of two racers one wins and
    the other gets that refusal). A failure while writing removes ``out`` again, so the
    corrected rerun can use the same path. ``warn`` is given each warning the checks
    found (e.g. uncommitted changes the run leaves out). A project with
    ``project.requirements``, ``project.apt`` or ``project.npm`` gets the analyst image
    ``derive_analyst(analyst_id, toolchains)`` returns (the caller's backend builds it
    offline when missing), and the plan freezes that image's id as the analyst's.
    """
    refuse_existing(out)
    c = check_cycle(cycle_path, upstream_override=upstream_override,
                    check_credentials=check_credentials)
    refuse_out_in_data(out, c.inputs.data_dir, path=show(str(cycle_path)))
    if warn is not None:
        for w in c.warnings:
            warn(w)
    image_ids = images() if callable(images) else images
    missing = [r for r in CYCLE_ROLES if r not in image_ids]
    if missing:
        raise PrerequisiteError(f"no image for roles {missing}. Fix: cyclebox images build")
    derived: DerivedAnalyst | None = None
    if not c.toolchains.empty():
        if derive_analyst is None:
            raise PrerequisiteError("project.requirements, apt or npm is set but this caller "
                                    "cannot build "
                                    "the derived analyst image. Fix: run the cycle with "
                                    "`cyclebox cycle run`")
        from runner.requirements import RequirementsRefused

        try:
            got = derive_analyst(image_ids["analyst"], c.toolchains)
        except RequirementsRefused as exc:  # name the file and the cycle file
            raise exc.named(c.cycle.project.requirements or "requirements",
                            show(str(cycle_path))) from None
        derived = got if isinstance(got, DerivedAnalyst) else DerivedAnalyst(id=got)
        image_ids = {**image_ids, "analyst": derived.id}
    created = make_fresh_dir(out)
    try:
        return _write_frozen(c, cycle_path, out, image_ids, dream_override, derived)
    except BaseException:
        remove_created(created)
        raise


def _write_frozen(c: _Checked, cycle_path: Path, out: Path, images: dict[str, str],
                  dream_override: DreamSpec | None,
                  derived: DerivedAnalyst | None = None) -> tuple[Plan, str]:
    cycle, manifest, policy = c.cycle, c.manifest, c.policy
    inputs_dir = out / "inputs"
    table: dict[str, str] = {}
    _copy_input(cycle_path, inputs_dir, "cycle.yaml", table)
    _copy_input(c.inputs.manifest, inputs_dir, "manifest.json", table)
    _copy_input(c.inputs.policy, inputs_dir, "policy" + c.inputs.policy.suffix, table)
    _copy_input(c.inputs.roles, inputs_dir, "roles.yaml", table)
    roles = {r: _freeze_seccomp(r, c.roles[r], inputs_dir, table) for r in CYCLE_ROLES}
    frozen_ups: dict[str, UpstreamPolicy] = {}
    up_ids: dict[str, str] = {}
    for name, orig in sorted(c.upstreams.items()):
        up, extra = orig, None
        if orig.script:
            dest = _copy_input(Path(orig.script), inputs_dir, f"scripts/{name}.yaml", table)
            up = orig.model_copy(update={"script": str(dest)})
            extra = dest
        if orig.replay_from:
            extra = Path(orig.replay_from) / "gateway" / "calls.jsonl"
        frozen_ups[name] = up
        up_ids[name] = upstream_id(up, extra, field=f"upstreams.{name}")
    if c.requirements is not None:
        (inputs_dir / AGENT_REQUIREMENTS).write_text(c.requirements)
        table[AGENT_REQUIREMENTS] = sha256_file(inputs_dir / AGENT_REQUIREMENTS)
    npm = c.toolchains.npm
    agent_files = ({AGENT_NPM_LOCK: npm.lockfile, AGENT_NPM_PACKAGE: npm.package_json}
                   if npm else {})
    if derived is not None:
        agent_files[AGENT_TOOLCHAINS] = derived.record().encode()
        agent_files[AGENT_ARTIFACTS] = artifact_record(derived.artifacts)
    for name, data in agent_files.items():
        (inputs_dir / name).write_bytes(data)
        table[name] = sha256_file(inputs_dir / name)
    brief_sha = None
    if c.inputs.brief is not None:
        dest = _copy_input(c.inputs.brief, inputs_dir, "brief.md", table)
        brief_sha = sha256_file(dest)
    scorer = _freeze_scorer(manifest, c.inputs.manifest, inputs_dir, table)
    judge_id = None
    if cycle.judge:
        judge_up = c.upstreams.get("judge")
        judge_id = judge_identity(cycle.judge, up_ids.get("judge"),
                                  replay_from=judge_up.replay_from if judge_up else None)
    policy = policy.model_copy(update={"identities": Identities(
        data_hash=manifest.data_hash, reference_hash=manifest.reference_hash, scorer=scorer,
        judge=judge_id)})
    plan = Plan.model_validate({
        "schema": 1, "name": cycle.name,
        "project": FrozenProject(spec=cycle.project, repo=str(c.inputs.repo), base_tree=c.tree),
        "manifest_sha256": table["manifest.json"], "dataset": manifest.dataset,
        "reference_hash": manifest.reference_hash, "data_hash": manifest.data_hash,
        "data_dir": str(c.inputs.data_dir), "stores": manifest.stores, "policy": policy,
        "scorer": scorer, "judge": cycle.judge, "judge_id": judge_id,
        "images": {r: images[r] for r in CYCLE_ROLES},
        "roles": roles, "upstreams": frozen_ups,
        "upstream_ids": up_ids, "budget": cycle.budget, "edit": cycle.edit,
        "brief": cycle.brief, "brief_sha256": brief_sha, "worker": cycle.worker,
        "dream": dream_override or cycle.dream, "trials": cycle.trials,
        "seeds": cycle.seeds or tuple(range(cycle.trials)), "concurrency": cycle.concurrency,
        "inputs": table})
    plan_hash = write_plan(plan, out / "plan.json")
    return plan, plan_hash


def upstream_id(up: UpstreamPolicy, extra: Path | None, *, field: str) -> str:
    """sha256 of the upstream's definition plus the bytes of its script or replay log,
    streamed from a regular file opened non-blocking (a recorded run given to replay is
    hostile: its log may be huge, or swapped for a FIFO after the check)."""
    h = hashlib.sha256(canonical_bytes(up.model_dump(mode="json",
                                                     exclude={"script", "replay_from"})))
    if extra is None:
        return h.hexdigest()
    try:
        fd = os.open(extra, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{show(str(extra))} cannot be read ({exc.strerror})", field=field,
                          fix="point at a finished run directory or an existing script"
                          ) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{show(str(extra))} is not a regular file", field=field,
                              fix="point at a finished run directory or an existing script")
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def judge_identity(judge: JudgeSpec, upstream_id: str | None, *,
                   replay_from: str | None = None) -> str:
    """The judge's identity (spec, prompt, upstream), frozen into the comparison policy
    and every graded record.

    A replay answers the judge's calls with the recorded bytes, so its judge *is* the
    recorded one: it keeps the ``judge_id`` of the recorded plan when that plan froze the
    same judge spec (a changed prompt changes the request bytes, which then miss).
    Otherwise the replay upstream's own id (its log's bytes) would make every replayed
    record differ from the recorded one.
    """
    from sandbox.evaluator import JUDGE_PROMPT

    spec = judge.model_dump(mode="json")
    if replay_from is not None:
        # The recorded run is hostile input: read capped and strict (a deep nesting was a
        # RecursionError on the host), and only a digest is kept as an identity.
        try:
            doc = load_data(Path(replay_from) / "plan.json", fmt="json", what="recorded plan")
        except ConfigError:
            doc = None
        recorded = doc.get("plan") if isinstance(doc, dict) else None
        if (isinstance(recorded, dict) and recorded.get("judge") == spec
                and isinstance(recorded.get("judge_id"), str)
                and re.fullmatch(r"[0-9a-f]{64}", recorded["judge_id"])):
            return str(recorded["judge_id"])
    return sha256_json({"judge": spec, "prompt": JUDGE_PROMPT, "upstream": upstream_id})


def _freeze_scorer(manifest: Manifest, manifest_path: Path, inputs: Path,
                   table: dict[str, str]) -> str:
    """Copy the project scorer file (if any) into ``inputs/`` and return the scorer
    identity over the copy's bytes, which are checked again (the file may have changed)."""
    src = project_scorer_file(manifest, manifest_path)
    if src is None:
        return scorer_identity(manifest, None)
    dest = _copy_input(src, inputs, PROJECT_SCORER_INPUT, table)
    check_project_source(dest.read_bytes(), path=show(str(manifest_path)),
                         field="scoring.project.file")
    return scorer_identity(manifest, table[PROJECT_SCORER_INPUT])


def _freeze_seccomp(role: str, pol: RolePolicy, inputs: Path,
                    table: dict[str, str]) -> RolePolicy:
    """Copy the role's seccomp profile into ``inputs/`` (bound by sha256 there), check
    the copy, and point the frozen policy at it, so every stage runs the frozen bytes."""
    field = f"roles.{role}.seccomp"
    src = load_profile(Path(pol.seccomp) if pol.seccomp else None, field=field)
    name = f"seccomp/{src.sha256[:16]}.json"
    if name not in table:
        _copy_input(Path(src.path), inputs, name, table)
    if load_profile(inputs / name, field=field).sha256 != src.sha256:
        raise ConfigError(f"{src.path} changed while it was being frozen", field=field,
                          fix="freeze again")
    # Relative to the run directory (``inputs/seccomp/...``), so the frozen role policy
    # hashes the same in a recorded and a replayed run; see :func:`frozen_role`.
    return pol.model_copy(update={"seccomp": f"{inputs.name}/{name}"})


def frozen_role(plan: Plan, run_dir: Path, role: str) -> RolePolicy:
    """The plan's policy for ``role`` with its frozen seccomp copy resolved in ``run_dir``."""
    pol = plan.roles[role]
    if pol.seccomp and not Path(pol.seccomp).is_absolute():
        return pol.model_copy(update={"seccomp": str(run_dir / pol.seccomp)})
    return pol


def _policy(policy: ComparisonPolicy, manifest: Manifest, cycle: CycleFile,
            cycle_path: Path) -> ComparisonPolicy:
    ids = {s.id for s in manifest.scenarios}
    unknown = sorted(set(policy.cases) - ids)
    if unknown:
        raise ConfigError(f"policy names cases not in the manifest: {unknown}",
                          path=str(cycle_path), field="policy.cases",
                          fix="list only scenario ids of the manifest in the policy's cases")
    if policy.trials != cycle.trials:
        raise ConfigError(f"policy.trials {policy.trials} != cycle trials {cycle.trials}",
                          path=str(cycle_path), field="trials", fix="make them equal")
    if policy.require_judge and cycle.judge is None:
        raise ConfigError("the policy sets require_judge: true, but the cycle has no judge: "
                          "every comparison would be invalid", path=str(cycle_path),
                          field="judge", fix="add judge: to the cycle file, or set "
                          "require_judge: false in the policy")
    mandatory = sorted(set(policy.mandatory) | {s.id for s in manifest.scenarios
                                                if s.mandatory and s.id in policy.cases})
    # judge.required (default true) is the cycle's word that a judge failure invalidates
    # the comparison: frozen into the policy compare applies, as require_judge. A policy
    # that says otherwise in so many words is a conflict, never silently overridden.
    required = policy.require_judge
    if cycle.judge is not None:
        if "require_judge" in policy.model_fields_set and \
                policy.require_judge != cycle.judge.required:
            said = ("defaults to true" if "required" not in cycle.judge.model_fields_set
                    else f"is {str(cycle.judge.required).lower()}")
            raise ConfigError(
                f"the policy sets require_judge: {str(policy.require_judge).lower()}, but "
                f"the cycle's judge.required {said}", path=str(cycle_path),
                field="judge.required",
                fix="make them agree: set judge.required in the cycle file to the policy's "
                    "require_judge (true: a judge failure makes the comparison invalid), or "
                    "drop require_judge from the policy")
        required = cycle.judge.required
    return policy.model_copy(update={"mandatory": tuple(mandatory), "require_judge": required})


def _check_briefable(cycle: CycleFile, manifest: Manifest, where: str) -> None:
    """A generated brief (or dream) needs development cases: refuse a manifest with none,
    rather than run a cycle whose worker could only ever get an empty brief."""
    if any(s.split == DEVELOPMENT for s in manifest.scenarios):
        return
    uses = [w for w, on in (("brief.mode generate", cycle.brief.mode == "generate"),
                            (f"dream.mode {cycle.dream.mode}", cycle.dream.mode != "off")) if on]
    if uses:
        got = sorted({s.split for s in manifest.scenarios})
        raise ConfigError(f"no scenario has split {DEVELOPMENT!r} (splits here: "
                          f"{', '.join(got) or 'none'}), but the cycle's {' and '.join(uses)} "
                          "works from development cases", path=where, field="scenarios[].split",
                          fix=f"mark the cases the worker may learn from split: {DEVELOPMENT} "
                          f"(the splits are {', '.join(SPLITS)}), or give a fixed brief "
                          "(brief: {mode: file, file: BRIEF.md}) with dream off")


def _check_dream_intent(dream: DreamSpec, manifest: Manifest, where: str) -> None:
    """Dream rewrites the text at ``dream.intent_key`` of each development case's input: a
    key no case has made every variant the case plus a new field the agent never reads."""
    if dream.mode == "off":
        return
    lacking = [sc.id for sc in manifest.scenarios if sc.split == DEVELOPMENT
               and not isinstance(sc.input.get(dream.intent_key), str)]
    if lacking:
        raise ConfigError(f"development cases {lacking[:5]} have no text field "
                          f"{dream.intent_key[:80]!r} in their input, which dream rewrites",
                          path=where, field="dream.intent_key",
                          fix="name the input field that holds each task's request "
                          "(e.g. question)")


def _check_dream_ids(dream: DreamSpec, manifest: Manifest, where: str) -> None:
    """A dream variant is named ``<development case>_dream<k>``: a case of the manifest
    with such an id would be replaced by a model-written variant."""
    clash = dream_clashes(dream, manifest.scenarios)
    if clash:
        raise ConfigError(f"scenario ids {clash[:5]} are the names dream.mode "
                          f"{dream.mode} gives its variants of development cases; a "
                          "variant would replace the case", path=where, field="scenarios[].id",
                          fix="rename those cases, or set dream.mode: off")


MAX_BRIEF_BYTES = 1 << 20
"""Largest brief file: it is copied into the run and read whole into the worker's
prompt."""


def _check_brief(brief: Path, where: str) -> None:
    """The brief is UTF-8 text of at most :data:`MAX_BRIEF_BYTES` (found only after the
    whole baseline had run, as an unexpected error; a 1 GiB sparse file was copied)."""
    from runner.loading import decode_utf8, read_capped

    fix = "give a UTF-8 Markdown brief of at most 1 MiB"
    data = read_capped(brief, max_bytes=MAX_BRIEF_BYTES, what="brief file", fix=fix,
                       ref=(where, "brief.file"))
    try:
        decode_utf8(data, path=show(str(brief)))
    except ConfigError as exc:
        raise ConfigError(f"brief file {show(str(brief))}: {exc}", path=where,
                          field="brief.file", fix=fix) from None


def _check_edit_texts(repo: Path, tree: str, edit: EditSpec, where: str) -> None:
    """Every ``edit.paths`` file in the base tree is UTF-8 text: the worker edits text and
    is shown each file whole (a binary one was refused only at the propose stage)."""
    from runner import gitops

    for p in edit.paths:
        data = gitops.read_blob(repo, tree, p)
        if data is None:
            continue  # a new file the worker may create
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"edit.paths {show(p)} is not UTF-8 text in the base tree "
                              f"(byte {exc.start}); the worker edits text files only",
                              path=where, field="edit.paths",
                              fix="take it out of edit.paths") from None


def _check_edit(edit: EditSpec, cycle_path: Path) -> None:
    bad = next((p for p in edit.paths
                if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in p)), None)
    if bad is not None:  # a path the worker and the reviewer would see differently
        raise ConfigError(f"edit.paths {show(bad)} holds a control character",
                          path=str(cycle_path), field="edit.paths",
                          fix="list plain relative paths, without control characters")
    try:
        check_changes([], paths=set(edit.paths), allowlist=list(edit.allowlist))
        for p in edit.paths:
            check_path(p, paths=set(edit.paths), allowlist=list(edit.allowlist))
    except Refused as exc:
        raise ConfigError(str(exc), path=str(cycle_path), field="edit.paths",
                          fix="list exact relative paths that match edit.allowlist") from None


def write_plan(plan: Plan, path: Path) -> str:
    body = plan.model_dump(mode="json", by_alias=True)
    hashes = {k: sha256_json(v) for k, v in sorted(body.items())}
    plan_hash = sha256_json(body)
    path.write_text(json.dumps({"plan": body, "hashes": hashes, "plan_hash": plan_hash},
                               indent=1, sort_keys=True) + "\n")
    return plan_hash


PLAN_FIX = "pass the plan.json that `cyclebox freeze` (or --prepare-only) wrote"


class _PlanDoc(Frozen):
    plan: dict[str, Any]
    hashes: dict[str, str]
    plan_hash: str


def load_plan(path: Path) -> tuple[Plan, str]:
    """Read plan.json and re-check every hash; IntegrityError on any difference.

    A missing file or one that is not a plan document is bad input (ConfigError); a plan
    whose hashes do not match is drift or tampering (IntegrityError)."""
    where = show(str(path))
    doc = load_model(path, _PlanDoc, fmt="json", what="plan", fix=PLAN_FIX)
    body = doc.plan
    if sha256_json(body) != doc.plan_hash:
        raise IntegrityError(f"{where}: plan_hash does not match the plan (tampered?); "
                             "refusing to run")
    for k, v in body.items():
        if doc.hashes.get(k) != sha256_json(v):
            raise IntegrityError(f"{where}: section {show(k)!r} hash mismatch")
    plan = validate(Plan, body, path=where, fix=PLAN_FIX, prefix="plan")
    inputs = path.parent / "inputs"
    for name, digest in plan.inputs.items():
        p = inputs / name
        if not is_inside(p, inputs) or not p.is_file() or sha256_file(p) != digest:
            raise IntegrityError(f"frozen input {show(str(p))} changed or missing since "
                                 "freeze")
    return plan, doc.plan_hash


class PlanDoc(Frozen):
    """plan.json typed, for reading a run's plan after the fact (receipts, exports):
    :func:`load_plan` is the check before a run, this is how its fields are read."""

    plan: Plan
    hashes: dict[str, str]
    """Section -> sha256 of its canonical JSON."""
    plan_hash: str


def read_plan_doc(path: Path) -> PlanDoc:
    """plan.json as written (runner.loading rules); hashes are not re-checked here."""
    return load_model(path, PlanDoc, fmt="json", what="plan", fix=PLAN_FIX)


def load_frozen_manifest(run_dir: Path) -> Manifest:
    """The manifest copy under ``run_dir/inputs`` (bound by the plan's input hashes)."""
    p = run_dir / "inputs" / "manifest.json"
    return load_model(p, Manifest, fmt="json", what="frozen manifest", fix=PLAN_FIX)


@contextlib.contextmanager
def plan_lock(plan_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on a prepared plan for the duration of its run.

    Two processes given the same plan: one runs it, the other is refused at once (exit 3,
    naming the directory). The lock is ``flock`` on plan.json itself, so it adds no file to
    the run directory and dies with the process."""
    try:
        fd = os.open(plan_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ConfigError(f"cannot open {show(str(plan_path))}: {exc.strerror}",
                          field="--plan", fix=PLAN_FIX) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{show(str(plan_path.parent))} is being run by another "
                              "process; a plan runs once", field="--plan",
                              fix="wait for that run, or freeze again into a new "
                              "directory") from None
        yield
    finally:
        os.close(fd)


def check_drift(plan_path: Path, expected_hash: str, plan: Plan) -> str | None:
    """None when plan and data are unchanged; otherwise the named drift."""
    try:
        _, h = load_plan(plan_path)
        manifest = load_frozen_manifest(plan_path.parent)
    except (IntegrityError, ConfigError) as exc:
        return f"plan drift: {exc}"
    if h != expected_hash:
        return "plan drift: plan_hash changed during the run"
    try:
        verify_stores(manifest, Path(plan.data_dir))
    except IntegrityError as exc:
        return f"data drift: {exc}"
    return None
