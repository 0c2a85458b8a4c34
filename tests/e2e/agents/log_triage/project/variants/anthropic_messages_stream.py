"""anthropic SDK, the Messages API, streaming (``messages.stream``) with a tool."""

from __future__ import annotations

from typing import Any

import anthropic

from variants import common

TOOLS: list[dict[str, Any]] = [{"name": common.TOOL_NAME,
                                "description": common.TOOL_DESCRIPTION,
                                "input_schema": common.PARAMETERS}]


def run(question: str, system: str, model: str) -> str:
    client = anthropic.Anthropic()
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for _ in range(4):
        with client.messages.stream(model=model, max_tokens=512, system=system,
                                    messages=messages, tools=TOOLS) as stream:  # type: ignore[arg-type]
            final = stream.get_final_message()
        uses = [b for b in final.content if b.type == "tool_use"]
        if not uses:
            return "".join(b.text for b in final.content if b.type == "text")
        messages.append({"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in final.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u.id,
             "content": common.call_tool(u.name, dict(u.input))} for u in uses]})
    return ""
