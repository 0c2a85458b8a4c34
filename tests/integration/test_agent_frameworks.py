"""The framework matrix's derived analyst image (tests/e2e/agents/log_triage): built by
cyclebox's own requirements machinery, and inside a hardened analyst container from it
every variant imports and every framework builds its client with no argument from the
environment alone (a dummy one here: nothing listens, no call is made)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.requirements import check_requirements

pytestmark = [pytest.mark.docker, pytest.mark.slow]

AGENT = Path(__file__).resolve().parents[1] / "e2e" / "agents" / "log_triage"
ENV = {"OPENAI_BASE_URL": "http://127.0.0.1:40080/v1",
       "OPENAI_API_BASE": "http://127.0.0.1:40080/v1",
       "OPENAI_API_KEY": "tok-dummy", "ANTHROPIC_BASE_URL": "http://127.0.0.1:40080",
       "ANTHROPIC_API_KEY": "tok-dummy", "CYCLEBOX_MODEL": "fixture-target"}
CHECK = r'''
import importlib, json, os, sys, time
sys.path.insert(0, "/src")
out = {}
def timed(name, fn):
    t0 = time.monotonic()
    try:
        value = fn()
        out[name] = {"ok": True, "value": value, "s": round(time.monotonic() - t0, 2)}
    except Exception as exc:  # every failure is reported, the next check still runs
        out[name] = {"ok": False, "value": f"{type(exc).__name__}: {exc}"[:400]}

model = os.environ["CYCLEBOX_MODEL"]
def openai_clients():
    import openai
    return [str(openai.OpenAI().base_url), str(openai.AsyncOpenAI().base_url)]
def anthropic_client():
    import anthropic
    return str(anthropic.Anthropic().base_url)
def agents_model():
    from agents import Agent
    from agents.models.openai_provider import OpenAIProvider
    m = OpenAIProvider().get_model(model)
    Agent(name="x", model=model)
    return [type(m).__name__, str(m._client.base_url)]
def langchain_model():
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model=model)
    return str(llm.root_client.base_url)
def pydantic_model():
    from pydantic_ai import Agent
    a = Agent(f"openai:{model}")
    return [type(a.model).__name__, str(a.model.client.base_url)]
def litellm_provider():
    import litellm
    return list(litellm.get_llm_provider(f"openai/{model}")[:2])
for name, fn in [("openai", openai_clients), ("anthropic", anthropic_client),
                 ("openai-agents", agents_model), ("langchain-openai", langchain_model),
                 ("pydantic-ai", pydantic_model), ("litellm", litellm_provider)]:
    timed(name, fn)
for v in sys.argv[1:]:
    timed("variant:" + v, lambda v=v: importlib.import_module("variants." + v).__name__)
print(json.dumps(out))
'''


def test_every_variant_imports_and_builds_its_client_from_the_environment() -> None:
    from runner.isolation.docker.agent_image import ensure_agent_image
    from runner.isolation.docker.backend import DockerSandbox
    from runner.isolation.docker.images import resolve_image
    from runner.isolation.policy import load_policies
    from runner.isolation.roles import role_spec
    from runner.isolation.sandbox import Mount, StopReason
    from runner.paths import default_policies

    req_file = AGENT / "project" / "requirements.txt"
    req = check_requirements(req_file.read_bytes(), source=req_file.name, path=str(req_file),
                             field="project.requirements")
    image = ensure_agent_image(resolve_image("analyst"), req, print)
    variants = sorted(p.stem for p in (AGENT / "project" / "variants").glob("*.py")
                      if p.stem not in ("__init__", "common"))
    policy = load_policies(default_policies()).roles["analyst"]
    spec = role_spec(policy, role="analyst", run_id="test-agent-frameworks", image=image.id,
                     command=["python", "-c", CHECK, *variants], env=ENV,
                     mounts=[Mount(source=AGENT / "project", target="/src", read_only=True)])
    rec = DockerSandbox().run(spec)
    assert rec.stop_reason is StopReason.OK, rec.stderr_tail
    facts = json.loads(rec.stdout_tail.strip().splitlines()[-1])
    failed = {k: v["value"] for k, v in facts.items() if not v["ok"]}
    assert not failed, failed
    url = ENV["OPENAI_BASE_URL"]
    assert facts["openai"]["value"] == [url + "/", url + "/"]
    assert facts["anthropic"]["value"].rstrip("/") == ENV["ANTHROPIC_BASE_URL"]
    assert facts["openai-agents"]["value"] == ["OpenAIResponsesModel", url + "/"]
    assert facts["langchain-openai"]["value"] == url + "/"
    assert facts["pydantic-ai"]["value"][1] == url + "/"
    assert facts["litellm"]["value"] == ["fixture-target", "openai"]
    print(json.dumps({k: [v.get("s"), v["value"]] for k, v in facts.items()}, indent=1))
