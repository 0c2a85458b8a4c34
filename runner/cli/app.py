"""The ``cyclebox`` command line assembled from one module per area.

Imports go one way: this module imports the area modules (``doctor``, ``images``,
``sandbox``, ``cycle``, ...), which import only ``options``, ``output``, ``engine`` (the
backend and image ids) and the domain packages; no area module imports this one. Each
area module exposes ``app`` (a command group added here under its name) and/or
``commands`` (commands added at the top level).
Errors and exit codes are handled in one place, the root group :class:`Boundary`.
"""

from __future__ import annotations

import sys

import typer

from runner import __version__, interrupts
from runner.cli import (
    cycle,
    doctor,
    dream,
    engine,
    export,
    gateway,
    gc,
    images,
    project,
    receipt,
    report,
    review,
    sandbox,
    stages,
    train,
)
from runner.cli.boundary import Boundary, guarded_exit_for
from runner.cli.output import out
from runner.errors import EXIT_TABLE

app = typer.Typer(
    name="cyclebox", cls=Boundary, no_args_is_help=True, add_completion=False,
    help="Run LLM-agent improvement cycles in hardened containers.\n\n"
         "Exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_TABLE) + ".",
)


@app.command()
def version() -> None:
    """Print the cyclebox version."""
    out.print(__version__)


# Top-level commands first, then the groups; `cyclebox --help` lists them in this order.
for _commands in (doctor.commands, gc.commands, report.commands, cycle.commands,
                  stages.commands, export.commands, project.commands):
    app.add_typer(_commands)
for _name, _group in (("images", images.app), ("sandbox", sandbox.app),
                      ("gateway", gateway.app), ("cycle", cycle.app), ("receipt", receipt.app),
                      ("review", review.app), ("dream", dream.app), ("model", train.model_app),
                      ("train", train.app), ("manifest", project.manifest_app)):
    app.add_typer(_group, name=_name)


def main() -> None:
    """Console-script entry point (``cyclebox``, ``python -m runner.cli``).

    SIGTERM and SIGINT unwind (a second one exits at once, see ``runner.interrupts``);
    every exception is mapped to an exit code by the root group, :class:`Boundary`.
    """
    interrupts.install()
    engine.reset()
    try:
        code = app(standalone_mode=False)
    except SystemExit:
        raise
    except BaseException as exc:  # the command tree itself failed to build: still one line
        code = guarded_exit_for(exc)
    finally:
        _remove_own_git_dirs()
    engine.exit_if_stranded(code)
    sys.exit(code)


def _remove_own_git_dirs() -> None:
    """Remove this process's temporary git directories that a signal cut short while
    they were being cleaned up (a SIGKILLed process leaves them to `cyclebox gc`)."""
    import contextlib
    import shutil
    import tempfile
    from pathlib import Path

    from runner.gitops import SHADOW_PREFIX
    from runner.isolation.owner import current_owner

    with contextlib.suppress(Exception):
        me = current_owner()
        for d in Path(tempfile.gettempdir()).glob(f"{SHADOW_PREFIX}{me.pid}-{me.start}-*"):
            if not d.is_symlink() and d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
