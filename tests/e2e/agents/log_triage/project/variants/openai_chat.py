"""openai SDK, Chat Completions, a function tool, no streaming; also embeds the question."""

from __future__ import annotations

from typing import Any

import openai

from variants import common

EMBED_MODEL = "fixture-embed"


def run(question: str, system: str, model: str) -> str:
    client = openai.OpenAI()
    vector = client.embeddings.create(model=EMBED_MODEL, input=question).data[0].embedding
    common.EXTRA["embedding_dims"] = len(vector)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": question}]
    for _ in range(4):
        msg = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                             tools=common.chat_tools()).choices[0].message  # type: ignore[arg-type]
        if not msg.tool_calls:
            return msg.content or ""
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": common.call_tool(call.function.name,
                                                         call.function.arguments)})
    return ""
