"""``cyclebox report RUN_DIR``, the report output flags shared with ``cycle run``, and the
line-per-stage progress printed when stderr is not a terminal."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, TextIO

import typer
from rich.table import Table

from runner.cli.app import JsonOpt, _fail, app, err, out
from runner.errors import ConfigError, CycleboxError
from runner.report.model import Report
from runner.termsafe import emit_json_text

JunitOpt = Annotated[Path | None, typer.Option(
    "--junit", help="Write JUnit XML: a suite per arm, a case per case x trial.")]
MarkdownOpt = Annotated[Path | None, typer.Option(
    "--markdown", help="Write a Markdown summary (CI step summary, PR comment).")]
HtmlOpt = Annotated[Path | None, typer.Option(
    "--html", help="Write one self-contained HTML report (no scripts, strict CSP).")]


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


def check_targets(**targets: Path | None) -> None:
    """Refuse an output path whose directory is missing, before any work starts."""
    for flag, path in targets.items():
        if path is None:
            continue
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise ConfigError(f"{parent} is not a directory", path=str(path),
                              field=f"--{flag}", fix="create the directory first or pick "
                              "another path")
        if path.is_dir():
            raise ConfigError(f"{path} is a directory", path=str(path), field=f"--{flag}",
                              fix="give a file name")


def _write(path: Path, data: bytes) -> None:
    """Write via a temporary file and rename: an existing symlink at ``path`` is replaced,
    never followed."""
    parent = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_outputs(run_dir: Path, *, junit: Path | None = None, markdown: Path | None = None,
                  html: Path | None = None) -> Report:
    """Build the run's report and write the requested files; returns the Report."""
    from runner.report import build_report
    from runner.report.html import render_html
    from runner.report.render import junit as render_junit
    from runner.report.render import markdown as render_markdown

    check_targets(junit=junit, markdown=markdown, html=html)
    report = build_report(run_dir)
    if junit is not None:
        _write(junit, render_junit(report))
    if markdown is not None:
        _write(markdown, render_markdown(report).encode())
    if html is not None:
        _write(html, render_html(report, run_dir=run_dir,
                                 html_dir=html.parent if str(html.parent) else Path("."))
               .encode())
    return report


@app.command("report")
def report_cmd(run_dir: Annotated[Path, typer.Argument(help="A cycle run directory.")],
               json_out: JsonOpt = False, junit: JunitOpt = None, markdown: MarkdownOpt = None,
               html: HtmlOpt = None) -> None:
    """Show a past run: verdict and reasons, pass rates per split and arm, improved and
    regressed cases, cost per role, McNemar figures, the receipt hash.

    Exit 0 when the report was written (whatever the verdict), 3 bad arguments, 7 when
    the run directory cannot be read safely."""
    try:
        if not run_dir.is_dir():
            raise ConfigError(f"{run_dir} is not a directory", field="RUN_DIR",
                              fix="pass the directory given to `cycle run --out`")
        report = write_outputs(run_dir, junit=junit, markdown=markdown, html=html)
    except CycleboxError as exc:
        _fail(exc)
    if json_out:
        emit_json_text(report.model_dump_json(by_alias=True))
        return
    print_terminal(report)


def print_terminal(report: Report, extra: tuple[tuple[str, str], ...] = ()) -> None:
    """The two-column terminal summary (then the ``extra`` rows); every value printed
    with markup off."""
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


__all__ = ["HtmlOpt", "JunitOpt", "LineProgress", "MarkdownOpt", "check_targets", "err",
           "print_terminal", "write_outputs"]
