"""``inputs/agent-artifacts.json``: the agent's resolved artefacts, as a freeze may bind them.

The place a toolchain resolver (pip wheels, npm tarballs, Debian packages) records what it
resolved for the agent, one entry per file, so that the run's SLSA provenance
(:mod:`runner.attest.provenance`) lists each as a resolved dependency with a package URL.
A freeze that writes it adds it to the plan's ``inputs`` table like every frozen input
(bound by sha256; ``load_plan`` re-checks it). Plans without it attest the checked
requirement lines and the derived image id only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from runner.isolation.sandbox import Frozen

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


class ArtifactList(Frozen):
    """The file's whole content."""

    schema_: int = Field(1, alias="schema")
    artifacts: tuple[Artifact, ...]
