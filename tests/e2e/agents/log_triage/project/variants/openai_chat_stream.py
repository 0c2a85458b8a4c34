"""openai SDK (async client), Chat Completions with ``stream=True`` and a function tool."""

from __future__ import annotations

import asyncio
from typing import Any

import openai

from variants import common


async def _turn(client: openai.AsyncOpenAI, model: str,
                messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, str]]]:
    text: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    stream = await client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                  tools=common.chat_tools(),  # type: ignore[arg-type]
                                                  stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                text.append(delta.content)
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
    return "".join(text), [calls[i] for i in sorted(calls)]


async def _run(question: str, system: str, model: str) -> str:
    client = openai.AsyncOpenAI()
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": question}]
    for _ in range(4):
        text, calls = await _turn(client, model, messages)
        if not calls:
            return text
        messages.append({"role": "assistant", "content": text or None, "tool_calls": [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]})
        for c in calls:
            messages.append({"role": "tool", "tool_call_id": c["id"],
                             "content": common.call_tool(c["name"], c["arguments"])})
    return ""


def run(question: str, system: str, model: str) -> str:
    return asyncio.run(_run(question, system, model))
