"""``cyclebox doctor``: check the machine before any work."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from runner.cli.options import HostBackendOpt, HostRayAddressOpt, JsonOpt, PoliciesOpt
from runner.cli.output import out
from runner.errors import EXIT_PREREQUISITE
from runner.paths import default_policies
from runner.termsafe import emit_json, safe

commands = typer.Typer()


@commands.command()
def doctor(policies: PoliciesOpt = default_policies(), json_out: JsonOpt = False,
           probe: Annotated[bool, typer.Option(help="Run a probe container to check that "
                                                    "limits are enforced.")] = True,
           backend: HostBackendOpt = None, ray_address: HostRayAddressOpt = None) -> None:
    """Check the engine, its limits, the role images and free disk; exit non-zero with the fix.

    With --backend ray: the cluster's nodes advertising the cyclebox resource, and on
    each node its engine, images, disk, probe container, relay socket path and the
    head's relay port."""
    from runner.cli.engine import choose_backend, sandbox
    from runner.isolation.registry import get_sandbox

    choose_backend(backend, ray_address=ray_address)  # validates the pair
    if backend == "ray":
        from runner.isolation.ray.backend import RaySandbox
        from runner.isolation.ray.doctor import run_checks as ray_checks

        def cluster() -> RaySandbox:
            rs = sandbox()
            assert isinstance(rs, RaySandbox)  # noqa: S101 - chosen just above
            return rs

        checks = ray_checks(policies, sandbox=cluster, probe=probe)
    else:
        from runner.isolation.docker.doctor import run_checks

        checks = run_checks(policies, sandbox=lambda: get_sandbox(timeout=10), probe=probe)
    if json_out:
        emit_json([c.as_dict() for c in checks])
    else:
        table = Table(title="cyclebox doctor", show_lines=False)
        for col in ("check", "status", "detail"):
            table.add_column(col, overflow="fold")
        for c in checks:
            status = "[green]ok[/]" if c.ok else "[red]FAIL[/]"
            detail = safe(c.detail) + (f"\n[yellow]fix:[/] {safe(c.fix)}"
                                       if (not c.ok and c.fix) else "")
            table.add_row(safe(c.name), status, detail)
        out.print(table)
    if not all(c.ok for c in checks):
        raise typer.Exit(EXIT_PREREQUISITE)
