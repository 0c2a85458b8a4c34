"""``cyclebox images``: build and list the role images; list and remove derived ones."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from rich.table import Table

from runner.cli.options import JsonOpt
from runner.cli.output import err, out, report_warning
from runner.termsafe import emit_json, safe

app = typer.Typer(no_args_is_help=True, help="Build and list the role images; list and "
                  "remove unused derived analyst images.")


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
    """List the role images recorded in the image lock, then the derived analyst images
    (a project's own pip, apt and npm packages, `cyclebox/analyst-deps:*`) in the engine, with ids,
    sizes and the containers using them."""
    from dataclasses import asdict

    from runner.errors import PrerequisiteError
    from runner.isolation.docker.images import read_lock

    roles = list(read_lock().values())
    try:
        from runner.isolation.docker.agent_image import derived_images

        derived = derived_images()
    except PrerequisiteError as exc:  # the lock alone still answers
        report_warning(f"derived analyst images not listed: {exc}")
        derived = []
    if json_out:
        emit_json([{**asdict(r), "derived_from": None} for r in roles]
                  + [{"role": "analyst", **asdict(d)} for d in derived])
        return
    _print_images(roles, json_out, build_columns=False)
    if derived:
        table = Table(title="derived analyst images (project.requirements, apt, npm)")
        for col in ("tag", "id", "size", "adds", "from analyst", "used by"):
            table.add_column(col)
        for d in derived:
            mark = "" if d.cyclebox else " (not cyclebox's: built FROM a derived image)"
            table.add_row(safe(d.tag) + mark, safe(d.id[:19]), f"{d.size_bytes / 1e6:.0f} MB",
                          safe(d.toolchains), safe(d.derived_from[:19]),
                          safe(", ".join(d.used_by[:3]) + (" ..." if len(d.used_by) > 3
                                                           else "")) or "-")
        out.print(table)


@app.command("gc")
def images_gc(dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Show what would be removed; remove nothing.")] = False,
        other_state: Annotated[bool, typer.Option(
            "--other-state", help="Also remove unused derived images built from another "
            "state directory (CYCLEBOX_STATE_DIR / checkout).")] = False,
        json_out: JsonOpt = False) -> None:
    """Remove derived analyst images (`cyclebox/analyst-deps:*`) that no container and no
    live cyclebox run uses; they are rebuilt offline when a freeze needs them again.
    Role images are never removed."""
    from dataclasses import asdict

    from runner.isolation.docker.agent_image import gc_derived

    rows = gc_derived(dry_run=dry_run, other_state=other_state)
    if json_out:
        emit_json([asdict(r) for r in rows])
        return
    for r in rows:
        verb = ("would remove" if dry_run and r.would_remove else
                "removed" if r.removed else "kept")
        out.print(f"{verb} {safe(r.tag)} ({safe(r.id[:19])}, {r.size_bytes / 1e6:.0f} MB): "
                  f"{safe(r.reason)}", highlight=False)
    done = [r for r in rows if (r.would_remove if dry_run else r.removed)]
    out.print(f"{len(done)} derived image(s) {'would be removed' if dry_run else 'removed'}, "
              f"{len(rows) - len(done)} kept, "
              f"{sum(r.size_bytes for r in done) / 1e6:.0f} MB"
              + (" (dry run: nothing removed)" if dry_run else ""), highlight=False)


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
