"""Where the CLI prints: ``out`` (results, stdout) and ``err`` (errors, progress, stderr).

Every string that did not come from cyclebox itself goes through ``runner.termsafe``
before it reaches either console: a container's bytes never drive the terminal.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, TextIO

from rich.console import Console, ConsoleDimensions

from runner.termsafe import safe

if TYPE_CHECKING:
    from runner.report.model import Report

PLAIN_WIDTH = 4096
"""Columns of a console that is not a terminal (a pipe, a file, CI logs): wide enough that
no line is cut or folded at 80, the width rich assumes otherwise."""


class PlainConsole(Console):
    """A rich Console that is as wide as :data:`PLAIN_WIDTH` when it does not write to a
    terminal and ``COLUMNS`` is unset; on a terminal it is the terminal's width."""

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        if self._width is None and "COLUMNS" not in os.environ and not self.is_terminal:
            return ConsoleDimensions(PLAIN_WIDTH, dims.height)
        return dims

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size


out = PlainConsole()
err = PlainConsole(stderr=True)


def _indented(message: str) -> str:
    """``message`` made safe, every line after the first indented: a newline in a path or
    a file's text can never start a line of its own (a forged "receipt verified")."""
    return safe(message, 8000).replace("\n", "\n  ")


def report_error(message: str) -> None:
    """Print one error on stderr (its continuation lines indented); the only place the
    CLI prints an error."""
    err.print(f"[bold red]error:[/] {_indented(message)}", highlight=False, soft_wrap=True)


def report_warning(message: str) -> None:
    """Print one warning on stderr: something the operator should know that does not
    stop the command."""
    err.print(f"[bold yellow]warning:[/] {_indented(message)}", highlight=False,
              soft_wrap=True)


class LineProgress:
    """Progress as plain lines on a stream: one when a stage starts, then every
    ``every`` cases (or every tenth of a long stage) and at the last one. For CI logs and
    ``--json`` runs."""

    def __init__(self, stream: TextIO | None = None, every: int = 5) -> None:
        self.stream = stream or sys.stderr
        self.every = max(1, every)
        self.t0 = time.monotonic()

    def __call__(self, stage: str, done: int, total: int) -> None:
        step = max(self.every, total // 10)
        if total and (done == 0 or (done % step and done != total)):
            return
        what = f"{done}/{total} cases" if total else "started"
        self.stream.write(f"cyclebox [{time.monotonic() - self.t0:7.1f}s] {stage}: {what}\n")
        self.stream.flush()


def print_terminal(report: Report, extra: tuple[tuple[str, str], ...] = ()) -> None:
    """The two-column terminal summary (then the ``extra`` rows); every value printed
    with markup off."""
    from rich.table import Table
    from rich.text import Text

    from runner.report.render import terminal_rows
    from runner.report.text import one_line

    colour = {"accept_for_review": "green", "reject": "red"}.get(report.verdict, "yellow")
    t = Table(title=Text(one_line(f"cyclebox report {report.name or ''}")),
              show_header=False)
    t.add_column("k")
    t.add_column("v", overflow="fold")
    for k, v in (*terminal_rows(report), *((k, one_line(v)) for k, v in extra)):
        t.add_row(Text(k), Text(v, style=f"bold {colour}" if k == "verdict" else ""))
    out.print(t)
