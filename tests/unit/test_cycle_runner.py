"""CycleRunner driven through a scripted Sandbox (tests/fixtures/fake_sandbox.py): no Docker.

Everything but the containers is real: the frozen plan, the host gateway (a fake
analyst can call it through the socket it was given), the apply role's own code (run
in process on the stage's output directory), the host's re-verification of the
candidate, collect and compare. The fake is the seam: it records every RunSpec and
returns scripted records and output files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from runner.cycle.plan import freeze, load_plan
from runner.cycle.run import CycleRunner, Outcome
from runner.errors import ConfigError, IntegrityError, SandboxError
from runner.gateway.server import CONTAINER_DIR
from runner.isolation.sandbox import StopReason
from tests.fixtures.cycle_project import EXAMPLE, example_agent, project_with_agent
from tests.fixtures.fake_sandbox import Behaviour, Call, FakeSandbox, Result

ROLES = ("analyst", "worker", "evaluator", "apply")
IMAGES = {r: "sha256:" + hashlib.sha256(r.encode()).hexdigest() for r in ROLES}
MANIFEST = json.loads((EXAMPLE / "manifest.json").read_text())
REFS: dict[str, dict[str, Any]] = {s["id"]: s["reference"] for s in MANIFEST["scenarios"]}
POLICY_CASES = 14
"""Cases in the example's policy (all of its scenarios)."""
IMPROVED = "a01-revenue-april"
"""The case the scripted baseline gets wrong and the candidate gets right."""
BRIEFED = "d01-revenue-march"
"""A development case the baseline also gets wrong: without a development failure there is
nothing to brief and the worker is never called (``nothing_to_improve``)."""
STAGES = ["export", "baseline", "evaluate-baseline", "brief", "propose", "apply",
          "candidate", "evaluate-candidate"]


# -- scripted roles ------------------------------------------------------------------------

def right_answer(case: str) -> dict[str, Any]:
    ref = REFS[case]
    if ref["kind"] == "refuse":
        return {"refused": True, "answer": None, "evidence": []}
    return {"refused": False, "answer": ref["value"], "evidence": list(ref.get("evidence", []))}


def analyst(call: Call) -> Result:
    """Right on every case, except IMPROVED and BRIEFED in the baseline."""
    assert call.case is not None
    answer = right_answer(call.case)
    if call.stage == "baseline" and call.case in (IMPROVED, BRIEFED):
        answer = {"refused": False, "answer": 1.0, "evidence": []}
    return Result(files={"answer.json": json.dumps(answer)})


def evaluator(call: Call) -> Result:
    """The real deterministic scorer over the stage's inputs."""
    from sandbox.evaluator import score

    refs = json.loads((call.mount("/ref") / "references.json").read_text())
    rows = [json.loads(x) for x in (call.mount("/in") / "answers.jsonl").read_text().splitlines()]
    lines = [json.dumps({"case_id": r["case_id"], "trial": r["trial"],
                         "grades": score(r["answer"], refs[r["case_id"]])}) + "\n" for r in rows]
    return Result(files={"grades.jsonl": "".join(lines)})


def worker(call: Call) -> Result:
    req = json.loads((call.mount("/in") / "request.json").read_text())
    f = req["files"][0]
    proposal = {"schema": 1, "rationale": "be careful",
                "files": [{"path": f["path"], "content": f["content"] + "\nBe careful.\n"}],
                "base": {f["path"]: f["sha256"]}}
    return Result(files={"proposal.json": json.dumps(proposal)})


def apply_role(call: Call) -> Result:
    """The apply container's own code, in process, on the seeded work directory."""
    from sandbox.apply import main

    assert call.spec.output_target == "/work"
    repo = call.out / "repo"
    # In its container, git runs as the owner of the work directory (the role's uid, to
    # which the host chowns it when it runs as root); in process here it does not.
    trusted = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "safe.directory",
               "GIT_CONFIG_VALUE_0": str(repo)}
    with mock.patch.dict(os.environ, trusted):
        rc = main(in_dir=call.mount("/in"), repo=repo, out_dir=call.out / "out")
    return Result(exit_code=rc)


def script(**overrides: Behaviour) -> dict[str, Behaviour]:
    return {"analyst": analyst, "evaluator": evaluator, "worker": worker, "apply": apply_role,
            **overrides}


# -- a frozen plan -----------------------------------------------------------------------

Freeze = Callable[..., Path]


@pytest.fixture
def planned(tmp_path: Path) -> Freeze:
    """Freeze the example cycle (with top-level ``changes``) and return its plan.json."""
    def make(**changes: Any) -> Path:
        cycle = project_with_agent(tmp_path / "project", example_agent(), **changes)
        # The scripted analysts mostly make no model call: no usage, so no cost ceiling.
        policy = yaml.safe_load((cycle.parent / "policy.yaml").read_text())
        policy.pop("max_total_cost_usd")
        (cycle.parent / "policy.yaml").write_text(yaml.safe_dump(policy))
        freeze(cycle, tmp_path / "run", images=IMAGES)
        return tmp_path / "run" / "plan.json"
    return make


def run(plan: Path, box: FakeSandbox, stages: list[str] | None = None) -> Outcome:
    def progress(stage: str, _done: int, _total: int) -> None:
        if stages is not None and stage not in stages:
            stages.append(stage)
    return CycleRunner(plan, sandbox=box, progress=progress).run()


def records(plan: Path, side: str) -> dict[str, dict[str, Any]]:
    text = (plan.parent / "stages" / side / "records.jsonl").read_text()
    return {r["case_id"]: r for r in map(json.loads, text.split("\n")[:-1])}


def fake(behaviours: dict[str, Behaviour], **kw: Any) -> FakeSandbox:
    return FakeSandbox(behaviours, images=IMAGES.values(), **kw)


# -- tests ---------------------------------------------------------------------------------

def test_stages_run_in_order_and_the_improvement_is_accepted(planned: Freeze) -> None:
    plan = planned()
    box = fake(script())
    stages: list[str] = []
    outcome = run(plan, box, stages)
    assert outcome.failure is None
    assert outcome.result.verdict == "accept_for_review", outcome.result.reasons
    assert [(c.case_id, c.criterion) for c in outcome.result.improvements] == [
        (IMPROVED, "correctness"), (IMPROVED, "evidence"),
        (BRIEFED, "correctness"), (BRIEFED, "evidence")]
    assert stages == STAGES
    assert box.roles() == (["analyst"] * POLICY_CASES + ["evaluator", "worker", "apply"]
                           + ["analyst"] * POLICY_CASES + ["evaluator"])
    rows = (plan.parent / "containers.jsonl").read_text().splitlines()
    assert len(rows) == len(box.specs)
    assert outcome.proposal_sha256 and outcome.patch_sha256 and outcome.candidate_tree
    patch = (plan.parent / "stages" / "apply" / "candidate.patch").read_text()
    assert "+Be careful." in patch
    assert outcome.leftovers == []
    assert box.leftover_calls[-1] == CycleRunner(plan, sandbox=box).run_id


def test_every_container_runs_under_its_roles_frozen_policy(planned: Freeze) -> None:
    plan_path = planned()
    box = fake(script())
    run(plan_path, box)
    plan, plan_hash = load_plan(plan_path)
    for spec in box.specs:
        pol = plan.roles[spec.role]
        labels = dict(spec.labels)
        assert spec.image == plan.images[spec.role]
        assert spec.run_id == f"{plan.name}-{plan_hash[:10]}"
        assert spec.resources.memory_bytes == pol.memory
        assert spec.timeout_s == pol.timeout_s
        assert spec.output_cap_bytes == pol.output_cap
        assert spec.output_dir is not None and spec.output_dir.is_dir()
        assert "io.cyclebox.stage" in labels
        assert ("io.cyclebox.case" in labels) == (spec.role == "analyst")
        gateway = [m for m in spec.mounts if m.gateway]
        # model access only for a role whose policy names an upstream, one socket each
        assert len(gateway) == (1 if pol.upstream else 0), spec.role
        assert all(m.target == CONTAINER_DIR for m in gateway)
        assert all(m.read_only for m in spec.mounts)
    analyst = next(s for s in box.specs if s.role == "analyst")
    assert {m.target for m in analyst.mounts} >= {"/src", "/case", "/data"}
    assert next(s for s in box.specs if s.role == "apply").output_target == "/work"


def test_a_missing_image_is_refused_before_any_stage(planned: Freeze) -> None:
    plan = planned()
    box = FakeSandbox(script(), images=[i for r, i in IMAGES.items() if r != "apply"])
    with pytest.raises(IntegrityError, match="frozen image for apply"):
        run(plan, box)
    assert box.specs == []
    assert not (plan.parent / "stages").exists()


def test_a_plan_runs_once(planned: Freeze) -> None:
    plan = planned()
    run(plan, fake(script()))
    with pytest.raises(ConfigError, match="already executed") as exc:
        run(plan, fake(script()))
    assert exc.value.field == "--plan"


@pytest.mark.parametrize(("victim", "reason"), [
    ("plan.json", "after baseline: plan drift"),
    ("data", "after baseline: data drift"),
])
def test_drift_during_a_stage_ends_the_cycle_invalid(planned: Freeze, victim: str,
                                                     reason: str) -> None:
    plan_path = planned()
    plan, _ = load_plan(plan_path)
    target = (plan_path if victim == "plan.json"
              else next(p for p in Path(plan.data_dir).iterdir() if p.is_file()))

    def drifting(call: Call) -> Result:
        # someone else changes a frozen input meanwhile
        if victim == "plan.json":
            doc = json.loads(target.read_text())
            doc["plan"]["concurrency"] = 1
            target.write_text(json.dumps(doc))
        else:
            with target.open("ab") as f:
                f.write(b"\0")
        return analyst(call)

    box = fake(script(**{"analyst@baseline": drifting}))
    outcome = run(plan_path, box)
    assert outcome.result.verdict == "invalid_comparison"
    assert outcome.result.reasons[0].startswith(reason), outcome.result.reasons
    assert "worker" not in box.roles()  # nothing after the drifted stage ran
    verdict = json.loads((plan_path.parent / "stages/compare/verdict.json").read_text())
    assert verdict["reasons"] == list(outcome.result.reasons)


def test_an_exhausted_budget_leaves_cases_not_attempted(planned: Freeze) -> None:
    plan = planned(budget={"max_calls": 1, "reservation_usd": 0.01})
    refused: list[str] = []

    def calling(call: Call) -> Result:
        """An analyst that asks the model through the gateway socket it was given."""
        from sandbox.gateway_client import client

        try:
            client(gateway_dir=call.mount(CONTAINER_DIR), timeout_s=30).chat.completions.create(
                model="fixture-target", messages=[{"role": "user", "content": "hello"}])
        except Exception as exc:  # the refusal arrives as an API error
            refused.append(type(exc).__name__)
        return analyst(call)

    box = fake(script(analyst=calling))
    outcome = run(plan, box)
    base = records(plan, "baseline")
    not_attempted = [c for c, r in base.items() if r["status"] == "not_attempted"]
    assert len(not_attempted) == POLICY_CASES - 1, base
    # the headline names the real cause, not a generic "call refused"
    assert all(base[c]["reason"] == "budget: max_calls 1 reached" for c in not_attempted), base
    assert len(refused) >= POLICY_CASES - 1
    assert outcome.result.verdict != "accept_for_review"


def test_a_worker_refused_by_the_budget_names_the_budget(planned: Freeze) -> None:
    """The worker's one call refused (its call cap reached) made it exit 1, and the
    reason read "worker process_failed: exit code 1 (...429...)": the budget now, as for
    the analyst's cases."""
    plan = planned(budget={"per_role_calls": {"worker": 0}, "reservation_usd": 0.01})

    def refused_worker(call: Call) -> Result:
        from sandbox.gateway_client import client

        with contextlib.suppress(Exception):  # the refusal arrives as an API error
            client(gateway_dir=call.mount(CONTAINER_DIR), timeout_s=30).chat.completions.create(
                model="fixture-optimizer", messages=[{"role": "user", "content": "edit"}])
        return Result(exit_code=1)

    outcome = run(plan, fake(script(worker=refused_worker)))
    assert outcome.result.verdict == "invalid_comparison"
    assert outcome.result.reasons[0].startswith("no candidate: budget: "), outcome.result
    assert "worker" in outcome.result.reasons[0], outcome.result


_REFUSED = ("no candidate: worker proposal refused (invalid_output: "
            "stages/propose/out/proposal.json: ")
_WORKER_FIX = "a proposal.json as the worker writes it: {files: [{path, content}], ...})"


# The host reads the worker's proposal into its model before any apply container runs:
# bad JSON and a wrong shape are both refused there, naming the file and the field.
@pytest.mark.parametrize(("proposal", "reason"), [
    (b'{"files": [', _REFUSED + "invalid JSON: Expecting value: line 1 column 12 (char 11) "
                     "(plain JSON: no NaN/Infinity, duplicate keys or nesting deeper "
                     "than 64) Fix: " + _WORKER_FIX),
    (b'{"files": [], "files": []}', _REFUSED + "invalid JSON: duplicate key 'files' "
                                    "(plain JSON: no NaN/Infinity, duplicate keys or nesting "
                                    "deeper than 64) Fix: " + _WORKER_FIX),
    (b'{"files": "prompts/system.md"}', _REFUSED + "files: Input should be a valid tuple Fix: "
                                        "a proposal.json as the worker writes it: {files: "
                                        "[{path, content}], ...})"),
])
def test_a_malformed_proposal_ends_with_a_named_reason(planned: Freeze, proposal: bytes,
                                                       reason: str) -> None:
    plan = planned()
    box = fake(script(worker=lambda _c: Result(files={"proposal.json": proposal})))
    outcome = run(plan, box)
    assert outcome.result.reasons == (reason,)
    assert outcome.failure is None  # a verdict, not a crash
    stages = {dict(s.labels).get("io.cyclebox.stage") for s in box.specs}
    assert "candidate" not in stages and "apply" not in stages


def test_a_refused_proposal_names_the_workers_reason(planned: Freeze) -> None:
    plan = planned()
    err = {"reason": "path_not_allowed", "message": "etc/passwd is not an allowed path"}
    box = fake(script(worker=lambda _c: Result(files={"proposal-error.json": json.dumps(err)},
                                               exit_code=3)))
    outcome = run(plan, box)
    assert outcome.result.reasons == (
        "no candidate: proposal refused (path_not_allowed: etc/passwd is not an allowed path)",)
    assert box.roles()[-1] == "worker"


@pytest.mark.parametrize(("written", "reason"), [
    ("[1]", "no candidate: worker output refused (invalid_output: proposal-error.json is "
            "not a JSON object)"),
    (json.dumps({"reason": "\x1b]0;pwned\x07", "message": "A" * 100_000}),
     "no candidate: proposal refused (\\x1b]0;pwned\\x07: " + "A" * 500 + "…)"),
])
def test_a_hostile_proposal_error_is_named_bounded_and_escaped(
        planned: Freeze, written: str, reason: str) -> None:
    """An attack review: a proposal-error.json that is a list ended the run as an
    unexpected error (AttributeError), and its reason and message went into the verdict
    whole (7 MB, raw escape sequences)."""
    plan = planned()
    box = fake(script(worker=lambda _c: Result(files={"proposal-error.json": written},
                                               exit_code=3)))
    outcome = run(plan, box)
    assert outcome.result.reasons == (reason,)


def test_relay_replies_of_the_wrong_shape_are_refused_by_name() -> None:
    from runner.cycle.run import _replies
    from runner.errors import OutputRejected

    ok = {"t1": {"ok": True, "text": "x"}, "t2": {"ok": False, "error": "e"}}
    assert _replies(ok) == ok
    for bad in ([], {"t1": 1}, {"t1": {"ok": True}}, {"t1": {"ok": "yes", "text": "x"}}):
        with pytest.raises(OutputRejected, match=r"replies\.json"):
            _replies(bad)


def test_hostile_or_failed_analyst_output_invalidates_that_case_only(planned: Freeze) -> None:
    plan = planned()
    victims = {"d01-revenue-march": "symlink", "d02-revenue-books": "timeout",
               "d03-orders-february": "array"}

    def hostile(call: Call) -> Result:
        how = victims.get(call.case or "")
        if how == "symlink":
            return Result(symlinks={"answer.json": "/etc/passwd"})
        if how == "timeout":
            return Result(exit_code=None, stop_reason=StopReason.TIMEOUT,
                          detail="wall-clock limit reached; container killed")
        if how == "array":
            return Result(files={"answer.json": "[1, 2]"})
        return analyst(call)

    outcome = run(plan, fake(script(**{"analyst@baseline": hostile})))
    base = records(plan, "baseline")
    assert base["d01-revenue-march"]["status"] == "infra_invalid"
    assert base["d01-revenue-march"]["reason"].startswith("invalid_output: ")
    assert base["d02-revenue-books"]["reason"] == (
        "timeout: wall-clock limit reached; container killed (stderr: stages/baseline/cases/"
        "d02-revenue-books__t0/logs/analyst-d02-revenue-books-t0.stderr, empty)")
    assert base["d03-orders-february"]["reason"].startswith(
        "invalid_output: answer.json is not a JSON object (stderr: ")
    assert sum(r["status"] == "ok" for r in base.values()) == POLICY_CASES - 3
    assert outcome.result.verdict == "invalid_comparison"


def test_line_separators_in_an_answer_are_kept_and_the_receipt_verifies(
        planned: Freeze) -> None:
    """U+2028, U+2029 and U+0085 are valid in a JSON string (escaped in answer.json) and
    written raw into records.jsonl; every reader splits JSON Lines at "\\n" alone, so the
    receipt is built (str.splitlines() split a record in three and no receipt was written)."""
    from runner.cycle.receipt import build, verify

    plan = planned()
    marks = "see table\u2028orders\u2029and\u0085more"

    def separators(call: Call) -> Result:
        answer = json.loads(analyst(call).files["answer.json"])
        answer["evidence"] = [*answer["evidence"], marks]
        return Result(files={"answer.json": json.dumps(answer)})  # ASCII: escaped

    outcome = run(plan, fake(script(analyst=separators)))
    assert outcome.failure is None
    raw = (plan.parent / "stages" / "baseline" / "records.jsonl").read_bytes()
    assert "\u2028".encode() in raw  # written raw: the test exercises the readers
    assert all(marks in r["answer"]["evidence"] for r in records(plan, "baseline").values()
               if r["status"] == "ok")
    build(outcome)
    assert verify(plan.parent) == []


def test_a_receipt_too_big_to_verify_is_written_and_refused_by_name(
        planned: Freeze, monkeypatch: pytest.MonkeyPatch) -> None:
    """A receipt binds every file by name: an agent writing thousands of files with long
    names (within its output caps) made one bigger than `receipt verify` reads, and the
    run ended accepted with a receipt no one could verify. Now the receipt is kept as
    evidence and the command fails closed (IntegrityError, exit 8), naming where."""
    from runner.cycle import receipt as rc

    plan = planned()

    def flood(call: Call) -> Result:
        files = dict(analyst(call).files)
        files.update({f"n{i:04d}" + "x" * 150: "" for i in range(400)})
        return Result(files=files)

    outcome = run(plan, fake(script(analyst=flood)))
    monkeypatch.setattr(rc, "MAX_BYTES", 1_000_000)
    with pytest.raises(IntegrityError, match=r"the receipt is \d+ bytes, more than `receipt "
                                             r"verify` reads \(1000000\).* under "
                                             r"stages/(baseline|candidate)/cases/"):
        rc.build(outcome)
    assert (plan.parent / "receipt.json").stat().st_size > 1_000_000


@pytest.mark.parametrize(("path", "value", "problem"), [
    pytest.param(("verdict", "verdict"), "reject", "verdict", id="verdict"),
    pytest.param(("fixture",), True, "fixture", id="fixture"),
    pytest.param(("usage", "total", "calls"), 10**6, "usage", id="usage"),
    pytest.param(("outcome", "calls_sha256"), "0" * 64, "outcome.calls_sha256", id="calls"),
    pytest.param(("outcome", "verdict"), "reject", "outcome.verdict", id="outcome-verdict"),
    pytest.param(("patch_sha256",), "0" * 64, "patch_sha256", id="patch"),
    pytest.param(("containers", 0, "exit_code"), 99, "containers", id="containers"),
    pytest.param(("images", "analyst"), "sha256:" + "0" * 64, "images", id="images"),
])
def test_a_receipt_field_edited_after_the_run_does_not_verify(
        planned: Freeze, path: tuple[Any, ...], value: Any, problem: str) -> None:
    """verify re-hashed the files but took the receipt's own fields (verdict, fixture,
    usage, outcome digests) on trust, and attest signed them: a receipt edited to say
    reject, or not a fixture, still verified. Each is recomputed from the bound files."""
    from runner.cycle.receipt import build, verify

    plan = planned()
    outcome = run(plan, fake(script()))
    build(outcome)
    assert verify(plan.parent) == []
    receipt = plan.parent / "receipt.json"
    doc = json.loads(receipt.read_text())
    node = doc
    for k in path[:-1]:
        node = node[k]
    assert node[path[-1]] != value
    node[path[-1]] = value
    receipt.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")))
    assert verify(plan.parent) == [f"{problem}: differs from what the run's files give"]


@pytest.mark.parametrize("worker_out", [
    pytest.param({"proposal.json": "{}"}, id="proposal-refused-on-shape"),
    pytest.param({"proposal.json": json.dumps({"files": [{"path": "../evil", "content": "x"}],
                                               "rationale": "r"})}, id="apply-refuses"),
])
def test_an_honest_run_that_stopped_after_propose_has_a_receipt_that_verifies(
        planned: Freeze, worker_out: dict[str, str]) -> None:
    """The proposal's file was written and bound while the outcome's digest stayed null:
    once verify recomputed the digests from the files, such honest receipts failed."""
    from runner.cycle.receipt import build, verify

    plan = planned()
    outcome = run(plan, fake(script(worker=lambda _c: Result(files=worker_out))))
    assert outcome.result.verdict == "invalid_comparison"
    build(outcome)
    assert verify(plan.parent) == []


def test_a_records_file_that_does_not_read_back_is_a_problem_not_a_crash(
        planned: Freeze) -> None:
    from runner.cycle.receipt import build, verify
    from runner.hashing import sha256_bytes

    plan = planned()
    build(run(plan, fake(script())))
    rec = plan.parent / "stages" / "baseline" / "records.jsonl"
    rec.write_bytes(b"not json\n")
    receipt = plan.parent / "receipt.json"
    doc = json.loads(receipt.read_text())
    doc["files"]["stages/baseline/records.jsonl"] = sha256_bytes(b"not json\n")
    receipt.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")))
    (problem,) = verify(plan.parent)
    assert problem.startswith("the files the receipt binds could not be read back "
                              "(OutputRejected: records.jsonl:1: invalid JSON")


def test_a_record_as_deep_as_an_answer_may_be_reads_back(tmp_path: Path) -> None:
    """helper-42 #1: an answer nested 64 levels (what collect accepts) sits one level down
    in its record, and the line-at-a-time records digest refused it at 64: the cycle
    ended with no receipt and its verdict still claiming accept_for_review. The digest
    reads what the writer writes, with the old value."""
    from runner.cycle.receipt import _records_digest
    from runner.hashing import sha256_json

    answer: Any = ["leaf"]
    for _ in range(63):  # 64 levels: what collect's strict reader accepts in answer.json
        answer = {"trace": answer}
    row = {"case_id": "c", "trial": 0, "status": "ok", "reason": None, "answer": answer,
           "grades": None, "identities": {}}
    p = tmp_path / "records.jsonl"
    p.write_text(json.dumps(row) + "\n")
    assert _records_digest(p) == sha256_json([row])


def test_a_receipt_that_cannot_be_built_leaves_no_verdict_claiming(
        planned: Freeze, monkeypatch: pytest.MonkeyPatch) -> None:
    """helper-42 #1: whatever stops the receipt (not only a full disk), the verdict is
    set aside: no verdict.json says accept_for_review without a receipt beside it."""
    import runner.cycle.receipt as receipt_mod
    from runner.errors import OutputRejected

    plan = planned()
    outcome = run(plan, fake(script()))

    def broken(_path: Path) -> str:
        raise OutputRejected("records.jsonl:1: invalid JSON: nested too deep")

    monkeypatch.setattr(receipt_mod, "_records_digest", broken)
    with pytest.raises(OutputRejected):
        receipt_mod.build_receipt(outcome)
    compare = plan.parent / "stages" / "compare"
    assert not (compare / "verdict.json").exists()
    assert (compare / "verdict.no-receipt.json").is_file()
    assert not (plan.parent / "receipt.json").exists()


def test_a_null_candidate_tree_on_an_applied_run_does_not_verify(planned: Freeze) -> None:
    """attest signed gitTree null beside the real commit."""
    from runner.cycle.receipt import build, verify

    plan = planned()
    build(run(plan, fake(script())))
    receipt = plan.parent / "receipt.json"
    doc = json.loads(receipt.read_text())
    assert doc["outcome"]["candidate_tree"] is not None
    doc["outcome"]["candidate_tree"] = None
    receipt.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")))
    assert verify(plan.parent) == ["outcome.candidate_tree: null, but stages/apply/result.json "
                                   "says applied"]


def test_a_receipt_changed_after_it_was_signed_fails_without_the_key(
        planned: Freeze, tmp_path: Path) -> None:
    from runner.cycle import signing
    from runner.cycle.receipt import build, verify

    plan = planned()
    build(run(plan, fake(script())))
    signing.keygen(tmp_path / "k")
    signing.sign(plan.parent, tmp_path / "k")
    assert verify(plan.parent) == []
    receipt = plan.parent / "receipt.json"
    receipt.write_bytes(receipt.read_bytes().replace(b'"schema":1', b'"schema":1 '))
    assert verify(plan.parent) == ["receipt.dsse.json: its payload is not this receipt.json "
                                   "(the receipt was changed after it was signed)"]


def test_an_answer_over_its_cap_invalidates_that_case_only(planned: Freeze) -> None:
    """answer.json is kept whole in the records: one of 16 MiB (the role's output cap)
    made records.jsonl too large to review or export. Over MAX_ANSWER_BYTES it is
    refused by name; the other cases stand."""
    from runner.cycle.models import MAX_ANSWER_BYTES

    plan = planned()

    def big(call: Call) -> Result:
        if call.case != "d01-revenue-march":
            return analyst(call)
        answer = json.loads(analyst(call).files["answer.json"])
        answer["notes"] = "x" * MAX_ANSWER_BYTES
        return Result(files={"answer.json": json.dumps(answer)})

    run(plan, fake(script(analyst=big)))
    base = records(plan, "baseline")
    assert base["d01-revenue-march"]["status"] == "infra_invalid"
    assert re.match(rf"invalid_output: answer\.json of \d+ bytes is over {MAX_ANSWER_BYTES} ",
                    base["d01-revenue-march"]["reason"])
    assert sum(r["status"] == "ok" for r in base.values()) == POLICY_CASES - 1


def test_an_answer_that_grows_when_stored_is_held_to_the_same_cap(planned: Freeze) -> None:
    """Re-serialised, 1E15 (4 bytes) is written 1000000000000000.0 (18): an answer.json
    under the cap grew about 3.8 times in the records, so some 70 cases made records.jsonl
    too large to review. The cap holds for what the records keep."""
    from runner.cycle.models import MAX_ANSWER_BYTES

    plan = planned()
    grows = "[" + ",".join(["1E15"] * (MAX_ANSWER_BYTES // 6)) + "]"

    def numbers(call: Call) -> Result:
        if call.case != "d01-revenue-march":
            return analyst(call)
        text = analyst(call).files["answer.json"]
        body = text.decode() if isinstance(text, bytes) else text
        return Result(files={"answer.json": body[:-1] + ', "n": ' + grows + "}"})

    run(plan, fake(script(analyst=numbers)))
    base = records(plan, "baseline")
    assert base["d01-revenue-march"]["status"] == "infra_invalid"
    assert re.match(rf"invalid_output: answer\.json is \d+ bytes as stored \(over "
                    rf"{MAX_ANSWER_BYTES};", base["d01-revenue-march"]["reason"])
    assert sum(r["status"] == "ok" for r in base.values()) == POLICY_CASES - 1
    raw = (plan.parent / "stages" / "baseline" / "records.jsonl").read_bytes()
    assert max(len(line) for line in raw.split(b"\n")) < MAX_ANSWER_BYTES


def test_a_failed_evaluator_ends_the_cycle_with_its_stop_reason(planned: Freeze) -> None:
    plan = planned()
    box = fake(script(evaluator=lambda _c: Result(
        exit_code=137, stop_reason=StopReason.OOM, detail="killed by the OOM killer",
        stderr="MemoryError")))
    outcome = run(plan, box)
    assert outcome.result.reasons[0].startswith(
        "evaluate-baseline: evaluator oom: killed by the OOM killer")
    assert "MemoryError" in outcome.result.reasons[0]
    assert box.roles()[-1] == "evaluator"


def test_leftovers_the_sandbox_reports_are_recorded(planned: Freeze) -> None:
    from runner.cycle.receipt import build

    plan = planned()
    outcome = run(plan, fake(script(), leftover_names=["cyclebox-analyst-stuck"]))
    assert outcome.leftovers == ["cyclebox-analyst-stuck"]
    assert build(outcome).leftovers == ("cyclebox-analyst-stuck",)


def test_leftovers_that_cannot_be_checked_are_named(planned: Freeze) -> None:
    plan = planned()
    outcome = run(plan, fake(script(), leftovers_error=SandboxError("engine gone")))
    assert outcome.leftovers == [
        "unknown: leftovers not checked (SandboxError('engine gone'))"]
    assert outcome.failure is not None and outcome.failure.reason == "engine_error"
    assert outcome.result.verdict == "invalid_comparison"
    assert outcome.result.reasons[0].startswith("engine_error: SandboxError: engine gone")


def test_each_role_gets_its_own_uid(planned: Freeze, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway socket and the apply work directory belong to the role that uses them
    (the cycle once gave every role the analyst's uid)."""
    from runner.cycle import run as run_module
    from runner.gateway.server import Gateway
    from runner.paths import PROJECT_ROOT

    roles = yaml.safe_load((PROJECT_ROOT / "policies" / "roles.yaml").read_text())
    uids = {"analyst": 20001, "worker": 20002, "evaluator": 20003, "apply": 20004}
    for role, uid in uids.items():
        roles["roles"][role]["user"] = f"{uid}:{uid}"
    (tmp_path / "roles.yaml").write_text(yaml.safe_dump(roles))
    plan = planned(roles=str(tmp_path / "roles.yaml"))

    bound: list[tuple[str, int]] = []
    real_bound = Gateway.bound

    def spy_bound(self: Gateway, role: str, **kw: Any) -> Any:
        bound.append((role, kw["uid"]))
        return real_bound(self, role, **kw)

    applied: list[int] = []
    real_apply = run_module.apply_proposal

    def spy_apply(*args: Any, **kw: Any) -> Any:
        applied.append(kw["uid"])
        return real_apply(*args, **kw)

    monkeypatch.setattr(Gateway, "bound", spy_bound)
    monkeypatch.setattr(run_module, "apply_proposal", spy_apply)
    outcome = run(plan, fake(script()))
    assert outcome.result.verdict == "accept_for_review", outcome.result.reasons
    # no judge in this cycle: the evaluator gets no gateway socket at all
    assert set(bound) == {("analyst", 20001), ("worker", 20002)}
    assert applied == [20004]


def test_the_endpoint_token_reaches_containers_and_no_file_of_the_run(planned: Freeze) -> None:
    """Model roles get the endpoint environment (key: their role's token); no plan,
    record, receipt, report or log of the run holds a token (RunSpec env is never
    written: a RunRecord has no env)."""
    plan = planned()
    box = fake(script())
    assert run(plan, box).failure is None
    tokens: dict[str, set[str]] = {}
    for spec in box.specs:
        env = dict(spec.env)
        if not any(m.target == CONTAINER_DIR for m in spec.mounts):
            assert "OPENAI_API_KEY" not in env  # no binding, no endpoint
            continue
        assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:40080/v1"
        assert env["ANTHROPIC_API_KEY"] == env["OPENAI_API_KEY"]
        tokens.setdefault(spec.role, set()).add(env["OPENAI_API_KEY"])
    assert set(tokens) == {"analyst", "worker"}  # the example has no judge
    assert all(len(t) == 1 for t in tokens.values())  # per run and role
    assert len(set().union(*tokens.values())) == 2  # never shared between roles
    needles = [t.encode() for ts in tokens.values() for t in ts]
    files = [p for p in plan.parent.rglob("*") if p.is_file() and not p.is_symlink()]
    assert len(files) > 20
    for p in files:
        data = p.read_bytes()
        assert not any(n in data for n in needles), f"a role token is in {p}"


def test_an_invalid_comparison_leaves_the_engine_on_its_usual_waits(planned: Freeze) -> None:
    """A stage that fails (an evaluator killed) is an ordinary end: the run's sweep put
    the engine on 5 s waits for good, and a dream comparison's second arm ran on them."""
    plan = planned()
    box = fake(script(evaluator=lambda _c: Result(
        exit_code=137, stop_reason=StopReason.OOM, detail="killed by the OOM killer")))
    told: list[int] = []
    box.stopping = lambda: told.append(1)  # type: ignore[attr-defined]
    outcome = run(plan, box)
    assert outcome.result.verdict == "invalid_comparison" and outcome.failure is None
    assert told == []


def test_a_signal_just_after_stages_is_made_ends_with_a_verdict(
        planned: Freeze, monkeypatch: pytest.MonkeyPatch) -> None:
    """The signal lands right after ``stages/`` was made, before the path that writes a
    verdict: it left an empty stages/ (no verdict, no receipt, the plan refused as
    already executed)."""
    import signal

    from runner import interrupts

    plan = planned()
    real = Path.mkdir

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        if self == plan.parent / "stages":
            interrupts._handler(signal.SIGINT, None)

    state = interrupts._state
    saved = (state.signals, state.shield, state.pending, state.redeliver, state.handled)
    monkeypatch.setattr(Path, "mkdir", mkdir)
    try:
        outcome = run(plan, fake(script()))
    finally:
        state.signals, state.shield, state.pending, state.redeliver, state.handled = saved
    assert outcome.failure is not None and outcome.failure.reason == "interrupted"
    assert json.loads((plan.parent / "stages/compare/verdict.json").read_text())[
        "verdict"] == "invalid_comparison"


@pytest.mark.parametrize(("role", "error", "reason", "hurried"), [
    ("analyst", SandboxError("the engine went away"), "engine_error", True),
    ("worker", RuntimeError("a bug in the propose stage"), None, False),
], ids=["lost-engine", "crash-in-a-stage"])
def test_only_a_process_ending_cause_puts_the_engine_on_short_waits(
        planned: Freeze, role: str, error: Exception, reason: str | None,
        hurried: bool) -> None:
    """A lost engine ends the process: short waits. A bug in a stage ends the comparison
    invalid, not the process: a dream comparison's second arm then ran on the 5 s waits
    of a stopping run."""
    plan = planned()

    def broken(_c: Call) -> Result:
        raise error

    box = fake(script(**{role: broken}))
    told: list[int] = []
    box.stopping = lambda: told.append(1)  # type: ignore[attr-defined]
    outcome = run(plan, box)
    assert (outcome.failure.reason if outcome.failure else None) == reason
    if reason is None:
        assert outcome.result.reasons[0].startswith("unexpected_error: RuntimeError: a bug")
    assert told == ([1] if hurried else [])
