"""An agent's toolchains beyond the analyst image (pip, apt, npm): what a project
declares, checked and resolved on the host, installed offline by one derived-image
builder (:mod:`runner.isolation.docker.agent_image`). One resolver module per
toolchain; nothing from a project runs on the host."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NpmInput:
    """``project.npm``: the lockfile and package.json read from the frozen base tree."""

    lockfile: bytes
    package_json: bytes
    source: str
    """The lockfile's path relative to the source tree (named in every refusal)."""
    ignore_scripts: tuple[str, ...] = ()
    """``project.npm_ignore_scripts``: packages installed WITHOUT their install script."""

    @property
    def pkg_source(self) -> str:
        head, _, _ = self.source.rpartition("/")
        return f"{head}/package.json" if head else "package.json"


@dataclass(frozen=True)
class AgentToolchains:
    """Everything a project adds to the analyst image (all optional)."""

    requirements: str | None = None
    """Checked pip requirement lines (``project.requirements``)."""
    apt: tuple[str, ...] = ()
    """Checked Debian package names (``project.apt``), sorted."""
    npm: NpmInput | None = None
    cycle_file: str = "cycle.yaml"
    """The cycle file that declared them (named in refusals)."""

    def empty(self) -> bool:
        return self.requirements is None and not self.apt and self.npm is None


@dataclass(frozen=True, order=True)
class ResolvedFile:
    """One artefact file a derived image was built from (a wheel, an npm tarball, a .deb);
    the plan freezes the list as ``inputs/agent-artifacts.json``."""

    ecosystem: str
    """pypi, npm or deb."""
    name: str
    version: str
    filename: str
    sha256: str
    """Of the file's bytes as resolved and checked on the host."""


@dataclass(frozen=True)
class DerivedAnalyst:
    """What the builder made: the image id the plan freezes and what it installed."""

    id: str
    installed: dict[str, object] = field(default_factory=dict)
    """Per toolchain, the versions installed (apt ``name=version``, npm ``name@version``,
    the pip lines), frozen into the plan's inputs as ``agent-toolchains.json``."""
    artifacts: tuple[ResolvedFile, ...] = ()
    """Every file it was built from, sorted (``agent-artifacts.json``)."""

    def record(self) -> str:
        return json.dumps({"schema": 1, "image": self.id, **self.installed}, indent=2,
                          sort_keys=True) + "\n"


__all__ = ["AgentToolchains", "DerivedAnalyst", "NpmInput", "ResolvedFile"]
