"""Freezing (SPEC §3): everything that decides the outcome, hash-locked in ``plan.json``.

``plan.json`` = ``{"plan": {...}, "hashes": {section: sha256}, "plan_hash": sha256}``.
Inputs the run needs (manifest, policy, cycle file, scripts, brief) are copied into
``DIR/inputs/`` and bound by hash; data stores are bound by path, size and sha256 and
re-hashed by every stage. A hash is a drift check, not authentication.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pydantic import Field

from runner.cycle.compare import load_policy
from runner.cycle.config import (
    BriefSpec,
    CycleFile,
    DreamSpec,
    EditSpec,
    JudgeSpec,
    ProjectSpec,
    WorkerSpec,
    load_cycle,
    resolve,
)
from runner.cycle.manifest import load_manifest, verify_stores
from runner.cycle.models import ComparisonPolicy, Identities, Manifest, Store
from runner.errors import ConfigError, IntegrityError
from runner.gateway.budget import BudgetPolicy
from runner.gateway.config import UpstreamPolicy
from runner.hashing import canonical_bytes, sha256_bytes, sha256_file, sha256_json
from runner.paths import sandbox_src
from runner.policy import ROLE_UPSTREAM, RolePolicy, load_policies
from runner.sandbox import Frozen
from runner.seccomp import load_profile
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
    """sha256 of the scorer source (sandbox/evaluator.py) as built into the evaluator image."""
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
    concurrency: int
    inputs: dict[str, str]
    """inputs/ file -> sha256."""


def _copy_input(src: Path, inputs: Path, name: str, table: dict[str, str]) -> Path:
    dest = inputs / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    table[name] = sha256_file(dest)
    return dest


def freeze(cycle_path: Path, out: Path, *, images: dict[str, str],
           upstream_override: dict[str, UpstreamPolicy] | None = None,
           dream_override: DreamSpec | None = None) -> tuple[Plan, str]:
    """Write ``out/plan.json`` (``out`` must not exist); return (plan, plan_hash)."""
    from runner import gitops

    if out.exists():
        raise ConfigError(f"{out} already exists; prior evidence is never overwritten",
                          field="--out", fix="choose a new output directory")
    cycle, base = load_cycle(cycle_path)
    manifest_path = resolve(base, cycle.scenarios)
    data_dir = resolve(base, cycle.data_dir)
    manifest = load_manifest(manifest_path, data_dir)
    policy = _policy(load_policy(resolve(base, cycle.policy)), manifest, cycle, cycle_path)
    roles_path = resolve(base, cycle.roles)
    pols = load_policies(roles_path)
    _check_edit(cycle.edit, cycle_path)
    repo = resolve(base, cycle.project.repo)
    tree = gitops.resolve_tree(repo, cycle.project.base_ref, cycle.project.subdir)
    missing = [r for r in CYCLE_ROLES if r not in images]
    if missing:
        raise ConfigError(f"no image for roles {missing}", fix="cyclebox images build")

    out.mkdir(parents=True)
    inputs_dir = out / "inputs"
    table: dict[str, str] = {}
    _copy_input(cycle_path, inputs_dir, "cycle.yaml", table)
    _copy_input(manifest_path, inputs_dir, "manifest.json", table)
    _copy_input(resolve(base, cycle.policy), inputs_dir, "policy" + resolve(
        base, cycle.policy).suffix, table)
    _copy_input(roles_path, inputs_dir, "roles.yaml", table)
    roles = {r: _freeze_seccomp(r, pols.roles[r], inputs_dir, table) for r in CYCLE_ROLES}

    upstreams: dict[str, UpstreamPolicy] = {**pols.upstreams}
    for name, up in cycle.upstreams.items():
        upstreams[name] = up.model_copy(update={
            "script": str(resolve(base, up.script)) if up.script else None,
            "replay_from": str(resolve(base, up.replay_from)) if up.replay_from else None})
    upstreams.update(upstream_override or {})
    used = {ROLE_UPSTREAM[r] for r in ROLE_UPSTREAM if pols.roles.get(r) and
            pols.roles[r].upstream}
    frozen_ups: dict[str, UpstreamPolicy] = {}
    up_ids: dict[str, str] = {}
    for name in sorted(used):
        if name not in upstreams:
            raise ConfigError(f"upstream {name!r} is not defined", path=str(cycle_path),
                              field=f"upstreams.{name}")
        up = upstreams[name]
        extra = b""
        if up.script:
            dest = _copy_input(Path(up.script), inputs_dir, f"scripts/{name}.yaml", table)
            up = up.model_copy(update={"script": str(dest)})
            extra = dest.read_bytes()
        if up.replay_from:
            log = Path(up.replay_from) / "gateway" / "calls.jsonl"
            if not log.is_file():
                raise ConfigError(f"{log} not found", field=f"upstreams.{name}.replay_from",
                                  fix="point at a finished run directory")
            extra = log.read_bytes()
        frozen_ups[name] = up
        up_ids[name] = sha256_bytes(canonical_bytes(
            up.model_dump(mode="json", exclude={"script", "replay_from"})) + extra)
    brief_sha = None
    if cycle.brief.mode == "file":
        if not cycle.brief.file:
            raise ConfigError("brief.mode file needs brief.file", path=str(cycle_path),
                              field="brief.file")
        dest = _copy_input(resolve(base, cycle.brief.file), inputs_dir, "brief.md", table)
        brief_sha = sha256_file(dest)
    scorer = sha256_file(sandbox_src() / "evaluator.py")
    judge_id = None
    if cycle.judge:
        from sandbox.evaluator import JUDGE_PROMPT

        judge_id = sha256_json({"judge": cycle.judge.model_dump(mode="json"),
                                "prompt": JUDGE_PROMPT, "upstream": up_ids.get("judge")})
    policy = policy.model_copy(update={"identities": Identities(
        data_hash=manifest.data_hash, reference_hash=manifest.reference_hash, scorer=scorer,
        judge=judge_id)})
    plan = Plan.model_validate({
        "schema": 1, "name": cycle.name,
        "project": FrozenProject(spec=cycle.project, repo=str(repo), base_tree=tree),
        "manifest_sha256": table["manifest.json"], "dataset": manifest.dataset,
        "reference_hash": manifest.reference_hash, "data_hash": manifest.data_hash,
        "data_dir": str(data_dir), "stores": manifest.stores, "policy": policy,
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
    return pol.model_copy(update={"seccomp": str(inputs / name)})


def _policy(policy: ComparisonPolicy, manifest: Manifest, cycle: CycleFile,
            cycle_path: Path) -> ComparisonPolicy:
    ids = {s.id for s in manifest.scenarios}
    unknown = sorted(set(policy.cases) - ids)
    if unknown:
        raise ConfigError(f"policy names cases not in the manifest: {unknown}",
                          path=str(cycle_path), field="policy.cases")
    if policy.trials != cycle.trials:
        raise ConfigError(f"policy.trials {policy.trials} != cycle trials {cycle.trials}",
                          path=str(cycle_path), field="trials", fix="make them equal")
    mandatory = sorted(set(policy.mandatory) | {s.id for s in manifest.scenarios
                                                if s.mandatory and s.id in policy.cases})
    return policy.model_copy(update={"mandatory": tuple(mandatory)})


def _check_edit(edit: EditSpec, cycle_path: Path) -> None:
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


def load_plan(path: Path) -> tuple[Plan, str]:
    """Read plan.json and re-check every hash; IntegrityError on any difference."""
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
        body = doc["plan"]
    except (OSError, ValueError, KeyError) as exc:
        raise IntegrityError(f"{path}: unreadable plan ({exc})") from None
    if sha256_json(body) != doc.get("plan_hash"):
        raise IntegrityError(f"{path}: plan_hash does not match the plan (tampered?); "
                             "refusing to run")
    for k, v in body.items():
        if doc.get("hashes", {}).get(k) != sha256_json(v):
            raise IntegrityError(f"{path}: section {k!r} hash mismatch")
    plan = Plan.model_validate(body)
    inputs = path.parent / "inputs"
    for name, digest in plan.inputs.items():
        p = inputs / name
        if not p.is_file() or sha256_file(p) != digest:
            raise IntegrityError(f"frozen input {p} changed or missing since freeze")
    return plan, str(doc["plan_hash"])


def check_drift(plan_path: Path, expected_hash: str, plan: Plan) -> str | None:
    """None when plan and data are unchanged; otherwise the named drift."""
    try:
        _, h = load_plan(plan_path)
    except IntegrityError as exc:
        return f"plan drift: {exc}"
    if h != expected_hash:
        return "plan drift: plan_hash changed during the run"
    manifest = Manifest.model_validate(json.loads(
        (plan_path.parent / "inputs" / "manifest.json").read_text()))
    try:
        verify_stores(manifest, Path(plan.data_dir))
    except IntegrityError as exc:
        return f"data drift: {exc}"
    return None
