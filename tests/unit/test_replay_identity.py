"""A replay keeps the recorded judge's identity, so replayed records compare equal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.cycle.plan import freeze
from runner.errors import ConfigError
from runner.gateway.config import UpstreamPolicy, parse_upstream
from runner.paths import PROJECT_ROOT

EXAMPLE = PROJECT_ROOT / "examples" / "shop-analyst"
FAKE = {r: "sha256:" + "0" * 64 for r in ("analyst", "worker", "evaluator", "apply")}


def _cycle(tmp_path: Path, judge: dict[str, Any], *,
           require_judge: bool | None = None) -> Path:
    """The example cycle with ``judge``; its policy without ``require_judge`` (the
    example's says false) unless given."""
    doc = yaml.safe_load((EXAMPLE / "cycle.yaml").read_text())
    doc["project"]["repo"] = str(PROJECT_ROOT)
    doc["roles"] = str(PROJECT_ROOT / "policies" / "roles.yaml")
    for key in ("scenarios", "data_dir"):
        doc[key] = str(EXAMPLE / doc[key])
    pol = yaml.safe_load((EXAMPLE / doc["policy"]).read_text())
    pol.pop("require_judge", None)
    if require_judge is not None:
        pol["require_judge"] = require_judge
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(pol))
    doc["policy"] = str(tmp_path / "policy.yaml")
    for up in doc["upstreams"].values():
        up["script"] = str((EXAMPLE / up["script"]).resolve())
    doc["judge"] = judge
    path = tmp_path / f"cycle-{judge['threshold']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _replaying(cycle: Path, recorded: Path) -> dict[str, UpstreamPolicy]:
    """What `cycle run --replay RECORDED` puts in place of every upstream."""
    doc = yaml.safe_load(cycle.read_text())
    return {n: parse_upstream({**u, "provider": "replay", "script": None,
                               "replay_from": str(recorded)})
            for n, u in doc["upstreams"].items()}


def _finished(run: Path) -> Path:
    """Give a frozen run the (empty) call log a replay source must have."""
    (run / "gateway").mkdir()
    (run / "gateway" / "calls.jsonl").write_text("")
    return run


def _plan(run: Path) -> dict[str, Any]:
    plan: dict[str, Any] = json.loads((run / "plan.json").read_text())["plan"]
    return plan


def test_replay_keeps_the_recorded_judge_identity(tmp_path: Path) -> None:
    judge = {"model": "fixture-judge", "threshold": 0.5, "required": True}
    cycle = _cycle(tmp_path, judge)
    recorded = tmp_path / "recorded"
    freeze(cycle, recorded, images=FAKE)
    _finished(recorded)
    replayed = tmp_path / "replayed"
    freeze(cycle, replayed, images=FAKE, upstream_override=_replaying(cycle, recorded))
    a, b = _plan(recorded), _plan(replayed)
    assert a["upstream_ids"]["judge"] != b["upstream_ids"]["judge"]  # answered differently
    assert a["judge_id"] is not None and b["judge_id"] == a["judge_id"]
    assert b["policy"]["identities"] == a["policy"]["identities"]
    # another judge spec is another judge, replay or not
    other = _cycle(tmp_path, {**judge, "threshold": 0.9})
    freeze(other, tmp_path / "other", images=FAKE,
           upstream_override=_replaying(other, recorded))
    assert _plan(tmp_path / "other")["judge_id"] not in (None, a["judge_id"])
    # and a replay of a replay still names the first recording's judge
    freeze(cycle, tmp_path / "again", images=FAKE,
           upstream_override=_replaying(cycle, _finished(replayed)))
    assert _plan(tmp_path / "again")["judge_id"] == a["judge_id"]


@pytest.mark.parametrize(("required", "policy", "frozen"), [
    (True, None, True), (False, None, False), (None, None, True), (None, True, True),
    (False, False, False), (None, False, "conflict"), (True, False, "conflict"),
    (False, True, "conflict")])
def test_a_required_judge_is_frozen_into_the_policy(tmp_path: Path, required: bool | None,
                                                    policy: bool | None,
                                                    frozen: bool | str) -> None:
    """judge.required (default true) reaches compare as the frozen policy's
    require_judge (helper-44: it was never read, and a cycle whose every judge call
    failed ended accept_for_review); a policy saying otherwise in so many words is a
    conflict named at freeze, never silently overridden (helper-47 #7b)."""
    judge: dict[str, Any] = {"model": "fixture-judge", "threshold": 0.5}
    if required is not None:
        judge["required"] = required
    cycle = _cycle(tmp_path, judge, require_judge=policy)
    if frozen == "conflict":
        with pytest.raises(ConfigError, match="require_judge") as exc:
            freeze(cycle, tmp_path / "run", images=FAKE)
        assert exc.value.field == "judge.required"
        assert not (tmp_path / "run").exists()
        return
    freeze(cycle, tmp_path / "run", images=FAKE)
    assert _plan(tmp_path / "run")["policy"]["require_judge"] is frozen
