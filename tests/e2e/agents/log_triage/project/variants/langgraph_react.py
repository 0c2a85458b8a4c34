"""langchain-openai's ``ChatOpenAI(model=...)`` in langgraph's prebuilt ReAct agent, a tool."""

from __future__ import annotations

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from variants import common


@tool
def read_log(service: str) -> str:
    """Return the latest log excerpt of one service."""
    return common.read_log(service)


def run(question: str, system: str, model: str) -> str:
    agent = create_react_agent(ChatOpenAI(model=model), tools=[read_log], prompt=system)
    result = agent.invoke({"messages": [("user", question)]})
    return str(result["messages"][-1].content)
