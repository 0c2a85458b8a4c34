"""Writing a run's report files (JUnit XML, Markdown, HTML) where the operator asked.

Targets are checked before any work starts (:func:`check_targets`); each file is written
through a temporary file and a rename, so a symlink planted at the target is replaced,
never followed.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from runner.errors import ConfigError
from runner.failures import is_environment_error
from runner.outdir import refuse_inside_run, within
from runner.report.model import Report

SYSTEM_DIRS = ("/dev", "/proc", "/sys")
"""Where no output file is ever written: a report is a new file renamed into place, and a
device node there (``--markdown /dev/null`` as root) was replaced by a regular file."""


def check_output_file(path: Path, *, field: str, run_dir: Path | None = None,
                      why: str = "the run directory {dir}, whose receipt binds every file "
                                 "in it") -> None:
    """Refuse, before any work, an output file the host would replace by rename where it
    must not: in a system directory, over an existing entry that is not a regular file or
    a link (a device, FIFO or socket), or inside the run directory (``run_dir``), whose
    receipt binds every file in it (``--html RUN/receipt.json`` overwrote the receipt)."""
    refuse_inside_run(path, field=field)
    where = Path(os.path.realpath(path.parent if str(path.parent) else Path(".")))
    target = where / path.name
    if any(str(where) == d or str(where).startswith(d + "/") for d in SYSTEM_DIRS):
        raise ConfigError(f"{where} is a system directory; no file is written there",
                          path=str(path), field=field, fix="write the file into a directory "
                          "of your own (e.g. beside the run)")
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise ConfigError(f"cannot inspect {path}: {exc.strerror}", path=str(path),
                          field=field, fix="pick another path") from None
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)
                               or stat.S_ISDIR(st.st_mode)):
        raise ConfigError(f"{path} exists and is not a regular file (a device, FIFO or "
                          "socket); the file is written whole and renamed into place",
                          path=str(path), field=field, fix="give a regular file's path")
    if run_dir is not None:
        run = Path(os.path.realpath(run_dir))
        if target == run or within(where, run):  # where: its links resolved; the name: not
            raise ConfigError(f"{path} is inside {why.format(dir=run_dir)}", path=str(path),
                              field=field, fix="write the file beside that directory, not in "
                              "it")


def check_targets(run_dir: Path | None = None, **targets: Path | None) -> None:
    """Refuse an output path whose directory is missing, that is a directory, or that
    :func:`check_output_file` refuses, before any work starts."""
    for flag, path in targets.items():
        if path is None:
            continue
        check_output_file(path, field=f"--{flag}", run_dir=run_dir)
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise ConfigError(f"{parent} is not a directory", path=str(path),
                              field=f"--{flag}", fix="create the directory first or pick "
                              "another path")
        if path.is_dir():
            raise ConfigError(f"{path} is a directory", path=str(path), field=f"--{flag}",
                              fix="give a file name")
        if not os.access(parent, os.W_OK | os.X_OK):  # also False on a read-only mount
            raise ConfigError(f"cannot write into {parent} (read-only or not permitted)",
                              path=str(path), field=f"--{flag}",
                              fix="pick a path in a directory you can write")


def _write(path: Path, data: bytes, *, flag: str) -> None:
    """Write via a temporary file and rename: an existing symlink at ``path`` is replaced,
    never followed. The file gets the operator's umask (0666 less it), like any file a
    command writes for them; ``mkstemp``'s 0600 made a shared CI summary unreadable. A
    directory that refuses the write (read-only, not permitted) is bad input naming
    ``path`` and ``--flag``; a full disk stays an environment failure."""
    parent = path.parent if str(path.parent) else Path(".")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    tmp: Path | None = None
    try:
        for _ in range(100):
            candidate = parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
            try:
                fd = os.open(candidate, flags, 0o666)
            except FileExistsError:
                continue
            tmp = candidate
            break
        else:
            raise FileExistsError(f"no free temporary name beside {path}")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and not is_environment_error(exc):
            raise ConfigError(f"cannot write {path}: {exc.strerror or exc}", path=str(path),
                              field=f"--{flag}", fix="pick a path in a directory you can "
                              "write") from None
        raise


def write_outputs(run_dir: Path, *, junit: Path | None = None, markdown: Path | None = None,
                  html: Path | None = None) -> Report:
    """Build the run's report and write the requested files; returns the Report."""
    from runner.report import build_report
    from runner.report.html import render_html
    from runner.report.render import junit as render_junit
    from runner.report.render import markdown as render_markdown

    check_targets(run_dir, junit=junit, markdown=markdown, html=html)
    report = build_report(run_dir)
    if junit is not None:
        _write(junit, render_junit(report), flag="junit")
    if markdown is not None:
        _write(markdown, render_markdown(report).encode(), flag="markdown")
    if html is not None:
        _write(html, render_html(report, run_dir=run_dir,
                                 html_dir=html.parent if str(html.parent) else Path("."))
               .encode(), flag="html")
    return report
