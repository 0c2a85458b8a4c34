"""``cyclebox gc``: sweep what dead cyclebox processes left behind."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from runner.cli.options import HostBackendOpt, HostRayAddressOpt, JsonOpt
from runner.cli.output import out, report_warning
from runner.errors import EXIT_ENGINE
from runner.termsafe import emit_json, safe

if TYPE_CHECKING:
    from runner.isolation.sandbox import SweepResult

commands = typer.Typer()


@commands.command()
def gc(all_: Annotated[bool, typer.Option("--all", help="Remove every cyclebox container, "
                                          "even those whose owner still runs.")] = False,
       dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be removed; "
                                             "remove nothing.")] = False,
       json_out: JsonOpt = False, backend: HostBackendOpt = None,
       ray_address: HostRayAddressOpt = None) -> None:
    """Remove cyclebox-labelled containers whose owner process is gone, and stale gateway
    socket and input staging directories; print what it removed (or, with --dry-run,
    would remove)."""
    import tempfile
    from dataclasses import asdict
    from pathlib import Path

    from runner.cli.engine import choose_backend, sandbox
    from runner.gateway.server import sweep_socket_dirs
    from runner.gitops import SHADOW_PREFIX
    from runner.isolation.gc import sweep_pid_named_dirs

    choose_backend(backend, ray_address=ray_address)  # ray: a sweep on every alive node
    # The sandbox's containers (every one it looked at), then the owned directories it
    # and the gateway leave behind (only those found removable).
    swept = sandbox().sweep(only_orphans=not all_, dry_run=dry_run)
    results = ([r for r in swept if r.kind == "container"]
               + [r for r in sweep_socket_dirs(dry_run=dry_run) if r.would_remove]
               + [r for r in swept if r.kind != "container" and r.would_remove]
               + [r for r in sweep_pid_named_dirs(Path(tempfile.gettempdir()), SHADOW_PREFIX,
                                                  role="git-shadow", kind="git_dir",
                                                  dry_run=dry_run) if r.would_remove])
    missed = list(getattr(sandbox(), "unanswered", []))
    if missed:  # ray: a node that did not answer was not swept; say so, exit 6
        report_warning(f"{len(missed)} node(s) did not answer and were not swept: "
                       f"{', '.join(safe(n[:12]) for n in missed)}; run gc again when "
                       "they are back (`ray status`)")
    if json_out:
        emit_json([asdict(r) for r in results])
    else:
        _print(results, dry_run=dry_run)
    if missed:
        raise typer.Exit(EXIT_ENGINE)


def _print(results: list[SweepResult], *, dry_run: bool) -> None:
    for r in results:
        verb = ("would remove" if dry_run and r.would_remove else
                "removed" if r.removed else "kept")
        what = {"socket_dir": "socket dir", "staging_dir": "staging dir",
                "git_dir": "git temp dir"}.get(r.kind, "container")
        out.print(f"{verb} {safe(r.name)} ({what}, run {safe(r.run_id)}, "
                  f"role {safe(r.role)}): {safe(r.reason)}", highlight=False)
    verb = "would be removed" if dry_run else "removed"
    done = [r for r in results if (r.would_remove if dry_run else r.removed)]
    n_cont = sum(r.kind == "container" for r in done)
    kept = sum(r.kind == "container" for r in results) - n_cont
    n_sock = sum(r.kind == "socket_dir" for r in done)
    n_git = sum(r.kind == "git_dir" for r in done)
    out.print(f"{n_cont} container(s) {verb}, {kept} kept; "
              f"{n_sock} gateway socket dir(s) {verb}; "
              f"{len(done) - n_cont - n_sock - n_git} input staging dir(s) {verb}; "
              f"{n_git} git temp dir(s) {verb}"
              + (" (dry run: nothing removed)" if dry_run else ""), highlight=False)
