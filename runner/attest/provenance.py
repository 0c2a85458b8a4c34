"""SLSA provenance v1 for a cycle's candidate: the frozen plan as the build definition.

``buildType`` ``https://cyclebox.dev/attestations/cycle/v1``:

- ``externalParameters``: what the operator chose, by digest: the cycle file, the
  comparison policy, the scenario manifest and the role policies (the copies frozen
  under ``inputs/``), plus the cycle's name;
- ``internalParameters``: what cyclebox derived: the plan hash, trials, seeds,
  concurrency;
- ``resolvedDependencies``: everything the candidate was made and judged with: the role
  images by image id, the base commit and tree, each frozen seccomp profile, the agent's
  requirement lines, the data stores, and the agent's resolved artefacts (below);
- ``runDetails``: builder ``https://cyclebox.dev/cli`` with cyclebox's version, the run
  id as ``invocationId``, start and finish (``finishedOn`` is the receipt's time;
  ``startedOn`` is it less the stage timings the receipt records, rounded down to the
  second, since no run records its start time yet), and receipt.json and plan.json as
  byproducts.

Resolved artefacts are read from ``inputs/agent-artifacts.json`` when a plan froze one
(:mod:`runner.cycle.artifacts`), each listed as a ResourceDescriptor with a package URL.
Plans today freeze only the checked requirement lines (the derived analyst image's id
covers the wheel digest); a toolchain that records its artefacts there is attested with
no change here.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import runner
from runner.attest.evaluation import RunFacts, candidate_subjects
from runner.attest.statement import ResourceDescriptor, Statement
from runner.cycle.artifacts import AGENT_ARTIFACTS, ArtifactList
from runner.cycle.plan import AGENT_REQUIREMENTS
from runner.cycle.receipt import RECEIPT
from runner.errors import ConfigError
from runner.loading import load_model

SLSA_PROVENANCE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "https://cyclebox.dev/attestations/cycle/v1"
BUILDER_ID = "https://cyclebox.dev/cli"
def _image(role: str, image_id: str) -> ResourceDescriptor:
    algo, _, hexd = image_id.partition(":")
    return ResourceDescriptor(name=f"image:{role}", digest={algo: hexd} if hexd else
                              {"sha256": image_id}, annotations={"role": role})


def _input(f: RunFacts, name: str) -> ResourceDescriptor:
    return ResourceDescriptor(name=f"inputs/{name}",
                              digest={"sha256": f.plan.plan.inputs[name]})


def _artifacts(f: RunFacts) -> list[ResourceDescriptor]:
    if AGENT_ARTIFACTS not in f.plan.plan.inputs:
        return []
    doc = load_model(f.run_dir / "inputs" / AGENT_ARTIFACTS, ArtifactList, fmt="json",
                     what="agent artefacts", fix=f"the inputs/{AGENT_ARTIFACTS} freeze wrote")
    return [ResourceDescriptor(name=a.filename, digest={"sha256": a.sha256},
                               uri=a.purl(),
                               annotations={"kind": f"{a.ecosystem}-artifact"})
            for a in doc.artifacts]


def dependencies(f: RunFacts) -> list[ResourceDescriptor]:
    plan = f.plan.plan
    deps = [_image(role, i) for role, i in sorted(plan.images.items())]
    base = {"gitTree": plan.project.base_tree}
    if f.base_commit is not None:
        base["gitCommit"] = f.base_commit
    deps.append(ResourceDescriptor(name="base", digest=base,
                                   annotations={"ref": plan.project.spec.base_ref}))
    deps += [_input(f, n) for n in sorted(plan.inputs) if n.startswith("seccomp/")]
    if AGENT_REQUIREMENTS in plan.inputs:
        deps.append(_input(f, AGENT_REQUIREMENTS))
    deps += [ResourceDescriptor(name=f"store:{sid}", digest={"sha256": s.sha256})
             for sid, s in sorted(plan.stores.items())]
    deps += _artifacts(f)
    return deps


def _times(f: RunFacts) -> tuple[str, str]:
    try:
        finished = datetime.fromisoformat(f.receipt.generated_at)
        if finished.tzinfo is None:
            raise ValueError("no time zone")
    except ValueError:
        raise ConfigError(f"generated_at {f.receipt.generated_at[:40]!r} is not an ISO time",
                          path=str(f.run_dir / RECEIPT), field="generated_at",
                          fix="attest a receipt cyclebox wrote") from None
    total = sum(v for v in f.receipt.timing.values() if v >= 0)
    bad = ConfigError(f"timing sums to {total!r} seconds before {f.receipt.generated_at[:40]!r}; "
                      "no start time follows from it", path=str(f.run_dir / RECEIPT),
                      field="timing", fix="attest a receipt cyclebox wrote")
    if not math.isfinite(total) or total > MAX_RUN_SECONDS:
        raise bad
    try:
        started = finished - timedelta(seconds=math.ceil(total))

        def z(t: datetime) -> str:
            return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")  # RFC 3339, protobuf's

        return z(started), z(finished)
    except OverflowError:
        raise ConfigError(f"generated_at {f.receipt.generated_at[:40]!r} less {total!r} "
                          "seconds is not a representable time", path=str(f.run_dir / RECEIPT),
                          field="generated_at", fix="attest a receipt cyclebox wrote") from None


MAX_RUN_SECONDS = 10 * 366 * 86400
"""Longest run a provenance statement dates (ten years)."""


def provenance_statement(f: RunFacts) -> Statement | None:
    """SLSA provenance of the candidate; None when the run made no candidate."""
    subjects = candidate_subjects(f)
    if not subjects:
        return None
    plan = f.plan.plan
    started, finished = _times(f)
    inputs = plan.inputs
    external = {"cycle": plan.name,
                "cycleFile": _input(f, "cycle.yaml").model_dump(exclude_none=True),
                "manifest": _input(f, "manifest.json").model_dump(exclude_none=True),
                "roles": _input(f, "roles.yaml").model_dump(exclude_none=True)}
    policy = next((n for n in sorted(inputs) if n.startswith("policy.")), None)
    if policy is not None:
        external["policy"] = _input(f, policy).model_dump(exclude_none=True)
    predicate = {
        "buildDefinition": {
            "buildType": BUILD_TYPE,
            "externalParameters": external,
            "internalParameters": {"planHash": f.receipt.plan_hash, "trials": plan.trials,
                                   "seeds": list(plan.seeds),
                                   "concurrency": plan.concurrency},
            "resolvedDependencies": [d.model_dump(exclude_none=True)
                                     for d in dependencies(f)],
        },
        "runDetails": {
            "builder": {"id": BUILDER_ID, "version": {"cyclebox": runner.__version__}},
            "metadata": {"invocationId": f.run_id, "startedOn": started,
                         "finishedOn": finished},
            "byproducts": [
                {"name": RECEIPT, "digest": {"sha256": f.receipt_sha256}},
                {"name": "plan.json", "digest": {"sha256": f.receipt.files["plan.json"]}}],
        },
    }
    return Statement(subject=tuple(subjects), predicateType=SLSA_PROVENANCE,
                     predicate=predicate)
