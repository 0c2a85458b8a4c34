"""`cyclebox schema NAME`: every served schema documents every field, and the contract
models agree with the sandbox code that actually reads and writes those files."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runner.cycle.models import Reference
from runner.cycle.scoring import resolved_reference
from runner.errors import ConfigError
from runner.project.contracts import Answer, WorkerReply, WorkerRequest
from runner.project.schemas import SCHEMAS, names, schema
from sandbox import evaluator, worker
from sandbox.proposal import Refused, check_changes, parse_reply


def undocumented(doc: dict[str, Any]) -> list[str]:
    """Every property (top level and in $defs) without a description."""
    out = []
    models = [("(top)", doc), *doc.get("$defs", {}).items()]
    for where, node in models:
        for prop, spec in (node.get("properties") or {}).items():
            if not str(spec.get("description") or "").strip():
                out.append(f"{where}.{prop}")
    return out


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_field_of_every_served_schema_has_a_description(name: str) -> None:
    doc = schema(name)
    assert doc.get("properties"), f"{name}: no properties at all"
    assert undocumented(doc) == [], f"schema {name}: fields without a docstring"


def test_the_walk_would_catch_a_field_without_a_docstring() -> None:
    from runner.isolation.sandbox import Frozen

    class Bare(Frozen):
        documented: int = 1
        """Has one."""
        bare: int = 2

    assert undocumented(Bare.model_json_schema()) == ["(top).bare"]


def test_the_listing_names_the_files_a_user_meets() -> None:
    listed = [n for n, _ in names()]
    for must in ("cycle", "scenarios", "manifest", "policy", "roles", "script", "proposal",
                 "answer", "request", "reply"):
        assert must in listed


def test_an_unknown_name_is_bad_input_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError) as exc:
        schema("cylce")
    assert "cylce" in str(exc.value) and "cycle" in str(exc.value)
    assert "scenarios" in str(exc.value)


def test_the_reply_model_matches_what_the_worker_accepts() -> None:
    reply = WorkerReply.model_validate({"files": [{"path": "prompts/system.md",
                                                   "content": "new"}], "rationale": "why"})
    changes, rationale = parse_reply(reply.model_dump_json())
    assert [(c.path, c.content) for c in changes] == [("prompts/system.md", "new")]
    assert rationale == "why"
    check_changes(changes, paths={"prompts/system.md"}, allowlist=["prompts/*.md"])
    with pytest.raises(Refused):  # a key the model does not document is refused by the worker
        parse_reply(json.dumps({"files": [], "rationale": "", "extra": 1}))


def test_the_request_model_is_what_the_worker_reads() -> None:
    req = WorkerRequest.model_validate({
        "brief": "## d01", "files": [{"path": "p.md", "content": "old", "sha256": None}],
        "paths": ["p.md"], "allowlist": ["*.md"], "model": "m", "max_tokens": 10})
    text = worker.prompt(req.model_dump(mode="json"))
    assert "## d01" in text and "# File: p.md" in text


def test_the_answer_model_is_what_the_evaluator_grades() -> None:
    good = Answer.model_validate({"answer": 25, "evidence": ["leave_days"], "note": "kept"})
    assert good.model_extra == {"note": "kept"}
    ref = resolved_reference(Reference(kind="number", value=25.0, evidence=("leave_days",)))
    grades = evaluator.score(good.model_dump(mode="json"), ref)
    assert grades == {"correctness": True, "evidence": True, "refusal": True}
    refused = Answer(refused=True)
    assert evaluator.score(refused.model_dump(mode="json"),
                           resolved_reference(Reference(kind="refuse")))["refusal"] is True
