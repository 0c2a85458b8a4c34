"""The one tool every variant offers its model, and what the run saw."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

READ: list[str] = []
"""Services whose log was read (the answer's evidence)."""
CALLS: list[dict[str, Any]] = []
"""Every tool call, as the framework handed it over."""
EXTRA: dict[str, Any] = {}
"""Anything a variant wants kept in answer.json (e.g. the embedding's size)."""

DATA = Path("/data")
TOOL_NAME = "read_log"
TOOL_DESCRIPTION = "Return the latest log excerpt of one service."
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"service": {"type": "string", "description": "the service's name"}},
    "required": ["service"],
    "additionalProperties": False,
}


def read_log(service: str) -> str:
    """Return the latest log excerpt of one service."""
    CALLS.append({"name": TOOL_NAME, "arguments": {"service": service}})
    services = json.loads((DATA / "logs.json").read_text())["services"]
    if service not in services:
        return f"no log for service {service!r}; known: {', '.join(sorted(services))}"
    READ.append(service)
    return str(services[service])


def call_tool(name: str, arguments: str | dict[str, Any]) -> str:
    """Run a tool call the model asked for (arguments as JSON text or an object)."""
    args = json.loads(arguments or "{}") if isinstance(arguments, str) else arguments
    if name != TOOL_NAME or not isinstance(args, dict):
        return f"unknown tool {name!r}"
    return read_log(str(args.get("service", "")))


def chat_tools() -> list[dict[str, Any]]:
    """The tool in Chat Completions' shape."""
    return [{"type": "function", "function": {"name": TOOL_NAME,
                                              "description": TOOL_DESCRIPTION,
                                              "parameters": PARAMETERS}}]
