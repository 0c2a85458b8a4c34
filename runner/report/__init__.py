"""Reports over a finished run directory: terminal, JSON, JUnit XML, Markdown and HTML.

Invariants: everything here is a pure function of the run directory's files, read with
bounded, link-refusing reads (``readfs``); every string that came from a container
(answers, reasons, file names, model text) is treated as hostile and escaped by each
renderer for its own medium; nothing here talks to Docker, git or a model.
"""

from runner.report.build import build_report
from runner.report.model import Report

__all__ = ["Report", "build_report"]
