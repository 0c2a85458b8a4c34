"""Dream variants (SPEC §8): paraphrased copies of development tasks for baseline runs and
the brief. Pure functions; the cycle runner does the IO and the model calls.

Invariants: only development-split tasks are ever put in a generation request; a
variant copies its parent's reference and judge, is ``split=train``, ``origin=dream``,
``derived_from=<parent>``, and never enters the comparison's case set; every model
slot that is not accepted falls back to the template for that slot, counted by reason;
template output is byte-stable.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from runner.cycle.models import DEVELOPMENT, TRAIN, Scenario
from runner.isolation.sandbox import Frozen
from runner.loading import show
from sandbox.proposal import strict_json, strip_fence

TEMPLATES = (
    "Please answer this request: {intent}",
    'A colleague asks: "{intent}"',
    "Here is a task for you. {intent}",
)
REASONS = ("generation_error", "malformed_generation", "duplicate", "deterministic_fidelity",
           "missing_semantic_verifier", "semantic_verifier_error", "semantic_reject")
MIN_CHARS, MAX_CHARS = 8, 4000
GEN_MARKER = "Write paraphrases of the task"
VERIFY_MARKER = "Verify each paraphrase"
VERDICT_KEYS = {"index", "equivalent", "constraints_preserved", "judge_compatible", "reason"}
NEGATIONS = frozenset((
    "not", "no", "never", "none", "nothing", "nobody", "neither", "nor", "cannot", "can't",
    "won't", "don't", "doesn't", "didn't", "isn't", "aren't", "wasn't", "weren't", "shouldn't",
    "mustn't", "without", "ignore", "skip", "omit", "drop", "remove", "delete", "disable",
    "bypass", "stop", "except", "excluding", "exclude", "outside", "besides", "instead",
))
APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'", "\u2032": "'",
                             "\uff07": "'"})
"""Typographic apostrophes read as ``'`` (U+2019 and its kin)."""


def intent_of(s: Scenario, key: str) -> str:
    return str(s.input.get(key, ""))


def variant_id(parent: str, k: int) -> str:
    return f"{parent}_dream{k}"


def dream_clashes(spec: Any, scenarios: Iterable[Scenario]) -> list[str]:
    """Ids of ``scenarios`` that a variant of one of their development cases would take
    (``spec``: a DreamSpec; none when dream is off)."""
    if spec.mode == "off":
        return []
    cases = list(scenarios)
    ids = {s.id for s in cases}
    return sorted(v for s in cases if s.split == DEVELOPMENT
                  for v in (variant_id(s.id, k) for k in range(spec.factor)) if v in ids)


def variant(parent: Scenario, k: int, text: str, key: str) -> Scenario:
    """Variant k of a task: same reference/judge, train split, origin dream."""
    return parent.model_copy(update={
        "id": variant_id(parent.id, k), "split": TRAIN, "origin": "dream",
        "derived_from": parent.id, "mandatory": False,
        "input": {**parent.input, key: text}})


def template_text(intent: str, k: int) -> str:
    return TEMPLATES[k % len(TEMPLATES)].format(intent=intent)


def template_variants(parent: Scenario, factor: int, key: str) -> list[Scenario]:
    return [variant(parent, k, template_text(intent_of(parent, key), k), key)
            for k in range(factor)]


# -- generation ------------------------------------------------------------------------
def generation_messages(intent: str, n: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": (
        f"{GEN_MARKER} you are given. Keep its meaning, every constraint, every number, "
        "quoted text, `code` and --flag exactly; change only the wording. Reply with exactly "
        f"one JSON array of {n} strings and nothing else.")},
        {"role": "user", "content": f"Task:\n{intent}\n\nWrite {n} paraphrases."}]


def parse_generation(text: str, n: int) -> list[str] | None:
    """Exactly one JSON array of n strings of 8..4000 chars (whole-message fence stripped)."""
    try:
        obj = strict_json(strip_fence(text.strip()))
    except ValueError:
        return None
    if not isinstance(obj, list) or len(obj) != n:
        return None
    if not all(isinstance(x, str) and MIN_CHARS <= len(x) <= MAX_CHARS for x in obj):
        return None
    return list(obj)


def normalize(text: str) -> str:
    """NFKC, casefold, collapsed whitespace, no trailing punctuation."""
    t = unicodedata.normalize("NFKC", text).casefold()
    t = re.sub(r"\s+", " ", t).strip()
    return re.sub(r"[\s.!?,;:]+$", "", t)


_LITERALS = (re.compile(r"`[^`]+`"), re.compile(r'"[^"]+"'), re.compile(r"'[^'\s][^']*'"),
             re.compile(r"(?<![\w-])--[A-Za-z0-9][\w-]*"),
             re.compile(r"\d+(?:[.,]\d+)?(?:\s?[A-Za-z%]+)?"))


def protected_literals(text: str) -> list[str]:
    """Backtick spans, quoted spans, --flags and numbers (with their unit when present)."""
    found = []
    for pat in _LITERALS:
        found += [m.group(0) for m in pat.finditer(text)]
    return found


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z']+", normalize(text).translate(APOSTROPHES)))


def fidelity_problem(candidate: str, source: str) -> str | None:
    """Why a candidate fails the deterministic checks, or None."""
    c, s = normalize(candidate), normalize(source)
    if len(c) < max(MIN_CHARS, len(s) // 3):
        return "too_short"
    if c == s:
        return "identical"
    if GEN_MARKER.casefold() in c or "json array" in c or "paraphrase" in c:
        return "prompt_echo"
    if len(candidate) > max(MAX_CHARS, 4 * len(source)):
        return "too_long"
    neg_c, neg_s = _words(candidate) & NEGATIONS, _words(source) & NEGATIONS
    if neg_c != neg_s:
        return f"negation_mismatch ({sorted(neg_c ^ neg_s)})"
    cand_norm = unicodedata.normalize("NFKC", candidate)
    for lit in protected_literals(source):
        core = lit.strip("`\"'")
        number = re.match(r"\d+(?:[.,]\d+)?", core)
        needle = number.group(0) if number else core
        if needle not in cand_norm:
            return f"missing_literal ({lit})"
    return None


# -- verification ----------------------------------------------------------------------
def verification_messages(intent: str, candidates: list[tuple[int, str]]) -> list[dict[str, str]]:
    listing = "\n".join(f"{i}: {text}" for i, text in candidates)
    return [{"role": "system", "content": (
        f"{VERIFY_MARKER} against the original task. For each, decide whether it asks for "
        "exactly the same thing (equivalent), keeps every constraint (constraints_preserved) "
        "and would be graded correctly by the original reference and judge "
        "(judge_compatible). Reply with exactly one JSON array with one object per "
        'paraphrase: {"index": <int>, "equivalent": <bool>, "constraints_preserved": <bool>, '
        '"judge_compatible": <bool>, "reason": "<short>"}.')},
        {"role": "user", "content": f"Original task:\n{intent}\n\nParaphrases:\n{listing}"}]


def parse_verdicts(text: str, pending: list[int]) -> dict[int, str]:
    """Slot -> outcome (accept, semantic_reject, semantic_verifier_error,
    missing_semantic_verifier). Any malformed verdict makes the whole reply untrusted."""
    try:
        obj = strict_json(strip_fence(text.strip()))
    except ValueError:
        return dict.fromkeys(pending, "semantic_verifier_error")
    if not isinstance(obj, list):
        return dict.fromkeys(pending, "semantic_verifier_error")
    seen: dict[int, dict[str, Any]] = {}
    for v in obj:
        ok = (isinstance(v, dict) and set(v) == VERDICT_KEYS
              and isinstance(v["index"], int) and not isinstance(v["index"], bool)
              and all(type(v[k]) is bool for k in ("equivalent", "constraints_preserved",
                                                     "judge_compatible"))
              and isinstance(v["reason"], str) and v["index"] not in seen)
        if not ok:
            return dict.fromkeys(pending, "semantic_verifier_error")
        seen[v["index"]] = v
    out = {}
    for i in pending:
        v = seen.get(i)
        if v is None:
            out[i] = "missing_semantic_verifier"
        elif v["equivalent"] and v["constraints_preserved"] and v["judge_compatible"]:
            out[i] = "accept"
        else:
            out[i] = "semantic_reject"
    return out


# -- bookkeeping -----------------------------------------------------------------------
@dataclass
class Slot:
    parent: str
    k: int
    text: str | None = None
    outcome: str = "pending"
    """accept, or one of REASONS (then the template stands in)."""
    detail: str = ""


class DreamSummary(Frozen):
    """The dream stage's ``summary.json`` (and the receipt's ``dream``)."""

    mode: Literal["template", "model"]
    source_tasks: int
    """Development tasks paraphrased."""
    requested: int
    """Variant slots: source tasks times the factor."""
    accepted: int
    """Slots filled by an accepted model paraphrase (always 0 in template mode)."""
    fallback: int
    """Model-mode slots the template filled instead; counted by reason in ``reasons``."""
    reasons: dict[str, int]
    """Every name of :data:`REASONS` -> slots that fell back for it."""
    optimizer_tokens: int
    optimizer_cost_usd: float | None
    """None when any generation or verification call's cost is unknown."""
    cost_complete: bool


@dataclass
class DreamResult:
    variants: list[Scenario]
    summary: DreamSummary
    events: list[dict[str, Any]] = field(default_factory=list)


def screen(slots: list[Slot], sources: dict[str, str], existing: list[str]) -> None:
    """Dedup against existing intents (other tasks, earlier candidates), then fidelity."""
    seen = {normalize(t) for t in existing}
    for slot in slots:
        if slot.outcome != "pending" or slot.text is None:
            continue
        n = normalize(slot.text)
        if n in seen and n != normalize(sources[slot.parent]):
            slot.outcome, slot.detail = "duplicate", "matches an existing intent"
            continue
        problem = fidelity_problem(slot.text, sources[slot.parent])
        if problem:
            slot.outcome, slot.detail = "deterministic_fidelity", problem
            continue
        seen.add(n)


Reply = dict[str, Any]
"""A relay reply: {"ok": True, "text": ...} or {"ok": False, "error": ...}."""


def generation_calls(dev: list[Scenario], factor: int, key: str) -> list[dict[str, Any]]:
    """One generation call per development task (the only tasks that may be sent)."""
    return [{"id": s.id, "messages": generation_messages(intent_of(s, key), factor)}
            for s in dev if s.split == DEVELOPMENT]


def after_generation(dev: list[Scenario], factor: int, key: str, replies: dict[str, Reply],
                     existing: list[str]) -> tuple[list[Slot], list[dict[str, Any]]]:
    """Slots after parsing, dedup and fidelity, plus the verification calls still needed."""
    sources = {s.id: intent_of(s, key) for s in dev}
    slots = [Slot(s.id, k) for s in dev for k in range(factor)]
    for s in dev:
        reply = replies.get(s.id, {"ok": False, "error": "no reply"})
        texts = parse_generation(str(reply["text"]), factor) if reply.get("ok") else None
        for slot in (x for x in slots if x.parent == s.id):
            if not reply.get("ok"):
                slot.outcome, slot.detail = "generation_error", show(reply.get("error"), 300)
            elif texts is None:
                slot.outcome, slot.detail = "malformed_generation", "not one array of N strings"
            else:
                slot.text = texts[slot.k]
    screen(slots, sources, existing)
    calls = []
    for s in dev:
        pending = [(x.k, str(x.text)) for x in slots if x.parent == s.id and
                   x.outcome == "pending"]
        if pending:
            calls.append({"id": s.id, "messages": verification_messages(sources[s.id], pending)})
    return slots, calls


def after_verification(slots: list[Slot], replies: dict[str, Reply]) -> None:
    """Decide every pending slot from the verifier's replies (fail closed)."""
    for parent in sorted({x.parent for x in slots}):
        pending = [x for x in slots if x.parent == parent and x.outcome == "pending"]
        if not pending:
            continue
        reply = replies.get(parent)
        if reply is None:
            outcomes = dict.fromkeys([x.k for x in pending], "missing_semantic_verifier")
        elif not reply.get("ok"):
            outcomes = dict.fromkeys([x.k for x in pending], "semantic_verifier_error")
        else:
            outcomes = parse_verdicts(str(reply["text"]), [x.k for x in pending])
        for x in pending:
            x.outcome = outcomes[x.k]
            if x.outcome != "accept":
                x.detail = show((reply or {}).get("error") or x.outcome, 300)


def finish(slots: list[Slot], parents: dict[str, Scenario], key: str,
           tokens: int, cost: float | None, complete: bool) -> DreamResult:
    """Variants (accepted text or template fallback), per-slot events, run summary."""
    variants: list[Scenario] = []
    events: list[dict[str, Any]] = []
    reasons = dict.fromkeys(REASONS, 0)
    for slot in slots:
        parent = parents[slot.parent]
        if slot.outcome == "accept" and slot.text is not None:
            variants.append(variant(parent, slot.k, slot.text, key))
        else:
            reasons[slot.outcome] += 1
            variants.append(variant(parent, slot.k,
                                    template_text(intent_of(parent, key), slot.k), key))
            events.append({"event": "dream_fallback", "task": slot.parent, "slot": slot.k,
                           "reason": slot.outcome, "detail": slot.detail})
    accepted = sum(s.outcome == "accept" for s in slots)
    summary = DreamSummary(mode="model", source_tasks=len(parents), requested=len(slots),
                           accepted=accepted, fallback=len(slots) - accepted, reasons=reasons,
                           optimizer_tokens=tokens, optimizer_cost_usd=cost,
                           cost_complete=complete)
    return DreamResult(variants=variants, summary=summary, events=events)


def dumps_variants(variants: list[Scenario]) -> str:
    """Byte-stable serialisation of variants."""
    return json.dumps([v.model_dump(mode="json") for v in variants], sort_keys=True,
                      ensure_ascii=False, indent=1) + "\n"
