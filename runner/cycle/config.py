"""The cycle file (``cycle.yaml``): what to improve, on which scenarios, under which policy.

Relative paths resolve against the cycle file's directory. Errors name the file, the
field and the fix. ``cyclebox schema cycle`` prints the JSON schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from runner.errors import ConfigError
from runner.gateway.budget import BudgetPolicy
from runner.gateway.config import UpstreamPolicy
from runner.isolation.sandbox import Frozen, warm_refusal
from runner.loading import checked_path, load_model, relative_inside, resolve_under, show


class ProjectSpec(Frozen):
    repo: str
    """Git repository holding the agent (read only; never written)."""
    base_ref: str = "HEAD"
    """Branch, tag or commit whose tree is the baseline."""
    subdir: str | None = None
    """Directory inside the repository that is the agent's source tree."""
    entry: tuple[str, ...] = Field(min_length=1)
    """Command run in the analyst container; the source tree is mounted at /src."""
    requirements: str | None = None
    """The agent's own pip requirements: a file in the source tree (relative to subdir),
    read from the frozen base tree. The analyst then runs in an image derived from the
    analyst image with these packages (docs/agent-dependencies.md)."""
    # absent toolchains are left out of the frozen spec, so a plan without them hashes as
    # it did before they existed (receipt compare across versions stays equal)
    apt: tuple[str, ...] = Field(default=(), exclude_if=lambda v: not v)
    """Debian bookworm packages the agent needs (e.g. ``nodejs``, optionally
    ``name=version``): resolved and downloaded on the host with apt, installed offline
    into the derived analyst image, their versions recorded."""
    npm: str | None = Field(default=None, exclude_if=lambda v: v is None)
    """A committed ``package-lock.json`` (v2/v3; package.json beside it) relative to
    subdir, read from the frozen base tree: its registry tarballs are fetched on the host,
    checked against their integrity and laid out at ``/node_modules``; no install script
    runs anywhere."""
    npm_ignore_scripts: tuple[str, ...] = Field(default=(), exclude_if=lambda v: not v)
    """Packages of the lockfile that declare an install script (``hasInstallScript``) and
    are to be installed WITHOUT it; any other such package is refused."""
    warm: tuple[str, ...] = Field(default=(), exclude_if=lambda v: not v)
    """A warm start: modules (e.g. ``openai``) the agent's interpreter imports while its
    container is prepared ahead of the case, so the case starts with them loaded. The
    entry must be ``[python, SCRIPT, ...]`` or ``[python, -m, MODULE, ...]``; model calls
    before the hand-over are refused. Absent: the entry starts when the case does."""

    @field_validator("warm")
    @classmethod
    def _warm_fits(cls, warm: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        why = warm_refusal(info.data.get("entry") or (), warm)
        if why is not None:
            raise ValueError(f"{why}; or remove project.warm")
        return warm


class EditSpec(Frozen):
    allowlist: tuple[str, ...] = Field(min_length=1)
    """Globs (relative to the source tree) an edit may ever touch."""
    paths: tuple[str, ...] = Field(min_length=1)
    """This invocation's exact path set; each must match the allowlist."""
    max_file_bytes: int = Field(default=256 * 1024, gt=0)
    """Largest file (bytes) an edit may write; a larger one is refused by name."""


class BriefSpec(Frozen):
    mode: Literal["generate", "file"] = "generate"
    """generate: from development-split failures of the baseline; file: a fixed brief."""
    file: str | None = None
    """mode file: the Markdown brief handed to the worker (relative to the cycle file)."""


class JudgeSpec(Frozen):
    model: str
    """Judge model; must be in the judge upstream's ``models`` allowlist."""
    threshold: float = Field(ge=0, le=1)
    """A judge score at or above this passes the case's judge criterion."""
    required: bool = True
    """A required judge that fails makes the comparison invalid (frozen into the plan's
    policy as ``require_judge: true``). With false, a judge failure is no verdict: it
    never counts as a pass (a case the baseline's judge passed regresses, a mandatory
    case fails, no improvement is claimed from it)."""


class WorkerSpec(Frozen):
    model: str
    """Optimizer model the coding worker calls; must be in the optimizer upstream's
    ``models`` allowlist."""
    max_tokens: int = Field(default=4096, gt=0)
    """Cap on the worker's reply (max_tokens of its one model call)."""


class DreamSpec(Frozen):
    mode: Literal["off", "template", "model"] = "off"
    """off: no variants; template: three fixed wrappers; model: optimizer paraphrases."""
    factor: int = Field(default=1, ge=1, le=8)
    """Variants per development task."""
    intent_key: str = "question"
    """The case-input field holding the task's intent (what gets paraphrased)."""


class RaySpec(Frozen):
    """Where the ray backend finds its cluster."""

    address: str | None = None
    """The cluster's head (``HOST:PORT``); omitted: Ray's ``auto`` (the cluster this
    machine belongs to). ``--ray-address`` overrides it."""

    @field_validator("address")
    @classmethod
    def _address_form(cls, v: str | None) -> str | None:
        from runner.isolation.ray.address import ADDRESS_FIX, address_problem

        why = address_problem(v) if v is not None else None
        if why is not None:
            raise ValueError(f"{why}; expected: {ADDRESS_FIX.removeprefix('give ')}")
        return v


class CycleFile(Frozen):
    """A cycle: project, scenarios, policy, roles, budget, edit rules, trials."""

    schema_: int = Field(alias="schema")
    """File format version; this code reads version 1."""
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,40}$")
    """Cycle name: part of the run id and of every container's name."""
    project: ProjectSpec
    """The agent under improvement: repository, base ref, source subdirectory, entry."""
    scenarios: str
    """Scenario manifest (JSON)."""
    data_dir: str
    """Directory the manifest's store paths are relative to; mounted read-only at /data."""
    policy: str
    """Comparison policy file (YAML or JSON)."""
    roles: str | None = None
    """Role policy file: hardening and resources per role, and which upstream each role
    may reach; it defines no upstream. Omitted: the role policies shipped with cyclebox
    (policies/roles.yaml), so a project carries no copy."""
    upstreams: dict[str, UpstreamPolicy] = Field(default_factory=dict)
    """The model upstreams, defined here only: target (the analyst's model), optimizer
    (the worker's) and judge (the evaluator's, used only when ``judge`` is set). Only the
    upstreams a role of this cycle uses are frozen and have their credentials read."""
    budget: BudgetPolicy = BudgetPolicy()
    """Spending limits over every model call of the run (USD and call counts)."""
    edit: EditSpec
    """Which files of the source tree the worker may change."""
    brief: BriefSpec = BriefSpec()
    """Where the worker's failure brief comes from."""
    worker: WorkerSpec
    """The coding worker's model and reply cap."""
    judge: JudgeSpec | None = None
    """Optional model judge in the evaluator; none: deterministic scoring only."""
    dream: DreamSpec = DreamSpec()
    """Dream variants of development tasks (off by default)."""
    trials: int = Field(default=1, ge=1, le=100)
    """Runs of every case per side; must equal the comparison policy's trials."""
    seeds: tuple[int, ...] = ()
    """Per-trial seeds, recorded in the plan; defaults to 0..trials-1."""
    concurrency: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = 2
    """Analyst containers run at once; ``auto``: start from the cores and the free memory
    and follow the host's CPU and memory headroom (the values chosen are recorded in the
    receipt's timing). Either way the next cases' containers are prepared ahead, within
    memory. Not part of the outcome."""
    backend: Literal["docker", "ray"] = "docker"
    """Where role containers run: ``docker``, this machine's engine; ``ray``, the nodes of
    a Ray cluster (each advertising the ``cyclebox`` resource, with Docker and the role
    images; credentials stay here, see docs/ray.md). ``--backend`` overrides it. Not part
    of the outcome: the same plan reaches the same verdict on either."""
    ray: RaySpec | None = None
    """Ray cluster settings, read only with ``backend: ray``."""

    @field_validator("concurrency", mode="before")
    @classmethod
    def _concurrency(cls, v: object) -> object:
        # one message naming both forms, not pydantic's one per union member
        if v == "auto" or (type(v) is int and 1 <= v <= 64):
            return v
        raise ValueError(f"must be a whole number from 1 to 64 or auto, not {v!r}")

    @model_validator(mode="after")
    def _seeds(self) -> CycleFile:
        if self.seeds and len(self.seeds) != self.trials:
            raise ValueError(f"seeds has {len(self.seeds)} entries for {self.trials} trials")
        return self


CYCLE_FIX = "`cyclebox schema cycle` lists the accepted keys"


def load_cycle(path: Path) -> tuple[CycleFile, Path]:
    """(cycle, its directory) from a YAML file; ConfigError naming file and field."""
    cycle = load_model(path, CycleFile, fmt="yaml", what="cycle file", schema=1,
                       fix=CYCLE_FIX)
    return cycle, path.resolve().parent


def resolve(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def roles_file(cycle: CycleFile, base: Path) -> Path:
    """The cycle's role policy file: its ``roles``, or the shipped policies/roles.yaml."""
    from runner.paths import default_policies

    return default_policies() if cycle.roles is None else resolve(base, cycle.roles)


@dataclass(frozen=True)
class CycleInputs:
    """Every path a cycle file names, resolved and checked to exist where it may."""

    manifest: Path
    data_dir: Path
    policy: Path
    roles: Path
    repo: Path
    brief: Path | None


def check_inputs(cycle: CycleFile, path: Path, base: Path) -> CycleInputs:
    """Resolve and check every file and directory the cycle names (no git, no writing)."""
    from runner.isolation.policy import mount_violation

    where = show(str(path))

    def file_at(field: str, value: str, fix: str) -> Path:
        p = resolve_under(base, value, path=where, field=field, fix=fix)
        return checked_path(p, kind="file", path=where, field=field, fix=fix)

    def dir_at(field: str, value: str, fix: str) -> Path:
        p = resolve_under(base, value, path=where, field=field, fix=fix)
        return checked_path(p, kind="dir", path=where, field=field, fix=fix)

    manifest = file_at("scenarios", cycle.scenarios, "point scenarios at the scenario "
                       "manifest (JSON), relative to the cycle file")
    policy = file_at("policy", cycle.policy, "point policy at the comparison policy "
                     "(*.yaml, *.yml or *.json)")
    roles = (file_at("roles", cycle.roles, "point roles at a role policy file, or omit "
                     "roles to use the shipped policies/roles.yaml")
             if cycle.roles is not None else roles_file(cycle, base))
    data_dir = dir_at("data_dir", cycle.data_dir,
                      "point data_dir at the directory holding the data stores")
    why = mount_violation(str(data_dir), read_only=True)
    if why:
        raise ConfigError(f"{why}; it would be mounted into the analyst at /data",
                          path=where, field="data_dir",
                          fix="use a directory holding only the data stores")
    repo = dir_at("project.repo", cycle.project.repo, "point project.repo at a git repository "
                        f"({GIT_INIT})")
    brief = None
    if cycle.brief.mode == "file":
        if not cycle.brief.file:
            raise ConfigError("brief.mode file needs brief.file", path=where,
                              field="brief.file", fix="name a Markdown brief file")
        brief = file_at("brief.file", cycle.brief.file, "name an existing brief file")
    for name, up in sorted(cycle.upstreams.items()):
        if up.script:
            file_at(f"upstreams.{name}.script", up.script, "name a scripted-provider YAML "
                    "file, relative to the cycle file")
        if up.replay_from:
            file_at(f"upstreams.{name}.replay_from", str(Path(up.replay_from) / "gateway" /
                    "calls.jsonl"), "point at a finished run directory")
    _refuse_frozen_inputs_in_data(data_dir, where, [
        ("scenarios", manifest), ("policy", policy), ("roles", roles),
        *([("brief.file", brief)] if brief is not None else []),
        *[(f"upstreams.{n}.script", resolve(base, up.script))
          for n, up in sorted(cycle.upstreams.items()) if up.script],
        *[(f"upstreams.{n}.replay_from", resolve(base, up.replay_from))
          for n, up in sorted(cycle.upstreams.items()) if up.replay_from]])
    return CycleInputs(manifest=manifest, data_dir=data_dir, policy=policy, roles=roles,
                       repo=repo, brief=brief)


DATA_DIR_FIX = ("keep data_dir a directory of the data stores alone: the scenario manifest "
                "(its references), the policies, the scripts and every run directory "
                "outside it")


def _refuse_frozen_inputs_in_data(data_dir: Path, where: str,
                                  named: list[tuple[str, Path]]) -> None:
    """The whole of ``data_dir`` is mounted into the agent under test at /data: a frozen
    input inside it (the manifest holds the held-out references) would be read by the
    agent it grades."""
    from runner.outdir import within

    for field, p in named:
        if within(p, data_dir):
            raise ConfigError(f"{field} ({show(str(p))}) is inside data_dir "
                              f"({show(str(data_dir))}), which the agent under test reads "
                              "at /data", path=where, field=field, fix=DATA_DIR_FIX)


def refuse_out_in_data(out: Path, data_dir: Path, *, path: str | None,
                       field: str = "--out") -> None:
    """A run directory inside ``data_dir`` is mounted into its own agent at /data, with the
    frozen manifest (the references) in it: refused."""
    from runner.outdir import within

    if within(out, data_dir):
        raise ConfigError(f"{show(str(out))} is inside data_dir ({show(str(data_dir))}), "
                          "which the agent under test reads at /data: it would read the "
                          "run's frozen manifest, references included", path=path,
                          field=field, fix="put the run directory outside data_dir")


GIT_INIT = "git init && git add -A && git commit -m init"
"""The fix for a project that is not yet a git repository (run in the project directory)."""


def check_repo(repo: Path, ref: str, subdir: str | None, *, path: str | None,
               fields: tuple[str, str, str] = ("project.repo", "project.base_ref",
                                               "project.subdir")) -> str:
    """The base tree id; ConfigError naming the field and the fix on any git problem."""
    from runner import gitops

    f_repo, f_ref, f_subdir = fields
    try:
        usable = repo.is_dir()
    except (OSError, ValueError):
        usable = False
    if not usable:
        raise ConfigError(f"{show(str(repo))} does not exist or is not a directory", path=path,
                          field=f_repo, fix=f"point at a git repository ({GIT_INIT})")
    if not ref or ref.startswith("-") or not ref.isprintable() or any(c.isspace() for c in ref):
        raise ConfigError(f"{show(ref)} is not a git ref", path=path, field=f_ref,
                          fix="use a branch, tag or commit id")
    if subdir is not None:
        relative_inside(subdir.rstrip("/") or ".", path=path or "", field=f_subdir,
                        fix="a directory inside the repository, relative to its root")

    try:
        gitops.git_dir_of(repo)
        top = gitops.toplevel(repo)
    except (ConfigError, OSError):
        raise ConfigError(f"{show(str(repo))} is not a git repository", path=path,
                          field=f_repo, fix=f"cd {show(str(repo))} && {GIT_INIT}") from None
    if top is not None and top.resolve() != repo.resolve():
        # git would answer for the enclosing repository: its root tree, not this directory.
        rel = repo.resolve().relative_to(top.resolve()).as_posix()
        inner = f"{rel}/{subdir.strip('/')}" if subdir else rel
        raise ConfigError(f"{show(str(repo))} is not the root of a git repository; it lies "
                          f"inside {show(str(top))}", path=path, field=f_repo,
                          fix=f"point at the repository root and the directory inside it "
                          f"(repo: {show(str(top))}, subdir: {show(inner)}), or make it its "
                          f"own repository: cd {show(str(repo))} && {GIT_INIT}")
    try:
        gitops.resolve_tree(repo, "HEAD")
    except (ConfigError, OSError):
        if ref == "HEAD":
            raise ConfigError(f"{show(str(repo))} has no commit yet (HEAD does not resolve)",
                              path=path, field=f_ref,
                              fix=f"cd {show(str(repo))} && git add -A && git commit -m init"
                              ) from None
    try:
        gitops.resolve_tree(repo, ref)
    except (ConfigError, OSError):
        raise ConfigError(f"ref {show(ref)} does not resolve to a commit in "
                          f"{show(str(repo))}", path=path, field=f_ref,
                          fix="use a branch, tag or commit id that exists "
                          "(git -C REPO log --oneline)") from None
    try:
        return gitops.resolve_tree(repo, ref, subdir)
    except (ConfigError, OSError):
        raise ConfigError(f"{show(str(subdir))} is not a directory in {show(ref)} of "
                          f"{show(str(repo))}", path=path, field=f_subdir,
                          fix="a directory committed in the repository at base_ref") from None


_STATUS = {"?": "untracked", "M": "modified", "A": "added", "D": "deleted", "R": "renamed",
           "C": "copied", "T": "type changed", "U": "unmerged"}


def uncommitted_warning(repo: Path, ref: str, subdir: str | None, *,
                        path: str | None, field: str = "project.repo",
                        limit: int = 5) -> str | None:
    """A warning naming the uncommitted changes under the project's directory, which the
    run leaves out (it exports the committed tree of ``ref``); None when there are none."""
    from runner import gitops

    try:
        rows = gitops.uncommitted(repo, subdir)
    except (ConfigError, OSError):
        return None  # a repository git cannot read was refused by check_repo already
    if not rows:
        return None
    shown = ", ".join(f"{show(p, 80)} ({_STATUS.get(st[:1], st)})" for st, p in rows[:limit])
    more = f" and {len(rows) - limit} more" if len(rows) > limit else ""
    where = f"{show(subdir)} in {show(str(repo))}" if subdir else show(str(repo))
    head = ": ".join(x for x in (path, field) if x)
    return (f"{head}: {len(rows)} uncommitted change(s) under {where} are not part of the "
            f"run, which uses the committed tree of {show(ref)}: {shown}{more}. To include "
            "them: git add -A && git commit")
