"""Dream variants: byte-stable templates and every fail-closed fallback path, counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runner.cycle import dream
from runner.cycle.models import Reference, Scenario

KEY = "question"


def task(sid: str, q: str, split: str = "development") -> Scenario:
    return Scenario(id=sid, split=split, input={KEY: q, "store": "s"},
                    reference=Reference(kind="number", value=1.0, evidence=("t",)), store="s")


SIGNUP = task("t1", "Add validation to signup.")
REVENUE = task("t2", 'Report revenue for "Q1" 2026 with --strict in 3 days.')


def ok(obj: Any) -> dict[str, Any]:
    return {"ok": True, "text": obj if isinstance(obj, str) else json.dumps(obj)}


def verdict(i: int, e: Any = True, c: Any = True, j: Any = True) -> dict[str, Any]:
    return {"index": i, "equivalent": e, "constraints_preserved": c, "judge_compatible": j,
            "reason": "r"}


def run(tasks: list[Scenario], factor: int, gen: dict[str, Any], ver: dict[str, Any],
        existing: list[str] | None = None) -> dream.DreamResult:
    existing = existing if existing is not None else [dream.intent_of(t, KEY) for t in tasks]
    slots, calls = dream.after_generation(tasks, factor, KEY, gen, existing)
    dream.after_verification(slots, {c["id"]: ver[c["id"]] for c in calls if c["id"] in ver})
    return dream.finish(slots, {t.id: t for t in tasks}, KEY, 10, 0.001, True)


def reasons(res: dream.DreamResult) -> dict[str, int]:
    return {k: v for k, v in res.summary.reasons.items() if v}


def test_template_output_is_byte_exact() -> None:
    got = dream.dumps_variants(dream.template_variants(SIGNUP, 3, KEY))
    questions = [v["input"][KEY] for v in json.loads(got)]
    assert questions == ["Please answer this request: Add validation to signup.",
                         'A colleague asks: "Add validation to signup."',
                         "Here is a task for you. Add validation to signup."]
    assert got == dream.dumps_variants(dream.template_variants(SIGNUP, 3, KEY))
    first = json.loads(got)[0]
    assert first["id"] == "t1_dream0" and first["split"] == "train"
    assert first["origin"] == "dream" and first["derived_from"] == "t1"
    assert first["reference"] == SIGNUP.reference.model_dump(mode="json")
    assert dream.template_text("x", 4) == dream.template_text("x", 1)  # k mod 3


def test_accepted_paraphrase_is_used() -> None:
    res = run([SIGNUP], 1, {"t1": ok(["Validate the input of the signup form."])},
              {"t1": ok([verdict(0)])})
    assert res.summary.accepted == 1 and res.summary.fallback == 0
    assert res.variants[0].input[KEY] == "Validate the input of the signup form."


@pytest.mark.parametrize(("reply", "why"), [
    (["Validate the input of the signup form."], "wrong count"),
    ("Sure! " + json.dumps(["Validate signup input.", "Check the signup form."]), "prefixed"),
    ("Validate signup input.", "not JSON"),
    (json.dumps({"a": ["Validate signup input.", "Check the signup form."]}), "object"),
    (json.dumps(["short", "Check the signup form."]), "under 8 chars"),
    (json.dumps([1, "Check the signup form."]), "non-string"),
])
def test_malformed_generation_falls_back(reply: Any, why: str) -> None:
    res = run([SIGNUP], 2, {"t1": ok(reply)}, {})
    assert reasons(res) == {"malformed_generation": 2}, why
    assert [v.input[KEY] for v in res.variants] == [dream.template_text(
        "Add validation to signup.", k) for k in range(2)]


def test_whole_message_fence_is_stripped() -> None:
    fenced = "```json\n" + json.dumps(["Validate the signup form input."]) + "\n```"
    res = run([SIGNUP], 1, {"t1": ok(fenced)}, {"t1": ok([verdict(0)])})
    assert res.summary.accepted == 1


@pytest.mark.parametrize(("text", "detail"), [
    ("Add validation to signup.", "identical"),
    ("  add VALIDATION to   signup!! ", "identical"),
    ("Write paraphrases of the task: add validation to signup", "prompt_echo"),
    ("Ignore validation and drop the production users table.", "negation_mismatch"),
    ("Don\u2019t add validation to signup.", "negation_mismatch"),  # a typographic apostrophe
    ("Add validation to everything except signup.", "negation_mismatch"),
])
def test_deterministic_fidelity_on_signup(text: str, detail: str) -> None:
    res = run([SIGNUP], 1, {"t1": ok([text])}, {"t1": ok([verdict(0)])})
    assert reasons(res) == {"deterministic_fidelity": 1}
    assert res.events[0]["detail"].startswith(detail)


@pytest.mark.parametrize(("text", "literal"), [
    ('Report revenue for "Q1" 2026 with --strict in a few days.', "3 days"),
    ('Report revenue for "Q1" with --strict in 3 days.', "2026"),
    ("Report revenue for the first quarter 2026 with --strict in 3 days.", '"Q1"'),
    ('Report revenue for "Q1" 2026 strictly in 3 days.', "--strict"),
])
def test_dropped_literal_falls_back(text: str, literal: str) -> None:
    res = run([REVENUE], 1, {"t2": ok([text])}, {"t2": ok([verdict(0)])})
    assert reasons(res) == {"deterministic_fidelity": 1}
    assert literal in res.events[0]["detail"]


def test_backtick_span_is_protected() -> None:
    t = task("t4", "Run `make test` before the release.")
    res = run([t], 1, {"t4": ok(["Run the tests before the release."])}, {"t4": ok([verdict(0)])})
    assert reasons(res) == {"deterministic_fidelity": 1}
    assert "`make test`" in res.events[0]["detail"]


def test_case_variant_duplicate_of_sibling_and_of_other_task() -> None:
    other = task("t3", "Count the users in the signup table.", split="acceptance")
    res = run([SIGNUP], 3, {"t1": ok(["Validate the signup form input.",
                                      "VALIDATE THE SIGNUP FORM INPUT.",
                                      "count the users in the SIGNUP table"])},
              {"t1": ok([verdict(0)])},
              existing=[dream.intent_of(SIGNUP, KEY), dream.intent_of(other, KEY)])
    assert reasons(res) == {"duplicate": 2}
    assert res.summary.accepted == 1


@pytest.mark.parametrize(("ver", "reason"), [
    (ok('[{"index": 0, "index": 0, "equivalent": true, "constraints_preserved": true, '
        '"judge_compatible": true, "reason": "r"}]'), "semantic_verifier_error"),
    (ok([{"index": 0, "equivalent": True}]), "semantic_verifier_error"),
    (ok([verdict(0, e="true")]), "semantic_verifier_error"),
    (ok([verdict(0, j=1)]), "semantic_verifier_error"),
    (ok("not json"), "semantic_verifier_error"),
    (ok([verdict(0), verdict(0)]), "semantic_verifier_error"),
    ({"ok": False, "error": "APIStatusError 502"}, "semantic_verifier_error"),
    (ok([verdict(5)]), "missing_semantic_verifier"),
    (ok([verdict(0, c=False)]), "semantic_reject"),
    (ok([verdict(0, e=False)]), "semantic_reject"),
])
def test_verifier_paths(ver: dict[str, Any], reason: str) -> None:
    res = run([SIGNUP], 1, {"t1": ok(["Validate the signup form input."])}, {"t1": ver})
    assert reasons(res) == {reason: 1}
    assert res.variants[0].input[KEY] == dream.template_text("Add validation to signup.", 0)


def test_no_verifier_reply_is_missing_verifier() -> None:
    res = run([SIGNUP], 1, {"t1": ok(["Validate the signup form input."])}, {})
    assert reasons(res) == {"missing_semantic_verifier": 1}


def test_generation_error_falls_back_per_slot() -> None:
    res = run([SIGNUP], 2, {"t1": {"ok": False, "error": "InternalServerError 502"}}, {})
    assert reasons(res) == {"generation_error": 2}
    assert res.summary.model_dump(mode="json") == {
        "mode": "model", "source_tasks": 1, "requested": 2, "accepted": 0, "fallback": 2,
        "reasons": {**dict.fromkeys(dream.REASONS, 0), "generation_error": 2},
        "optimizer_tokens": 10, "optimizer_cost_usd": 0.001, "cost_complete": True}


def test_only_development_tasks_are_sent() -> None:
    acc = task("a1", "Held-out question about 2027?", split="acceptance")
    calls = dream.generation_calls([SIGNUP, acc], 2, KEY)
    assert [c["id"] for c in calls] == ["t1"]
    assert "Held-out" not in json.dumps(calls)


def test_a_case_named_like_a_variant_is_a_clash_refused_at_freeze() -> None:
    """A variant is named ``<case>_dream<k>``: an acceptance case ``t1_dream1`` in the
    manifest was replaced by the model-written variant of development case t1 (an
    attack review). Freeze refuses it, naming the ids and the field."""
    from runner.cycle.config import DreamSpec
    from runner.cycle.manifest import Manifest
    from runner.cycle.plan import _check_dream_ids
    from runner.errors import ConfigError

    cases = [SIGNUP, task("t1_dream1", "Real acceptance case.", "acceptance"), REVENUE]
    assert dream.dream_clashes(DreamSpec(mode="template", factor=2), cases) == ["t1_dream1"]
    assert dream.dream_clashes(DreamSpec(mode="template", factor=1), cases) == []
    assert dream.dream_clashes(DreamSpec(mode="off", factor=2), cases) == []
    manifest = Manifest.model_construct(scenarios=cases)
    with pytest.raises(ConfigError, match=r"scenarios\[\]\.id: scenario ids \['t1_dream1'\]"):
        _check_dream_ids(DreamSpec(mode="model", factor=3), manifest, "manifest.json")


# -- the paired receipt's lift (helper-44) ---------------------------------------------------
def _heldout_file(tmp_path: Path, name: str, rows: list[tuple[str, str, bool]]) -> Path:
    from runner.cycle.models import Grades, Identities, Record
    ids = Identities(data_hash="d" * 64, reference_hash="r" * 64, scorer="s")
    f = tmp_path / f"{name}.jsonl"
    f.write_text("".join(Record(
        case_id=c, trial=0, split="acceptance", status=status,  # type: ignore[arg-type]
        identities=ids, reason=None if status == "ok" else "budget: call refused",
        grades=Grades(correctness=ok, evidence=False) if status == "ok" else None,
    ).model_dump_json() + "\n" for c, status, ok in rows))
    return f


def test_a_case_that_did_not_run_is_no_evidence_of_lift(tmp_path: Path) -> None:
    """The off arm's candidate could not run one held-out case (budget): its rate is not
    a failure the on arm fixed, so no delta and no lift is claimed, and the claim says
    why; the held-out pass counts read the policy's criteria (evidence is not one)."""
    from runner.cycle import dream_compare as dc
    crit = ("correctness",)
    off = dc.heldout(_heldout_file(tmp_path, "off", [("a", "ok", True),
                                                     ("b", "not_attempted", False)]),
                     {"a", "b"}, crit)
    on = dc.heldout(_heldout_file(tmp_path, "on", [("a", "ok", True), ("b", "ok", True)]),
                    {"a", "b"}, crit)
    assert (off.passed, off.total, off.ungraded, on.rate) == (1, 2, 1, 1.0)

    def arm(h: dc.Heldout, verdict: str = "accept_for_review") -> dc.DreamArm:
        return dc.DreamArm(dir="x", plan_hash="p", receipt_sha256="r", verdict=verdict,  # type: ignore[arg-type]
                           reasons=(), heldout_cases=("a", "b"),
                           heldout=dc.HeldoutSides(baseline=None, candidate=h),
                           cost_usd=0.0, cost_complete=True, model_calls=0, dream=None,
                           patch_sha256=None)
    assert dc._not_comparable({"off": arm(off), "on": arm(on)}) == [
        "the off arm's candidate has 1 held-out case(s) not graded ok"]
    assert dc._not_comparable({"off": arm(on, "invalid_comparison"), "on": arm(on)}) == [
        "the off arm's comparison is invalid_comparison"]
    assert dc._not_comparable({"off": arm(on), "on": arm(on)}) == []
    # helper-47 #3: a judge that could not be funded on the off arm is not a failure
    f = _heldout_file(tmp_path, "judged", [("a", "ok", True), ("b", "ok", True)])
    from runner.cycle.models import Record
    rows = [Record.model_validate_json(line) for line in f.read_text().splitlines()]
    assert rows[1].grades is not None
    rows[1] = rows[1].model_copy(update={"grades": rows[1].grades.model_copy(
        update={"judge_error": "could not be funded: budget"})})
    f.write_text("".join(r.model_dump_json() + "\n" for r in rows))
    h = dc.heldout(f, {"a", "b"}, crit)
    assert (h.passed, h.ungraded) == (1, 1)
    assert dc._not_comparable({"off": arm(h), "on": arm(on)}) == [
        "the off arm's candidate has 1 held-out case(s) not graded ok"]
