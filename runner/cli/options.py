"""Option types shared by several commands (typer ``Annotated`` aliases)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
PoliciesOpt = Annotated[Path, typer.Option("--policies", help="Role policy file.")]
OutOpt = Annotated[Path, typer.Option("--out", help="Fresh output directory (must not exist).")]

# The report files `report` and `cycle run` can write beside their terminal output.
JunitOpt = Annotated[Path | None, typer.Option(
    "--junit", help="Write JUnit XML: a suite per arm, a case per case x trial.")]
MarkdownOpt = Annotated[Path | None, typer.Option(
    "--markdown", help="Write a Markdown summary (CI step summary, PR comment).")]
HtmlOpt = Annotated[Path | None, typer.Option(
    "--html", help="Write one self-contained HTML report (no scripts, strict CSP).")]
BackendOpt = Annotated[str | None, typer.Option(
    "--backend", help="Where role containers run: docker (this machine's engine) or ray "
    "(the nodes of a Ray cluster). Default: the cycle file's `backend` when one is given "
    "(a frozen --plan's run reads no cycle file), else docker.")]
RayAddressOpt = Annotated[str | None, typer.Option(
    "--ray-address", help="Ray cluster address (HOST:PORT) for --backend ray. Default: the "
    "cycle file's ray.address when one is given, else Ray's `auto`.")]
HostBackendOpt = Annotated[str | None, typer.Option(
    "--backend", help="Which backend to check or clean: docker (this machine's engine, the "
    "default) or ray (the nodes of a Ray cluster).")]
HostRayAddressOpt = Annotated[str | None, typer.Option(
    "--ray-address", help="Ray cluster address (HOST:PORT) for --backend ray. Default: "
    "Ray's `auto`.")]
