"""What the command line picks for everything else: the isolation backend and the role
images it runs.

The CLI is where a backend is chosen (``runner.isolation.registry``) and where image ids
are read from the image lock; the cycle and training receive a ``Sandbox`` and image ids
and never import the Docker backend.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from runner.errors import ConfigError, PrerequisiteError
from runner.isolation.sandbox import Sandbox

if TYPE_CHECKING:
    from runner.toolchain import AgentToolchains, DerivedAnalyst
    from runner.train.host import Trainer

_choice: dict[str, Any] = {"name": "docker", "options": {}}


def choose_backend(name: str | None = None, *, ray_address: str | None = None) -> None:
    """Pick the backend :func:`sandbox` opens (before it is first opened): ``name``
    (default docker) and, for ``ray``, the cluster address (default: Ray's ``auto``)."""
    from runner.isolation.registry import DEFAULT_BACKEND, names

    name = name or DEFAULT_BACKEND
    if name not in names():
        raise ConfigError(f"unknown backend {name!r}", field="--backend",
                          fix=f"use one of: {', '.join(names())}")
    if ray_address and name != "ray":
        raise ConfigError("--ray-address is only for the ray backend", field="--ray-address",
                          fix="add --backend ray, or drop --ray-address")
    if name == "ray" and ray_address is not None:
        from runner.isolation.ray.address import ADDRESS_FIX, address_problem

        why = address_problem(ray_address)
        if why is not None:  # bad input (3), not a cluster that was not found (5)
            raise ConfigError(why, field="--ray-address", fix=ADDRESS_FIX)
    if sandbox.cache_info().currsize:
        raise ConfigError("the backend was chosen after it was opened", field="--backend",
                          fix="report this as a bug")
    _choice["name"] = name
    _choice["options"] = {"address": ray_address} if name == "ray" else {}


def reset() -> None:
    """Forget the backend choice and the opened backend: each command invocation chooses
    its own (``main`` calls this first, so several invocations in one process, as in the
    tests, do not share one)."""
    sandbox.cache_clear()
    _choice["name"], _choice["options"] = "docker", {}


@functools.cache
def sandbox() -> Sandbox:
    """The isolation backend commands run their containers in (docker unless
    :func:`choose_backend` said otherwise); opened once per process, when first needed
    (so bad input is reported before an engine is asked)."""
    from runner.isolation.registry import get_sandbox

    return get_sandbox(str(_choice["name"]), **dict(_choice["options"]))


def exit_if_stranded(code: int) -> None:
    """End the process with ``code`` now, past the interpreter's own shutdown, when the
    opened backend lost what it runs on (the Ray head: Ray's shutdown waits on it, and
    its core worker crashes the interpreter's teardown with SIGSEGV). Everything was
    written by then; the other exit handlers run first."""
    if not sandbox.cache_info().currsize:
        return
    lost = getattr(sandbox(), "head_lost", None)
    if not callable(lost) or not lost():
        return
    import atexit
    import os

    atexit._run_exitfuncs()  # the backend took Ray's own shutdown off the list
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(int(code or 0))


def role_image(role: str) -> str:
    """Image id of ``role`` from the image lock (PrerequisiteError naming the fix if absent)."""
    from runner.isolation.docker.images import resolve_image

    return resolve_image(role)


def cycle_images(*, check_engine: bool = False) -> dict[str, str]:
    """Image id per cycle role from the image lock; with ``check_engine``, each must also
    exist in the backend (PrerequisiteError naming the fix)."""
    from runner.cycle.plan import CYCLE_ROLES

    ids = {r: role_image(r) for r in CYCLE_ROLES}
    if check_engine:
        backend = sandbox()
        gone = [r for r, i in ids.items() if backend.image_id(i) is None]
        if gone:
            raise PrerequisiteError(f"images for {gone} are in the lock file but not in the "
                                    "engine. Fix: cyclebox images build")
    return ids


def derive_analyst(analyst_id: str, toolchains: AgentToolchains, *,
                   log: Callable[[str], None]) -> DerivedAnalyst:
    """The analyst image extended with a project's checked toolchains (pip, apt, npm),
    built offline on first use (``log`` hears the steps) and reused while unchanged."""
    from runner.isolation.docker.agent_image import ensure_agent_image

    return ensure_agent_image(analyst_id, toolchains, log).derived()


def trainer() -> Trainer:
    """The trainer role under the shipped policy, with its image, on the default sandbox."""
    from runner.isolation.policy import load_policies
    from runner.paths import default_policies
    from runner.train.host import Trainer

    policy = load_policies(default_policies()).roles["trainer"]
    return Trainer(sandbox=sandbox(), policy=policy, image=role_image("trainer"))
