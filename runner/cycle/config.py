"""The cycle file (``cycle.yaml``): what to improve, on which scenarios, under which policy.

Relative paths resolve against the cycle file's directory. Errors name the file, the
field and the fix. ``cyclebox cycle schema`` prints the JSON schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from runner.errors import ConfigError
from runner.gateway.budget import BudgetPolicy
from runner.gateway.config import UpstreamPolicy
from runner.sandbox import Frozen


class ProjectSpec(Frozen):
    repo: str
    """Git repository holding the agent (read only; never written)."""
    base_ref: str = "HEAD"
    """Branch, tag or commit whose tree is the baseline."""
    subdir: str | None = None
    """Directory inside the repository that is the agent's source tree."""
    entry: tuple[str, ...]
    """Command run in the analyst container; the source tree is mounted at /src."""


class EditSpec(Frozen):
    allowlist: tuple[str, ...] = Field(min_length=1)
    """Globs (relative to the source tree) an edit may ever touch."""
    paths: tuple[str, ...] = Field(min_length=1)
    """This invocation's exact path set; each must match the allowlist."""
    max_file_bytes: int = Field(default=256 * 1024, gt=0)


class BriefSpec(Frozen):
    mode: Literal["generate", "file"] = "generate"
    """generate: from development-split failures of the baseline; file: a fixed brief."""
    file: str | None = None


class JudgeSpec(Frozen):
    model: str
    threshold: float = Field(ge=0, le=1)
    required: bool = True
    """A required judge that fails makes the comparison invalid."""


class WorkerSpec(Frozen):
    model: str
    max_tokens: int = Field(default=4096, gt=0)


class DreamSpec(Frozen):
    mode: Literal["off", "template", "model"] = "off"
    """off: no variants; template: three fixed wrappers; model: optimizer paraphrases."""
    factor: int = Field(default=1, ge=1, le=8)
    """Variants per development task."""
    intent_key: str = "question"
    """The case-input field holding the task's intent (what gets paraphrased)."""


class CycleFile(Frozen):
    """A cycle: project, scenarios, policy, roles, budget, edit rules, trials."""

    schema_: int = Field(alias="schema")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,40}$")
    project: ProjectSpec
    scenarios: str
    """Scenario manifest (JSON)."""
    data_dir: str
    """Directory the manifest's store paths are relative to; mounted read-only at /data."""
    policy: str
    """Comparison policy file (YAML or JSON)."""
    roles: str
    """Role policy file (hardening, resources, upstreams)."""
    upstreams: dict[str, UpstreamPolicy] = Field(default_factory=dict)
    """Overrides for the role file's upstreams (e.g. offline scripts for a demo)."""
    budget: BudgetPolicy = BudgetPolicy()
    edit: EditSpec
    brief: BriefSpec = BriefSpec()
    worker: WorkerSpec
    judge: JudgeSpec | None = None
    dream: DreamSpec = DreamSpec()
    trials: int = Field(default=1, ge=1, le=100)
    seeds: tuple[int, ...] = ()
    """Per-trial seeds, recorded in the plan; defaults to 0..trials-1."""
    concurrency: int = Field(default=2, ge=1, le=64)

    @model_validator(mode="after")
    def _seeds(self) -> CycleFile:
        if self.seeds and len(self.seeds) != self.trials:
            raise ValueError(f"seeds has {len(self.seeds)} entries for {self.trials} trials")
        return self


def load_cycle(path: Path) -> tuple[CycleFile, Path]:
    """(cycle, its directory) from a YAML file; ConfigError naming file and field."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", path=str(path),
                          fix="pass an existing cycle.yaml") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", path=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError("expected a mapping", path=str(path))
    if data.get("schema") != 1:
        raise ConfigError(f"schema must be 1, got {data.get('schema')!r}", path=str(path),
                          field="schema", fix="set schema: 1")
    try:
        cycle = CycleFile.model_validate(data)
    except ValidationError as exc:
        e = exc.errors()[0]
        raise ConfigError(e["msg"], path=str(path), field=".".join(str(x) for x in e["loc"]),
                          fix="see `cyclebox cycle schema` for the accepted keys") from None
    return cycle, path.resolve().parent


def resolve(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p).resolve()
