"""Shared fixtures. Docker-marked tests fail (never skip) when the engine or images are
missing: `make test` builds both first, and a test that cannot run must not pass."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from runner.gateway.config import UpstreamPolicy, load_upstreams
from runner.isolation.policy import RolePolicies, RolePolicy, load_policies
from runner.isolation.sandbox import Mount, RunRecord
from runner.paths import default_policies, default_upstreams

RunFn = Callable[..., RunRecord]


@pytest.fixture(scope="session")
def holder_dir() -> Iterator[Path]:
    """The holder's code written as a container gets it, in a directory any uid can read
    (a test that runs the holder on the host as a role uid passes it to ``holder_argv``)."""
    import shutil
    import tempfile

    from runner.isolation.docker.hardening import write_holder_files

    base = Path(tempfile.mkdtemp(prefix="cbx-test-holder-"))
    os.chmod(base, 0o755)
    try:
        yield write_holder_files(base / "holder")
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def policies() -> RolePolicies:
    return load_policies(default_policies())


@pytest.fixture(scope="session")
def upstreams() -> dict[str, UpstreamPolicy]:
    """The offline scripted upstreams of policies/upstreams.yaml (what sandbox exec uses)."""
    return load_upstreams(default_upstreams())


@pytest.fixture(scope="session")
def backend() -> Any:
    from runner.isolation.registry import get_sandbox

    return get_sandbox("docker")


@pytest.fixture
def run_role(backend: Any, policies: RolePolicies, tmp_path: Path,
             request: pytest.FixtureRequest) -> RunFn:
    """Run a command in a role container under its policy, with per-test overrides."""
    from runner.isolation.docker.images import resolve_image
    from runner.isolation.launcher import launch, output_dir

    counter = iter(range(1000))

    def run(command: Sequence[str], *, role: str = "analyst", mounts: Sequence[Mount] = (),
            with_output: bool = True, env: dict[str, str] | None = None,
            **overrides: Any) -> RunRecord:
        policy = RolePolicy.model_validate({**policies.roles[role].model_dump(), **overrides})
        out = output_dir(policy, tmp_path / f"out{next(counter)}") if with_output else None
        rec = launch(backend, policy, role=role, run_id=f"test-{request.node.name[:40]}"
                     .replace("[", "-").replace("]", "").replace("/", "-"),
                     image=resolve_image(role), command=list(command), mounts=mounts,
                     output_dir=out, env=env)
        rec.__dict__["output_dir"] = out  # convenience for tests only
        return rec

    return run


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model made by `cyclebox model tiny` in the trainer image (once per session)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("models") / "tiny"
    cli = str(Path(sys.executable).with_name("cyclebox"))
    res = subprocess.run([cli, "model", "tiny", "--out", str(out)], capture_output=True,
                         text=True, check=False, timeout=300)
    assert res.returncode == 0, res.stderr
    return out


@pytest.fixture(scope="session")
def node_image() -> Any:
    """The node_kinds project's derived analyst image (nodejs + its one lockfile), built
    once per session and shared by every node agent kind's test
    (tests/fixtures/node_kinds.py)."""
    from tests.fixtures.node_kinds import build_node_image

    return build_node_image()
