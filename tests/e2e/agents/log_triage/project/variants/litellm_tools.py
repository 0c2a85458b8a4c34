"""litellm: ``litellm.completion(model="openai/MODEL")`` with tools (no settings: the model
cost map and everything else as shipped)."""

from __future__ import annotations

from typing import Any

import litellm

from variants import common


def run(question: str, system: str, model: str) -> str:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": question}]
    for _ in range(4):
        msg = litellm.completion(model=f"openai/{model}", messages=messages,
                                 tools=common.chat_tools()).choices[0].message
        if not msg.tool_calls:
            return str(msg.content or "")
        messages.append({"role": "assistant", "content": msg.content, "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in msg.tool_calls]})
        for c in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id,
                             "content": common.call_tool(c.function.name or "",
                                                         c.function.arguments)})
    return ""
