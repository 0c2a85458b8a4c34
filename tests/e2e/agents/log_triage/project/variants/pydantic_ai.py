"""pydantic-ai: ``Agent("openai:MODEL")`` with a plain tool. Its OpenAI provider reads the
environment; since pydantic-ai 2.x the ``openai:`` prefix speaks the Responses API."""

from __future__ import annotations

from pydantic_ai import Agent

from variants import common


def run(question: str, system: str, model: str) -> str:
    agent = Agent(f"openai:{model}", instructions=system)

    @agent.tool_plain
    def read_log(service: str) -> str:
        """Return the latest log excerpt of one service.

        Args:
            service: the service's name
        """
        return common.read_log(service)

    return str(agent.run_sync(question).output)
