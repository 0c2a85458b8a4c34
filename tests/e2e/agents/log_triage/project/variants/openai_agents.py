"""OpenAI Agents SDK on its defaults: ``Agent`` + ``Runner.run_sync``, the default model
provider (the Responses API), a ``@function_tool``. Tracing is left as shipped."""

from __future__ import annotations

from agents import Agent, Runner, function_tool

from variants import common


@function_tool
def read_log(service: str) -> str:
    """Return the latest log excerpt of one service.

    Args:
        service: the service's name
    """
    return common.read_log(service)


def run(question: str, system: str, model: str) -> str:
    agent = Agent(name="log-triage", instructions=system, model=model, tools=[read_log])
    return str(Runner.run_sync(agent, question).final_output)
