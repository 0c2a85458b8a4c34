"""``cyclebox report RUN_DIR``: a past run, on the terminal and as report files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from runner.cli.options import HtmlOpt, JsonOpt, JunitOpt, MarkdownOpt
from runner.cli.output import out
from runner.errors import ConfigError
from runner.report.files import write_outputs
from runner.report.model import Report
from runner.termsafe import emit_json_text

commands = typer.Typer()


@commands.command("report")
def report_cmd(run_dir: Annotated[Path, typer.Argument(help="A cycle run directory.")],
               json_out: JsonOpt = False, junit: JunitOpt = None, markdown: MarkdownOpt = None,
               html: HtmlOpt = None) -> None:
    """Show a past run: verdict and reasons, pass rates per split and arm, improved and
    regressed cases, cost per role, McNemar figures, the receipt hash.

    Exit 0 when the report was written (whatever the verdict), 3 bad arguments, 7 when
    the run directory cannot be read safely."""
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a directory", field="RUN_DIR",
                          fix="pass the directory given to `cycle run --out`")
    report = write_outputs(run_dir, junit=junit, markdown=markdown, html=html)
    if json_out:
        emit_json_text(report.model_dump_json(by_alias=True))
        return
    print_terminal(report)


def print_terminal(report: Report) -> None:
    """The two-column terminal summary; every value printed with markup off."""
    from rich.text import Text

    from runner.report.render import terminal_rows
    from runner.report.text import one_line

    colour = {"accept_for_review": "green", "reject": "red"}.get(report.verdict, "yellow")
    t = Table(title=Text(one_line(f"cyclebox report {report.name or ''}")),
              show_header=False)
    t.add_column("k")
    t.add_column("v", overflow="fold")
    for k, v in terminal_rows(report):
        t.add_row(Text(k), Text(v, style=f"bold {colour}" if k == "verdict" else ""))
    out.print(t)
