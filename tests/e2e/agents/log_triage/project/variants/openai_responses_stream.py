"""openai SDK, the Responses API with ``stream=True`` and a function tool (stateless:
the whole input is sent again with the function call and its output)."""

from __future__ import annotations

from typing import Any

import openai

from variants import common

TOOLS: list[dict[str, Any]] = [{"type": "function", "name": common.TOOL_NAME,
                                "description": common.TOOL_DESCRIPTION,
                                "parameters": common.PARAMETERS, "strict": True}]


def run(question: str, system: str, model: str) -> str:
    client = openai.OpenAI()
    items: list[Any] = [{"role": "user", "content": question}]
    for _ in range(4):
        final = None
        stream = client.responses.create(model=model, instructions=system, input=items,
                                         tools=TOOLS, stream=True)  # type: ignore[arg-type]
        for event in stream:
            if event.type == "response.completed":
                final = event.response
        if final is None:
            raise RuntimeError("the stream ended without response.completed")
        calls = [o for o in final.output if o.type == "function_call"]
        if not calls:
            return final.output_text
        for call in calls:
            items.append({"type": "function_call", "call_id": call.call_id,
                          "name": call.name, "arguments": call.arguments})
            items.append({"type": "function_call_output", "call_id": call.call_id,
                          "output": common.call_tool(call.name, call.arguments)})
    return ""
