"""Name -> model of every file format a project writes or reads (``cyclebox schema NAME``).

Every field of every model served here has a description (its docstring); a unit test
walks each schema and fails on a field without one.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from runner.cycle.config import CycleFile
from runner.cycle.models import ComparisonPolicy, ComparisonResult, Manifest, ProposalFile, Record
from runner.errors import ConfigError
from runner.gateway.providers import ScriptFile
from runner.isolation.policy import RolePolicies
from runner.project.contracts import Answer, WorkerReply, WorkerRequest
from runner.project.manifest_tools import ScenariosFile

SCHEMAS: dict[str, tuple[type[BaseModel], str]] = {
    "cycle": (CycleFile, "cycle.yaml: what to improve, on which cases, under which policy"),
    "scenarios": (ScenariosFile, "scenarios.yaml: hand-written cases, input to "
                                 "`cyclebox manifest build`"),
    "manifest": (Manifest, "manifest.json: the cases with every hash (built, never by hand)"),
    "policy": (ComparisonPolicy, "policy.yaml: the comparison policy, frozen before results"),
    "roles": (RolePolicies, "roles.yaml: role hardening, resources and default upstreams"),
    "script": (ScriptFile, "scripted-provider file: offline model replies by rule"),
    "answer": (Answer, "answer.json: what the agent writes to /out for each case"),
    "request": (WorkerRequest, "request.json: what the coding worker receives"),
    "reply": (WorkerReply, "the optimizer model's reply to the coding worker"),
    "proposal": (ProposalFile, "proposal.json: the worker's edit, as `cyclebox apply` reads it"),
    "record": (Record, "records.jsonl lines: one graded (case, trial) of one side"),
    "verdict": (ComparisonResult, "verdict.json: the comparison's verdict and reasons"),
}
"""Served schema name -> (model, one-line summary)."""


def names() -> list[tuple[str, str]]:
    """(name, summary) of every served schema, in listing order."""
    return [(n, summary) for n, (_, summary) in SCHEMAS.items()]


def schema(name: str) -> dict[str, Any]:
    """The JSON schema of ``name``; ConfigError listing the known names otherwise."""
    if name not in SCHEMAS:
        raise ConfigError(f"no schema named {name[:60]!r}", field="NAME",
                          fix=f"one of {', '.join(SCHEMAS)}")
    model, _ = SCHEMAS[name]
    return model.model_json_schema(by_alias=True)
