"""The one way a role container is started: role policy + gateway + spec + run.

Every caller (the cycle's stages, ``cyclebox sandbox exec``, standalone apply, training,
the doctor's probes, the test fixtures) hands the launcher the role's policy, the run id,
the command and its inputs; the launcher binds the role's gateway socket when the policy
names an upstream and a gateway is given, builds the :class:`RunSpec` under the policy
(:func:`runner.isolation.roles.role_spec`) and runs it on the :class:`Sandbox` it was given.
Nothing here knows which backend runs the container.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from runner.isolation.policy import RolePolicy
from runner.isolation.roles import fresh_output_dir, role_spec
from runner.isolation.sandbox import Mount, OutputCallback, RunRecord, RunSpec, Sandbox

STAGE_LABEL = "io.cyclebox.stage"
CASE_LABEL = "io.cyclebox.case"
TRIAL_LABEL = "io.cyclebox.trial"


class GatewayBinding(Protocol):
    """A role's bound gateway socket (:class:`runner.gateway.server.Binding`)."""

    def mount(self) -> Mount: ...


class GatewayBinder(Protocol):
    """What the launcher needs of :class:`runner.gateway.server.Gateway`."""

    def bound(self, role: str, *, stage: str, uid: int, case: str | None = None,
              trial: int | None = None) -> AbstractContextManager[GatewayBinding]: ...


def output_dir(policy: RolePolicy, path: Path) -> Path:
    """A fresh output directory made for ``policy``'s role user (never an existing one)."""
    return fresh_output_dir(path, uid=policy.uid)


def placement_labels(stage: str | None, case: str | None = None,
                     trial: int | None = None) -> dict[str, str]:
    """Container labels saying where in a run a container belongs (stage, case, trial)."""
    labels: dict[str, str] = {}
    if stage is not None:
        labels[STAGE_LABEL] = stage
    if case is not None:
        labels[CASE_LABEL] = case
        labels[TRIAL_LABEL] = str(trial)
    return labels


def build_spec(policy: RolePolicy, *, role: str, run_id: str, image: str,
               command: Sequence[str], mounts: Sequence[Mount] = (),
               output_dir: Path | None = None, output_target: str = "/out",
               env: Mapping[str, str] | None = None,
               labels: Mapping[str, str] | None = None) -> RunSpec:
    """The run spec for one role command under its policy (no gateway mount)."""
    spec = role_spec(policy, role=role, run_id=run_id, image=image, command=command,
                     mounts=mounts, output_dir=output_dir, env=dict(env or {}),
                     labels=dict(labels or {}))
    if output_target != spec.output_target:
        spec = spec.model_copy(update={"output_target": output_target})
    return spec


def launch(sandbox: Sandbox, policy: RolePolicy, *, role: str, run_id: str, image: str,
           command: Sequence[str], mounts: Sequence[Mount] = (),
           output_dir: Path | None = None, output_target: str = "/out",
           env: Mapping[str, str] | None = None, gateway: GatewayBinder | None = None,
           stage: str | None = None, case: str | None = None, trial: int | None = None,
           on_output: OutputCallback | None = None,
           cancel: threading.Event | None = None) -> RunRecord:
    """Run ``command`` in a ``role`` container under ``policy`` on ``sandbox``.

    When the policy names an upstream and ``gateway`` is given, a socket for this one
    container is bound (owned by the role's uid) for the duration of the run and mounted
    read-only; without a gateway the role has no model access at all. ``stage``, ``case``
    and ``trial`` become container labels and key the gateway's call records.
    """
    mounts = list(mounts)
    with contextlib.ExitStack() as stack:
        if policy.upstream and gateway is not None:
            binding = stack.enter_context(gateway.bound(
                role, stage=stage or role, uid=policy.uid, case=case, trial=trial))
            mounts.append(binding.mount())
        spec = build_spec(policy, role=role, run_id=run_id, image=image, command=command,
                          mounts=mounts, output_dir=output_dir, output_target=output_target,
                          env=env, labels=placement_labels(stage, case, trial))
        return sandbox.run(spec, on_output=on_output, cancel=cancel)
