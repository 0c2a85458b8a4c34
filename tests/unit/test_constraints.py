"""constraints/*.txt pin every distribution each make-built env installs (make lock), so a
release on PyPI the day CI runs changes nothing there."""

from __future__ import annotations

import re
import sys
import sysconfig
from importlib import metadata

import pytest

from runner.isolation.docker.images import pypi_name as canonical
from runner.paths import PROJECT_ROOT

CONSTRAINTS = PROJECT_ROOT / "constraints"
ENVS = ("host", "verl", "mock", "attest")
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][^\s;#+]*)$")
NOT_PINNED = {"pip", "setuptools", "wheel", "cyclebox"}
"""The venv's own tools (pip is pinned in the Makefile) and the project itself (editable)."""


def pins(env: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for n, line in enumerate((CONSTRAINTS / f"{env}.txt").read_text().splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        m = PIN.match(line)
        assert m, f"constraints/{env}.txt line {n}: {line!r} is not name==version"
        name = canonical(m.group(1))
        assert name not in out, f"constraints/{env}.txt line {n}: {name} pinned twice"
        out[name] = m.group(2)
    return out


@pytest.mark.parametrize("env", ENVS)
def test_every_line_pins_one_exact_version(env: str) -> None:
    assert len(pins(env)) >= 10


@pytest.mark.parametrize("env", ENVS)
def test_the_makefile_installs_every_env_with_its_constraints(env: str) -> None:
    make = (PROJECT_ROOT / "Makefile").read_text()
    assert f"-c constraints/{env}.txt" in make
    assert "--upgrade pip" not in make  # pip itself pinned: its resolver and output vary


def test_make_lock_installs_each_env_as_its_make_target_does() -> None:
    """constraints/refresh.py repeats each env's install lines (without -c): they agree."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("refresh", CONSTRAINTS / "refresh.py")
    assert spec is not None and spec.loader is not None
    refresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(refresh)
    make = (PROJECT_ROOT / "Makefile").read_text()
    assert set(refresh.INSTALLS) == set(ENVS)
    for env, (_, installs) in refresh.INSTALLS.items():
        for args in installs:
            line = " ".join(a if a != ".[dev]" else "'.[dev]'" for a in args)
            assert line in make, f"{env}: {line!r} is not how the Makefile installs it"


def test_verl_env_pins_agree_with_its_constraints() -> None:
    locked = pins("verl")
    for line in (PROJECT_ROOT / "tests" / "verl-env.txt").read_text().splitlines():
        m = PIN.match(line.strip())
        if m:
            assert locked.get(canonical(m.group(1))) == m.group(2), line


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="not in a virtualenv")
def test_every_distribution_of_this_venv_is_pinned_at_its_version() -> None:
    """Fails when a dependency is added (pyproject) or moved without `make lock`."""
    locked = pins("host")
    loose = []
    # the venv's own site-packages only: ``import ray`` puts the copies it vendors
    # (ray/thirdparty_files: psutil, colorama) on sys.path, pinned by ray's own version
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    for dist in metadata.distributions(path=site):
        name = canonical(dist.metadata["Name"])
        if name in NOT_PINNED:
            continue
        if locked.get(name) != dist.version:
            loose.append(f"{name}=={dist.version} (constraints/host.txt: "
                         f"{locked.get(name, 'absent')})")
    assert not loose, ("a new or moved dependency: run make lock, then make test; a venv "
                       f"older than the lock: rm -rf .venv && make setup. {sorted(loose)}")
