"""Isolation backends by name: the CLI picks one, everything else receives a Sandbox.

A backend registers a factory under a name; importing this module imports no backend
(Docker's client is loaded only when ``docker`` is asked for), so pure code such as
receipts never pays for it. Compare inspect_ai's ``sandboxenv`` registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runner.errors import ConfigError
from runner.isolation.sandbox import Sandbox

Factory = Callable[..., Sandbox]

_FACTORIES: dict[str, Factory] = {}


def register(name: str, factory: Factory) -> None:
    """Make ``factory(**options)`` the backend called ``name``."""
    _FACTORIES[name] = factory


def _docker(**options: Any) -> Sandbox:
    from runner.isolation.docker.backend import DockerSandbox

    return DockerSandbox(**options)


register("docker", _docker)


def _ray(**options: Any) -> Sandbox:
    from runner.isolation.ray.backend import open_ray

    return open_ray(**options)


register("ray", _ray)

DEFAULT_BACKEND = "docker"


def names() -> list[str]:
    return sorted(_FACTORIES)


def get_sandbox(name: str = DEFAULT_BACKEND, **options: Any) -> Sandbox:
    """The backend called ``name``; an unknown name is bad input naming the known ones."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ConfigError(f"unknown sandbox backend {name!r}",
                          fix=f"use one of: {', '.join(names())}") from None
    return factory(**options)
