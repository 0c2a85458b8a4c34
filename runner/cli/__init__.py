"""The ``cyclebox`` command line: one typer app, one sub-module per area."""

from runner.cli.app import app, main

__all__ = ["app", "main"]
