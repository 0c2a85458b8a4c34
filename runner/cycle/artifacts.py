"""``inputs/agent-artifacts.json``: the agent's resolved artefacts, as a freeze may bind them.

The place a toolchain resolver (pip wheels, npm tarballs, Debian packages) records what it
resolved for the agent, one entry per file, so that the run's SLSA provenance
(:mod:`runner.attest.provenance`) lists each as a resolved dependency with a package URL.
The freeze writes it whenever it derives an analyst image (:func:`artifact_record`, from
what the derived-image builder returned) and adds it to the plan's ``inputs`` table like
every frozen input (bound by sha256; ``load_plan`` re-checks it). Plans without it (frozen
before it was written, or without project toolchains) attest the checked requirement lines
and the derived image id only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Literal
from urllib.parse import quote

from pydantic import Field

from runner.hashing import canonical_bytes
from runner.isolation.sandbox import Frozen
from runner.toolchain import ResolvedFile

AGENT_ARTIFACTS = "agent-artifacts.json"
"""The inputs/ name of the artefact list."""
PURL_TYPE = {"pypi": "pypi", "npm": "npm", "deb": "deb"}
"""Ecosystem -> package URL type (github.com/package-url/purl-spec)."""


class Artifact(Frozen):
    """One resolved file the agent's image was built from."""

    ecosystem: Literal["pypi", "npm", "deb"]
    name: str
    """Package name as its registry spells it."""
    version: str
    filename: str
    """The file as downloaded (``openai-2.8.1-py3-none-any.whl``)."""
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    def purl(self) -> str:
        """Its package URL (purl-spec: an npm scope is the namespace, its ``@`` encoded;
        Debian's namespace is the vendor)."""
        name = quote(self.name, safe="/") if self.ecosystem == "npm" else quote(self.name,
                                                                               safe="")
        ns = "debian/" if self.ecosystem == "deb" else ""
        return f"pkg:{PURL_TYPE[self.ecosystem]}/{ns}{name}@{quote(self.version, safe='')}"


class ArtifactList(Frozen):
    """The file's whole content."""

    schema_: int = Field(1, alias="schema")
    artifacts: tuple[Artifact, ...]


def artifact_record(files: Iterable[ResolvedFile]) -> bytes:
    """The file's bytes: canonical JSON, one entry per distinct file, sorted."""
    return canonical_bytes(ArtifactList(artifacts=tuple(
        Artifact.model_validate(dataclasses.asdict(f)) for f in sorted(set(files)))))
