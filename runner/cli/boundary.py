"""The CLI's one error boundary: every exception that ends a command becomes one exit code.

:class:`Boundary` is the root command group. Whatever a command raises passes through its
:meth:`Boundary.invoke` and is mapped by :func:`exit_for` (``runner.failures.classify``
over ``runner.errors.EXIT_CODES``): a deliberate :class:`~runner.errors.CycleboxError`
prints its message; anything else prints one line naming the log file that holds the
traceback and exits 10; no traceback ever reaches the terminal. :meth:`Boundary.main`
adds what click raises around a command: a usage error is bad input (3, never click's 2,
which is a verdict), an abort is 130, and every code is returned (or exited with) from
this one place. Commands therefore never catch ``CycleboxError`` just to exit: they raise,
or ``raise typer.Exit(code)`` for a verdict.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from runner.cli.output import report_error
from runner.errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, EXIT_INTERRUPTED, EXIT_UNEXPECTED
from runner.failures import classify, is_engine_error
from runner.paths import state_dir


def _error_log(exc: BaseException) -> Path | None:
    """Write the traceback to ``<state dir>/logs/error-<ts>-<pid>.log``; None if it cannot."""
    ts = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    path = state_dir() / "logs" / f"error-{ts}-{os.getpid()}.log"
    text = "".join(traceback.format_exception(exc))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8", "backslashreplace"))
    except OSError:
        return None
    return path


def _silence_std_streams() -> None:
    """Point stdout/stderr at /dev/null so the interpreter's final flush cannot fail too."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # not a real file (captured in a test)
            os.dup2(devnull, stream.fileno())
    os.close(devnull)


def exit_for(exc: BaseException) -> int:
    """The one mapping from an exception to an exit code; prints one line on stderr.

    Deliberate errors print their message; an unexpected error prints one line naming
    the log file that holds the traceback (never the traceback itself). A closed stdout
    (the reader of a pipe went away) is an environment failure: the output is incomplete,
    and no verdict may be read from an exit code that pretends otherwise.
    """
    if isinstance(exc, BrokenPipeError) and not is_engine_error(exc):
        with contextlib.suppress(OSError):
            report_error("output pipe closed (broken pipe); the output is incomplete")
        _silence_std_streams()
        return EXIT_ENVIRONMENT
    failure = classify(exc)
    if failure.reason == "interrupted":
        report_error("interrupted; containers started by this process were removed")
    elif failure.reason == "cyclebox_error":
        report_error(str(exc))
    else:
        log = _error_log(exc)
        where = f"traceback in {log}" if log else "the traceback could not be written"
        report_error(f"{failure.reason}: {failure.message} ({where})")
    return failure.exit_code


def guarded_exit_for(exc: BaseException) -> int:
    """:func:`exit_for`, or 10 when even reporting fails (a closed stderr)."""
    try:
        return exit_for(exc)
    except BaseException:
        return EXIT_UNEXPECTED


class Boundary(TyperGroup):
    """Root group of ``cyclebox``: maps every exception to an exit code (module docstring)."""

    # ctx is click's Context, which typer vendors (typer._click) in recent versions.
    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, typer.TyperException, SystemExit, EOFError):
            # click's own control flow (an exit code, a usage error, EOF at a prompt):
            # handled by main() below.
            raise
        except BaseException as exc:
            raise typer.Exit(guarded_exit_for(exc)) from None

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        """Run the command line; exit with its code (or return it when not standalone)."""
        try:
            # Not standalone: click returns a command's typer.Exit code instead of exiting,
            # and raises its usage errors here instead of exiting 2 (2 is a verdict).
            rv = super().main(args, prog_name, complete_var, standalone_mode=False,
                              windows_expand_args=windows_expand_args, **extra)
            code = rv if isinstance(rv, int) else 0
        except SystemExit as exc:
            if not isinstance(exc.__context__, BrokenPipeError):
                raise
            code = EXIT_ENVIRONMENT  # click's exit 1 for a closed pipe (help | head)
        except typer.Abort:  # EOF at a prompt
            report_error("aborted")
            code = EXIT_INTERRUPTED
        except typer.TyperException as exc:  # click's usage errors: bad input
            if type(exc).__name__ == "NoArgsIsHelpError":  # typer printed the help already
                code = 0
            else:
                from typer.rich_utils import rich_format_error

                rich_format_error(exc)  # type: ignore[arg-type]
                code = EXIT_BAD_INPUT
        except BaseException as exc:  # raised while parsing, outside any command
            code = guarded_exit_for(exc)
        if standalone_mode:
            sys.exit(code)
        return code
