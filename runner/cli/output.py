"""Where the CLI prints: ``out`` (results, stdout) and ``err`` (errors, progress, stderr).

Every string that did not come from cyclebox itself goes through ``runner.termsafe``
before it reaches either console: a container's bytes never drive the terminal.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console

from runner.termsafe import safe

out = Console()
err = Console(stderr=True)


def report_error(message: str) -> None:
    """Print one error line on stderr; the only place the CLI prints an error."""
    err.print(f"[bold red]error:[/] {safe(message, 8000)}", highlight=False, soft_wrap=True)


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
