"""``cyclebox images``: build and list the role images."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from rich.table import Table

from runner.cli.options import JsonOpt
from runner.cli.output import err, out
from runner.termsafe import emit_json, safe

app = typer.Typer(no_args_is_help=True, help="Build and list the role images.")


@app.command("build")
def images_build(role: Annotated[list[str] | None, typer.Option(
        "--role", help="Role to build (repeatable); all roles when omitted.")] = None,
        json_out: JsonOpt = False) -> None:
    """Build role images offline (--network none), reusing any whose inputs are unchanged."""
    from runner.isolation.docker.images import build_roles
    from runner.isolation.policy import ROLES

    roles = list(role) if role else list(ROLES)
    verbose = os.environ.get("CYCLEBOX_VERBOSE") == "1"
    with err.status("building images") as status:
        def log(line: str) -> None:
            if line.startswith(("building", "downloading", "bootstrapping")) or verbose:
                err.print(safe(line), highlight=False)
            status.update(safe(line, 100, newlines=False))
        built = build_roles(roles, log)
    _print_images(built, json_out)


@app.command("list")
def images_list(json_out: JsonOpt = False) -> None:
    """List the role images recorded in the image lock, with ids and sizes."""
    from runner.isolation.docker.images import read_lock

    _print_images(list(read_lock().values()), json_out, build_columns=False)


def _print_images(rows: list[Any], json_out: bool, *, build_columns: bool = True) -> None:
    from dataclasses import asdict

    if json_out:
        emit_json([asdict(r) for r in rows])
        return
    table = Table(title="role images")
    # Whether and how long an image was built only means something right after a build.
    cols = ("role", "tag", "id", "size") + (("built now", "seconds") if build_columns else ())
    for col in cols:
        table.add_column(col)
    for r in rows:
        row = [safe(r.role), safe(r.tag), safe(r.id[:19]), f"{r.size_bytes / 1e6:.0f} MB"]
        if build_columns:
            row += ["yes" if r.built else "no (unchanged)", f"{r.seconds:.1f}"]
        table.add_row(*row)
    out.print(table)
