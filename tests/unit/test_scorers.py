"""Built-in scorers and the evidence rule (sandbox/scoring.py, sandbox/evaluator.py).

Each scorer is pinned on the answers that used to fool substring matching; the evidence
rule on whole tokens, its caps, and an answer that cites everything.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox import evaluator, scoring

TABLES = ["customers", "orders", "order_items", "products"]


def grade(answer: dict[str, Any], scorer: dict[str, Any] | str, value: Any = None,
          evidence: list[str] | None = None, vocabulary: list[str] | None = None,
          max_extra: int = 0) -> dict[str, Any]:
    spec = {"name": scorer} if isinstance(scorer, str) else scorer
    ref = {"scorer": spec, "value": value, "evidence": evidence or []}
    cfg = {"scoring": {"vocabulary": vocabulary or [], "max_extra": max_extra}}
    return evaluator.grade({"case_id": "c", "trial": 0, "answer": answer}, ref, cfg, None)


# -- text --------------------------------------------------------------------------------------
def test_tokens_are_whole_casefolded_words() -> None:
    assert scoring.tokens("FROM orders o JOIN order_items i ON i.order_id = o.id") == [
        "from", "orders", "o", "join", "order_items", "i", "on", "i", "order_id", "o", "id"]
    fullwidth = "\uff21\uff22\uff23"  # fullwidth A, B, C
    assert scoring.tokens(f"Straße, {fullwidth}") == ["strasse", "abc"]  # casefold + NFKC
    long = "x" * (scoring.MAX_TOKEN_CHARS + 1)
    assert scoring.tokens(f"a {long} b") == ["a", None, "b"]


def test_normalize_casefolds_collapses_and_trims_punctuation() -> None:
    assert scoring.normalize("  The  Lyon\tstore.\n") == "the lyon store"
    assert scoring.normalize('"U.S.A."') == "u.s.a"
    assert scoring.normalize("¿Qué?") == "qué"
    assert scoring.normalize("$12") == "$12"  # symbols are not punctuation


@given(st.text(max_size=60))
def test_normalize_is_idempotent(s: str) -> None:
    assert scoring.normalize(scoring.normalize(s)) == scoring.normalize(s)


@given(st.text(max_size=80))
def test_tokens_hold_only_word_characters(s: str) -> None:
    for t in scoring.tokens(s):
        assert t is None or (t and re.fullmatch(r"\w+", t) and len(t) <= scoring.MAX_TOKEN_CHARS)


# -- correctness -------------------------------------------------------------------------------
def test_exact() -> None:
    assert scoring.exact("Lyon", "Lyon")
    assert not scoring.exact("lyon", "Lyon")
    assert not scoring.exact("Lyon ", "Lyon")
    assert scoring.exact(12, 12.0) and scoring.exact(12.5, 12.5)
    assert not scoring.exact("12", 12.0)  # a string is not the number
    assert not scoring.exact(True, 1.0)
    assert not scoring.exact(float("nan"), 1.0)
    huge = 10 ** 400  # valid JSON, past a float's range: False, never OverflowError
    assert not scoring.exact(huge, 42) and not scoring.exact(huge, 1.5)
    assert not scoring.json_field({"a": huge}, 1.5, path="a", match="exact")
    assert scoring.exact(huge, huge) and not scoring.exact(2**53 + 1, 2**53)


def test_normalized_is_equality_not_substring() -> None:
    assert scoring.normalized("  product 17. ", "Product 17")
    listing = ", ".join(f"Product {i}" for i in range(1, 41))
    assert not scoring.normalized(listing, "Product 17")
    assert scoring.contains(listing, "Product 17")  # the explicit opt-in keeps substrings
    assert not scoring.normalized(None, "x") and not scoring.normalized(["x"], "x")
    assert not scoring.normalized("x" * (scoring.MAX_ANSWER_CHARS + 1), "x")
    assert scoring.normalized(42, "42")


def test_number_relative_and_absolute_tolerance() -> None:
    assert scoring.number(100.4, 100, rel_tol=0.005, abs_tol=0)
    assert not scoring.number(100.6, 100, rel_tol=0.005, abs_tol=0)
    assert scoring.number(0.4, 0, rel_tol=0.5, abs_tol=0.5)  # abs_tol rescues zero
    assert not scoring.number(0.4, 0, rel_tol=0.5, abs_tol=0)
    assert scoring.number(" 12.5 ", 12.5, rel_tol=0, abs_tol=0)
    for bad in (True, None, "12 apples", float("inf"), "nan", [12], "1" * 65):
        assert not scoring.number(bad, 12, rel_tol=1, abs_tol=1e9), bad


@given(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e9, max_value=1e9),
       st.floats(allow_nan=False, allow_infinity=False, min_value=-1e9, max_value=1e9),
       st.floats(min_value=0, max_value=1))
def test_legacy_number_kind_keeps_its_old_meaning(got: float, want: float, tol: float) -> None:
    """kind: number maps to rel_tol = abs_tol = tolerance, which is the old formula."""
    from runner.cycle.models import Reference

    old = abs(got - want) <= tol * max(1.0, abs(want))
    spec = Reference(kind="number", value=want, tolerance=tol).selected()
    assert spec is not None
    assert scoring.correctness(spec.model_dump(), got, want) == old


def test_regex_fullmatch_capped_and_case() -> None:
    assert scoring.regex("INV-2026-0042", r"INV-\d{4}-\d{4}", ignore_case=False)
    assert not scoring.regex("see INV-2026-0042", r"INV-\d{4}-\d{4}", ignore_case=False)
    assert scoring.regex("inv-2026-0042", r"INV-\d{4}-\d{4}", ignore_case=True)
    assert scoring.regex(42, r"\d+", ignore_case=False)
    assert not scoring.regex("a" * (scoring.MAX_REGEX_INPUT + 1), "a*", ignore_case=False)
    assert not scoring.regex("a", "a" * (scoring.MAX_PATTERN_CHARS + 1), ignore_case=False)


def test_regex_compiled_once() -> None:
    scoring.compiled.cache_clear()
    for _ in range(5):
        scoring.regex("abc", "a.c", ignore_case=False)
    assert scoring.compiled.cache_info().misses == 1


def test_catastrophic_regex_is_a_named_scorer_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(evaluator, "BUILTIN_TIMEOUT_S", 0.2)
    g = grade({"answer": "a" * 900 + "!"}, {"name": "regex", "pattern": "(a+)+b"})
    assert g["correctness"] is None and "took longer than 0.2s" in g["scorer_error"]


def test_json_field() -> None:
    doc = {"totals": [{"amount": 12.5, "currency": "EUR"}], "city": " lyon "}
    assert scoring.json_field(doc, 12.5, path="totals.0.amount", match="exact")
    assert scoring.json_field('{"totals": [{"amount": 12.5}]}', 12.5, path="totals.0.amount",
                              match="exact")
    assert not scoring.json_field(doc, "12.5", path="totals.0.amount", match="exact")
    assert scoring.json_field(doc, "Lyon", path="city", match="normalized")
    assert not scoring.json_field(doc, "Lyon", path="city", match="exact")
    assert not scoring.json_field(doc, 1, path="totals.1.amount", match="exact")
    assert not scoring.json_field(doc, 1, path="missing", match="exact")
    assert scoring.json_field({"x": None}, None, path="x", match="exact")
    assert not scoring.json_field({}, None, path="x", match="exact")  # absent is not null
    assert not scoring.json_field("not json", 1, path="x", match="exact")
    assert not scoring.json_field("[" * 100_000, 1, path="x", match="exact")
    assert not scoring.json_field({"a": 1}, 1, path=".".join("a" * 17), match="exact")


def test_refusal_and_the_refusal_criterion_elsewhere() -> None:
    assert grade({"refused": True}, "refusal") == {
        "correctness": None, "evidence": None, "refusal": True}
    assert grade({"refused": False, "answer": "x"}, "refusal")["refusal"] is False
    g = grade({"refused": True, "answer": None}, "normalized", "Lyon")
    assert g["refusal"] is False and g["correctness"] is False


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5),
                                                                        c, max_size=4),
                    max_leaves=12))
@settings(max_examples=200)
def test_no_scorer_raises_on_hostile_answers(answer: Any) -> None:
    specs: list[dict[str, Any]] = [
        {"name": "exact"}, {"name": "normalized"}, {"name": "contains"},
        {"name": "number", "rel_tol": 0.01, "abs_tol": 0}, {"name": "regex", "pattern": "a.*"},
        {"name": "json_field", "path": "a.0", "match": "normalized"}]
    for spec in specs:
        for value in ("a", 1.0, None):
            assert isinstance(scoring.correctness(spec, answer, value), bool)
    got = scoring.evidence(answer, ["orders"], vocabulary=TABLES, max_extra=0)
    assert got in (True, False)


# -- evidence ----------------------------------------------------------------------------------
def ev(cited: Any, required: list[str], vocabulary: list[str] = TABLES,
       max_extra: int = 0) -> bool | None:
    return scoring.evidence(cited, required, vocabulary=vocabulary, max_extra=max_extra)


def test_evidence_matches_whole_tokens_only() -> None:
    assert ev(["SELECT COUNT(*) FROM orders"], ["orders"])
    assert not ev(["SELECT 1 FROM sales"], ["l"])  # a one-letter token is not in "sales"
    assert ev(["SELECT l FROM t"], ["l"], vocabulary=[])
    assert not ev(["FROM order_items"], ["orders"])  # order_items is one token
    assert not ev(["FROM reorders"], ["orders"])
    assert ev(["from ORDERS"], ["Orders"])


def test_evidence_phrases_match_contiguously_within_one_item() -> None:
    assert ev(["the order items table"], ["order items"], vocabulary=[])
    assert not ev(["the items of an order"], ["order items"], vocabulary=[])
    assert not ev(["the order", "items table"], ["order items"], vocabulary=[])
    long = "x" * (scoring.MAX_TOKEN_CHARS + 1)
    assert not ev([f"order {long} items"], ["order items"], vocabulary=[])


def test_evidence_caps() -> None:
    assert not ev([], ["orders"])
    assert not ev("orders", ["orders"])  # not a list
    assert not ev([{"t": "orders"}], ["orders"])
    assert not ev(["orders"] + ["x"] * scoring.MAX_EVIDENCE_ITEMS, ["orders"])
    assert not ev(["orders " + "x " * scoring.MAX_CITED_CHARS], ["orders"])
    assert ev(["orders"] * scoring.MAX_EVIDENCE_ITEMS, ["orders"])


def test_evidence_does_not_apply_without_requirements() -> None:
    assert ev(["anything"], []) is None
    assert ev(None, []) is None


def test_citing_everything_is_not_evidence() -> None:
    everything = ["customers orders order_items products"]
    assert not ev(everything, ["orders"])
    assert not ev(["SELECT * FROM orders, customers"], ["orders"])
    assert ev(["SELECT * FROM orders, customers"], ["orders"], max_extra=1)
    assert not ev(everything, ["orders"], max_extra=2)
    assert ev(everything, TABLES)  # a case that really needs every table


def test_a_correct_value_that_cites_everything_does_not_pass() -> None:
    from runner.cycle.models import Grades

    answer = {"answer": 42, "refused": False,
              "evidence": ["SELECT COUNT(*) FROM customers, orders, order_items, products"]}
    g = grade(answer, {"name": "number", "rel_tol": 0, "abs_tol": 0}, 42, ["orders"], TABLES)
    assert g["correctness"] is True and g["evidence"] is False
    assert not Grades.model_validate(g).passed()
    listing = {"answer": ", ".join(f"Product {i:02d}" for i in range(1, 41)), "refused": False,
               "evidence": ["FROM products"]}
    g = grade(listing, "normalized", "Product 17", ["products"], TABLES)
    assert g["correctness"] is False and g["evidence"] is True


@given(st.lists(st.sampled_from(TABLES), min_size=1, unique=True), st.data())
def test_evidence_exact_citation_passes_and_any_extra_fails(required: list[str],
                                                              data: st.DataObject) -> None:
    cited = ["uses " + ", ".join(data.draw(st.permutations(required)))]
    assert ev(cited, required) is True
    spare = [t for t in TABLES if t not in required]
    if spare:
        extra = data.draw(st.sampled_from(spare))
        assert ev([*cited, f"JOIN {extra}"], required) is False
        assert ev([*cited, f"JOIN {extra}"], required, max_extra=1) is True


# -- project scorer results ------------------------------------------------------------------
def test_check_project_grades() -> None:
    assert scoring.check_project_grades({"correctness": True, "evidence": None}) == {
        "correctness": True, "evidence": None}
    for bad, msg in (([True], "expected a dict"), ({"correct": True}, "unknown key"),
                     ({"correctness": "yes"}, "expected true, false or null"),
                     ({"correctness": 1}, "expected true, false or null"),
                     ({"refusal": math.nan}, "expected true")):
        with pytest.raises((TypeError, ValueError), match=msg):
            scoring.check_project_grades(bad)


def test_clip_bounds_and_escapes() -> None:
    out = scoring.clip("a\x1b[31m" + "b" * 1000)
    assert "\x1b" not in out and len(out) <= scoring.MAX_ERROR_CHARS + 1
