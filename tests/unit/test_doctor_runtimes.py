"""doctor's runtime lines: pure over the policies and the engine's runtime list."""

from __future__ import annotations

from runner.isolation.docker.doctor import runtime_checks
from runner.isolation.policy import RolePolicies, load_policies
from runner.paths import default_policies


def _with_runtime(role: str, runtime: str) -> RolePolicies:
    pols = load_policies(default_policies())
    roles = {**pols.roles, role: pols.roles[role].model_copy(update={"runtime": runtime})}
    return pols.model_copy(update={"roles": roles})


def test_runsc_missing_but_asked_for_fails_with_make_gvisor() -> None:
    [check] = runtime_checks(_with_runtime("worker", "runsc"), ("runc",))
    assert check.name == "runtime runsc" and not check.ok
    assert "worker" in check.detail and check.fix == "make gvisor"


def test_runsc_missing_and_unused_is_reported_not_failed() -> None:
    [check] = runtime_checks(load_policies(default_policies()), ("runc",))
    assert check.ok and "not available" in check.detail and "make gvisor" in check.detail


def test_runsc_present_names_its_users() -> None:
    [check] = runtime_checks(_with_runtime("analyst", "runsc"), ("runc", "runsc"))
    assert check.ok and "used by analyst" in check.detail


def test_unknown_runtime_named_with_its_own_fix() -> None:
    checks = {c.name: c for c in runtime_checks(_with_runtime("apply", "kata"), ("runc",))}
    assert not checks["runtime kata"].ok
    assert "daemon.json" in checks["runtime kata"].fix
    assert checks["runtime runsc"].ok
