"""Built-in scorers and the evidence rule: pure functions, standard library only.

Runs inside the evaluator container (sandbox.evaluator) and is imported by the host only
to validate manifests (tokenising evidence, the limits below); it never runs project code.
Every input is hostile: an answer that is too long, of the wrong type or not parseable
scores False, never raises. docs/scorers.md describes each scorer and the evidence rule.

A resolved reference (what the host writes to /ref/references.json) is
``{"scorer": {"name": ..., <options>}, "value": ..., "evidence": [...], ...}``.
"""

from __future__ import annotations

import functools
import json
import math
import re
import unicodedata
from typing import Any

CRITERIA = ("correctness", "evidence", "refusal")
BUILTIN = ("exact", "normalized", "contains", "number", "regex", "json_field", "refusal")
"""Scorer names the evaluator implements itself; ``project`` runs the project's file."""

MAX_ANSWER_CHARS = 10_000
"""A text answer longer than this scores False (never truncated: a prefix could match)."""
MAX_NUMBER_CHARS = 64
"""Longest string read as a number."""
MAX_PATTERN_CHARS = 256
"""Longest regex pattern a reference may declare."""
MAX_REGEX_INPUT = 1_000
"""Longest answer a regex is run on; longer answers score False (bounds backtracking)."""
MAX_JSON_ANSWER_CHARS = 65_536
"""Longest string answer parsed as JSON by json_field."""
MAX_PATH_SEGMENTS = 16
"""Deepest dotted path json_field follows."""
MAX_EVIDENCE_ITEMS = 16
"""More cited evidence items than this: evidence False (citing everything is not evidence)."""
MAX_CITED_CHARS = 16_384
"""Total characters of cited evidence; more: evidence False."""
MAX_TOKEN_CHARS = 64
"""A token longer than this never matches (and a reference may not require one)."""
MAX_PHRASE_TOKENS = 8
"""Tokens in one required evidence entry (a phrase matches as a contiguous run)."""
MAX_ERROR_CHARS = 300
"""Longest scorer_error the evaluator writes."""

_WORD_SPLIT = re.compile(r"\W+")


# -- text ------------------------------------------------------------------------------------
def tokens(text: str) -> list[str | None]:
    """Casefolded word tokens (letters, digits, underscore) of NFKC-normalised ``text``.

    A token longer than :data:`MAX_TOKEN_CHARS` becomes None: it keeps its place (so a
    phrase does not match across it) and matches nothing."""
    norm = unicodedata.normalize("NFKC", text).casefold()
    return [t if len(t) <= MAX_TOKEN_CHARS else None for t in _WORD_SPLIT.split(norm) if t]


def phrase(text: str) -> tuple[str, ...]:
    """The token sequence of a required evidence entry (over-long tokens dropped)."""
    return tuple(t for t in tokens(text) if t is not None)


def normalize(text: str) -> str:
    """NFKC, casefold, whitespace runs collapsed to one space, punctuation and spaces
    trimmed from both ends (inner punctuation is kept: ``U.S.`` -> ``u.s``)."""
    s = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    start, end = 0, len(s)
    while start < end and _trim(s[start]):
        start += 1
    while end > start and _trim(s[end - 1]):
        end -= 1
    return s[start:end]


def _trim(c: str) -> bool:
    return c.isspace() or unicodedata.category(c).startswith("P")


def as_text(v: Any) -> str | None:
    """A string answer, or a number rendered with str(); None for anything else."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, str):
        return v if len(v) <= MAX_ANSWER_CHARS else None
    if isinstance(v, int | float):
        return str(v)
    return None


def as_number(v: Any) -> float | None:
    """A finite float from a JSON number or a short numeric string; None otherwise."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, str) and len(v) > MAX_NUMBER_CHARS:
        return None
    if not isinstance(v, int | float | str):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return x if math.isfinite(x) else None


# -- correctness -----------------------------------------------------------------------------
def exact(got: Any, want: Any) -> bool:
    """A string equals the expected string exactly; a number equals the expected number."""
    if isinstance(want, str):
        return isinstance(got, str) and got == want
    if isinstance(want, bool) or not isinstance(want, int | float):
        return got is None and want is None
    if isinstance(got, bool) or not isinstance(got, int | float):
        return False
    if isinstance(got, int) and isinstance(want, int):
        return got == want  # exact at any size (2**53 + 1 is not 2**53)
    g, w = as_number(got), as_number(want)  # None past a float's range: a 400-digit int
    return g is not None and w is not None and g == w


def normalized(got: Any, want: Any) -> bool:
    """Equal after :func:`normalize` on both sides (numbers rendered with str())."""
    g, w = as_text(got), as_text(want)
    return g is not None and w is not None and normalize(g) == normalize(w)


def contains(got: Any, want: Any) -> bool:
    """The normalised expected text occurs inside the normalised answer (opt-in only)."""
    g, w = as_text(got), as_text(want)
    return g is not None and w is not None and bool(normalize(w)) and \
        normalize(w) in normalize(g)


def number(got: Any, want: Any, *, rel_tol: float, abs_tol: float) -> bool:
    """|got - want| <= max(abs_tol, rel_tol * |want|)."""
    g, w = as_number(got), as_number(want)
    return g is not None and w is not None and abs(g - w) <= max(abs_tol, rel_tol * abs(w))


@functools.lru_cache(maxsize=256)
def compiled(pattern: str, ignore_case: bool) -> re.Pattern[str]:
    """Each pattern is compiled once per evaluator process."""
    return re.compile(pattern, re.IGNORECASE if ignore_case else 0)


def regex(got: Any, pattern: str, *, ignore_case: bool) -> bool:
    """The whole answer (string, or number rendered with str()) matches ``pattern``."""
    g = as_text(got)
    if g is None or len(g) > MAX_REGEX_INPUT or len(pattern) > MAX_PATTERN_CHARS:
        return False
    return compiled(pattern, ignore_case).fullmatch(g) is not None


def json_path(doc: Any, path: str) -> tuple[bool, Any]:
    """(found, value) at a dotted path: object keys, or decimal indexes into arrays."""
    parts = path.split(".")
    if len(parts) > MAX_PATH_SEGMENTS:
        return False, None
    cur = doc
    for part in parts:
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdecimal() and len(part) <= 6 \
                and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return False, None
    return True, cur


def json_field(got: Any, want: Any, *, path: str, match: str) -> bool:
    """The value at ``path`` of the answer (an object, or a string holding JSON) equals
    ``want`` (``match: exact``) or equals it after normalisation (``match: normalized``)."""
    doc = got
    if isinstance(got, str):
        if len(got) > MAX_JSON_ANSWER_CHARS:
            return False
        try:
            doc = json.loads(got)
        except (ValueError, RecursionError):
            return False
    found, value = json_path(doc, path)
    if not found:
        return False
    return normalized(value, want) if match == "normalized" else exact(value, want)


def correctness(spec: dict[str, Any], got: Any, want: Any) -> bool:
    """Correctness under a built-in scorer spec (not refusal, not project)."""
    name = spec.get("name")
    if name == "exact":
        return exact(got, want)
    if name == "normalized":
        return normalized(got, want)
    if name == "contains":
        return contains(got, want)
    if name == "number":
        return number(got, want, rel_tol=float(spec.get("rel_tol", 0.0)),
                      abs_tol=float(spec.get("abs_tol", 0.0)))
    if name == "regex":
        return regex(got, str(spec["pattern"]), ignore_case=bool(spec.get("ignore_case")))
    if name == "json_field":
        return json_field(got, want, path=str(spec["path"]), match=str(spec.get("match")))
    raise ValueError(f"unknown built-in scorer {str(name)[:40]!r}")


# -- evidence --------------------------------------------------------------------------------
def cited_items(evidence: Any) -> list[str] | None:
    """The answer's cited evidence as strings, or None when over a cap or malformed."""
    if not isinstance(evidence, list) or not evidence or len(evidence) > MAX_EVIDENCE_ITEMS:
        return None
    items = [as_text(e) for e in evidence]
    if any(i is None for i in items):
        return None
    out = [i for i in items if i is not None]
    return out if sum(len(i) for i in out) <= MAX_CITED_CHARS else None


def _occurs(needle: tuple[str, ...], hay: list[list[str | None]]) -> bool:
    n = len(needle)
    return n > 0 and any(tuple(toks[i:i + n]) == needle
                         for toks in hay for i in range(len(toks) - n + 1))


def evidence(cited: Any, required: list[str], *, vocabulary: list[str],
             max_extra: int) -> bool | None:
    """The evidence rule (docs/scorers.md): None when nothing is required; otherwise True
    when (1) the citation is a non-empty list of at most MAX_EVIDENCE_ITEMS strings, at
    most MAX_CITED_CHARS in all, (2) every required entry occurs as whole tokens (a phrase
    as a contiguous run, within one item), and (3) at most ``max_extra`` vocabulary
    entries that this case does not require are cited too: an answer citing every table
    is not evidence for any one of them."""
    need = [p for p in (phrase(r) for r in required) if p]
    if not need:
        return None
    items = cited_items(cited)
    if items is None:
        return False
    hay = [tokens(i) for i in items]
    if not all(_occurs(p, hay) for p in need):
        return False
    wanted = set(need)
    extra = {p for p in (phrase(v) for v in vocabulary)
             if p and p not in wanted and _occurs(p, hay)}
    return len(extra) <= max_extra


# -- project scorer results ------------------------------------------------------------------
def check_project_grades(obj: Any) -> dict[str, bool | None]:
    """What a project scorer returned, if it is a mapping of criterion -> bool or None;
    TypeError or ValueError naming the first problem otherwise."""
    if not isinstance(obj, dict):
        raise TypeError(f"returned {type(obj).__name__}, expected a dict of criterion -> "
                         "bool or None")
    unknown = [k for k in obj if k not in CRITERIA]
    if unknown:
        raise ValueError(f"returned unknown key {clip(str(unknown[0]), 40)!r}; "
                         f"allowed: {', '.join(CRITERIA)}")
    bad = [k for k, v in obj.items() if v is not None and not isinstance(v, bool)]
    if bad:
        raise ValueError(f"{bad[0]} is {type(obj[bad[0]]).__name__}, expected true, false "
                         "or null")
    return {k: obj[k] for k in CRITERIA if k in obj}


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """Printable and bounded (control characters escaped), for error strings."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return out[:limit] + ("…" if len(text) > limit else "")
