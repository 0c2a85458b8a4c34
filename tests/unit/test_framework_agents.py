"""The framework matrix's agent (tests/e2e/agents/log_triage), read without running it:
no variant reaches for cyclebox (no ``sandbox`` import, no socket, no endpoint or key in
the code), every SDK client is built with no argument, every requirement is pinned, and
the committed cases, scripts and manifest are what matrix.py makes of its tables."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "tests" / "e2e" / "agents" / "log_triage"
SOURCES = sorted((AGENT / "project").rglob("*.py"))
CLIENTS = {"OpenAI", "AsyncOpenAI", "Anthropic", "AsyncAnthropic"}


def _matrix():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("log_triage_matrix", AGENT / "matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _code(tree: ast.Module) -> str:
    """The program without its docstrings and comments (which may name the contract)."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def test_every_variant_has_a_module_and_nothing_else_is_one() -> None:
    variants = {p.stem for p in (AGENT / "project" / "variants").glob("*.py")} - {
        "__init__", "common"}
    assert variants == set(_matrix().VARIANTS)


def test_no_variant_imports_sandbox_or_names_a_socket_endpoint_or_key() -> None:
    assert len(SOURCES) >= 10
    for path in SOURCES:
        src = path.read_text()
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "sandbox" for a in node.names), path
            if isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "sandbox", path
        low = _code(tree).lower()
        for word in ("sandbox", ".sock", "af_unix", "unix", "127.0.0.1", "localhost",
                     "40080", "base_url", "api_key", "environ[", "cyclebox_gateway"):
            assert word not in low, f"{path.relative_to(ROOT)} names {word!r}"


def test_every_client_is_built_with_no_argument() -> None:
    built = set()
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else (
                node.func.id if isinstance(node.func, ast.Name) else "")
            if name in CLIENTS:
                assert not node.args and not node.keywords, f"{path.name}: {name}(...)"
                built.add(name)
            if name == "ChatOpenAI":  # the model only
                assert [k.arg for k in node.keywords] == ["model"] and not node.args
                built.add(name)
    assert built == {"OpenAI", "AsyncOpenAI", "Anthropic", "ChatOpenAI"}


def test_every_requirement_is_pinned() -> None:
    lines = [ln for ln in (AGENT / "project" / "requirements.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+(\[[a-z,]+\])?==[0-9A-Za-z.+]+", ln)
               for ln in lines), lines
    names = {re.split(r"[\[=]", ln)[0] for ln in lines}
    assert {"openai", "openai-agents", "anthropic", "langchain-openai", "langgraph",
            "pydantic-ai-slim", "litellm"} <= names


def test_the_committed_files_are_what_matrix_py_writes(tmp_path: Path) -> None:
    ids = _matrix().write(tmp_path)
    assert len(ids) == 11 * 8
    for rel in ("scenarios.yaml", "policy.yaml", "scripts/target.yaml",
                "scripts/optimizer.yaml", "data/logs.json"):
        assert (tmp_path / rel).read_text() == (AGENT / rel).read_text(), (
            f"{rel} is stale: run python {AGENT.relative_to(ROOT)}/matrix.py")
    manifest = yaml.safe_load((AGENT / "manifest.json").read_text())
    assert [s["id"] for s in manifest["scenarios"]] == ids


def test_the_scripted_target_answers_every_incident_with_one_tool_call_then_text() -> None:
    m = _matrix()
    rules = yaml.safe_load((AGENT / "scripts" / "target.yaml").read_text())["rules"]
    for iid, service, _, component, _ in m.INCIDENTS:
        mine = [r for r in rules if iid in r["when"]["contains"]]
        assert [r["when"]["tool_result"] for r in mine] == [True, True, False]
        assert mine[0]["reply"] == component and component in mine[1]["reply"]
        assert mine[2]["tool_call"] == {"name": "read_log", "arguments": {"service": service}}

