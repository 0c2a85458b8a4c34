"""The ``cyclebox`` command line: one typer app (``app``), one module per area.

``main`` is the console-script entry point; ``python -m runner.cli`` runs it too.
"""

from runner.cli.app import app, main

__all__ = ["app", "main"]
