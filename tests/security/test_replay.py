"""A recorded run handed to --replay / replay_from is hostile input: its plan.json
(read for the judge's identity) can neither crash the host nor plant an identity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.cycle.config import JudgeSpec
from runner.cycle.plan import judge_identity

JUDGE = JudgeSpec(model="j", threshold=0.5)
FRESH = judge_identity(JUDGE, "up")


def _recorded(tmp_path: Path, text: str) -> str:
    (tmp_path / "plan.json").write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize("text", [
    "[" * 100_000,                                        # RecursionError on the host
    '{"plan": ' * 50_000 + "{}" + "}" * 50_000,
])
def test_a_nested_recorded_plan_does_not_crash_the_host(tmp_path: Path, text: str) -> None:
    assert judge_identity(JUDGE, "up", replay_from=_recorded(tmp_path, text)) == FRESH


@pytest.mark.parametrize("judge_id", ["\x1b]0;pwned\x07", "x" * 100_000, "", "A" * 64])
def test_a_recorded_judge_id_that_is_no_digest_is_not_kept(tmp_path: Path,
                                                           judge_id: str) -> None:
    plan = {"plan": {"judge": JUDGE.model_dump(mode="json"), "judge_id": judge_id}}
    assert judge_identity(JUDGE, "up", replay_from=_recorded(tmp_path, json.dumps(plan))) \
        == FRESH


def test_a_recorded_digest_is_kept(tmp_path: Path) -> None:
    plan = {"plan": {"judge": JUDGE.model_dump(mode="json"), "judge_id": "ab" * 32}}
    assert judge_identity(JUDGE, "up", replay_from=_recorded(tmp_path, json.dumps(plan))) \
        == "ab" * 32
