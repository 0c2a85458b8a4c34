"""The proof loop's decisions as pure functions (SPEC §9); no torch, tested on the host.

Rows from a persona/skill script, epochs from the row count nudged by the feedback
ledger, recall and imprint scores, the classroom and the board.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any

VOICE_PROMPT = "Say something in your own voice."
TINY_DELTA = 0.05


@dataclass(frozen=True)
class Schedule:
    epochs: int
    grad_accum: int
    reason: str


def rows_from_persona(persona: dict[str, Any]) -> list[dict[str, Any]]:
    """One chat row per exchange; each voice example adds a row."""
    system = str(persona.get("system", ""))
    rows = []
    for ex in persona.get("exchanges", []):
        rows.append({"messages": [{"role": "system", "content": system},
                                  {"role": "user", "content": str(ex["user"])},
                                  {"role": "assistant", "content": str(ex["assistant"])}]})
    for v in persona.get("voice_examples", []):
        rows.append({"messages": [{"role": "system", "content": system},
                                  {"role": "user", "content": VOICE_PROMPT},
                                  {"role": "assistant", "content": str(v)}]})
    return rows


def base_schedule(n_rows: int) -> Schedule:
    """Epochs and gradient accumulation from the row count."""
    if n_rows <= 8:
        return Schedule(24, 1, "<=8 rows")
    if n_rows <= 32:
        return Schedule(16, 1, "<=32 rows")
    if n_rows <= 128:
        return Schedule(8, 1, "<=128 rows")
    if n_rows <= 512:
        return Schedule(4, 2, "<=512 rows")
    return Schedule(2, 4, ">512 rows")


def nudge(s: Schedule, last: dict[str, Any] | None) -> Schedule:
    """Adjust by the persona's last ledger row: failed -> more epochs, no accumulation;
    passed with a tiny imprint delta -> four more epochs."""
    if not last:
        return s
    if not last.get("passed"):
        return Schedule(min(40, int(s.epochs * 1.5 + 2)), 1, s.reason + "; last run failed")
    if float(last.get("imprint_delta", 1.0)) < TINY_DELTA:
        return Schedule(s.epochs + 4, s.grad_accum, s.reason + "; last delta tiny")
    return s


def last_row(ledger: list[dict[str, Any]], persona: str) -> dict[str, Any] | None:
    rows = [r for r in ledger if r.get("persona") == persona]
    return rows[-1] if rows else None


def normalize(text: str) -> str:
    t = unicodedata.normalize("NFKC", text).casefold()
    t = re.sub(r"\s+", " ", t).strip()
    return re.sub(r"[\s.!?,;:]+$", "", t)


def similarity(a: str, b: str) -> float:
    return SequenceMatcher(None, normalize(a), normalize(b)).ratio()


def recall(answers: list[str], references: list[str]) -> float:
    """Fraction of probes whose answer reproduces the trained reply (normalized)."""
    if not references:
        return 0.0
    hits = sum(normalize(a).startswith(normalize(r)) for a, r in zip(answers, references,
                                                                      strict=True))
    return hits / len(references)


def imprint(before: list[str], after: list[str], references: list[str]) -> dict[str, float]:
    """Similarity to the reference voice before and after, and how much answers changed."""
    n = max(1, len(references))
    sim_before = sum(similarity(b, r) for b, r in zip(before, references, strict=True)) / n
    sim_after = sum(similarity(a, r) for a, r in zip(after, references, strict=True)) / n
    changed = sum(1 - similarity(b, a) for b, a in zip(before, after, strict=True)) / n
    return {"similarity_before": round(sim_before, 4), "similarity_after": round(sim_after, 4),
            "imprint_delta": round(sim_after - sim_before, 4), "changed": round(changed, 4)}


def classroom(scores: dict[str, float]) -> bool:
    """Passes when the imprint rose and the answers changed."""
    return scores["imprint_delta"] > 0 and scores["changed"] > 0


def board(scores: dict[str, float], recall_after: float, answers: list[str]) -> dict[str, Any]:
    """Rule-based members vote approve/reject; unanimity approves, a majority rejects,
    anything else is a dispute."""
    degenerate = sum(1 for a in answers if not a.strip() or _repetitive(a))
    votes = {
        "recall": "approve" if recall_after >= 0.75 else "reject",
        "imprint": "approve" if scores["imprint_delta"] > 0 else "reject",
        "stability": "approve" if degenerate == 0 else "reject",
    }
    approvals = sum(v == "approve" for v in votes.values())
    decision = ("approve" if approvals == len(votes)
                else "reject" if approvals < len(votes) / 2 else "dispute")
    return {"members": votes, "decision": decision}


def _repetitive(text: str) -> bool:
    words = text.split()
    return len(words) >= 8 and len(set(words)) <= len(words) / 4
