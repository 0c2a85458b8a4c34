"""The proof loop's pure decisions (SPEC §9): persona rows, the epoch schedule and its
ledger nudge, recall, imprint, classroom and board. One parametrized row per SPEC rule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sandbox.train.plan import (
    TINY_DELTA,
    VOICE_PROMPT,
    Schedule,
    base_schedule,
    board,
    classroom,
    imprint,
    last_row,
    nudge,
    recall,
    rows_from_persona,
)

# -- schedule from the row count ---------------------------------------------------------


@pytest.mark.parametrize(("n_rows", "epochs", "grad_accum"), [
    pytest.param(1, 24, 1, id="1-row-<=8"),
    pytest.param(8, 24, 1, id="8-rows-<=8-upper-edge"),
    pytest.param(9, 16, 1, id="9-rows-<=32-lower-edge"),
    pytest.param(32, 16, 1, id="32-rows-<=32-upper-edge"),
    pytest.param(33, 8, 1, id="33-rows-<=128-lower-edge"),
    pytest.param(128, 8, 1, id="128-rows-<=128-upper-edge"),
    pytest.param(129, 4, 2, id="129-rows-<=512-lower-edge"),
    pytest.param(512, 4, 2, id="512-rows-<=512-upper-edge"),
    pytest.param(513, 2, 4, id="513-rows-more"),
    pytest.param(10_000, 2, 4, id="10000-rows-more"),
])
def test_base_schedule_boundaries(n_rows: int, epochs: int, grad_accum: int) -> None:
    s = base_schedule(n_rows)
    assert (s.epochs, s.grad_accum) == (epochs, grad_accum)
    assert s.reason


# -- nudge by the feedback ledger -------------------------------------------------------

FAILED = {"persona": "p", "passed": False, "imprint_delta": 0.3}


@pytest.mark.parametrize(("start", "last", "epochs", "grad_accum", "reason_part"), [
    # failed -> min(40, epochs * 1.5 + 2), grad-accum 1
    pytest.param(Schedule(24, 1, "r"), FAILED, 38, 1, "failed", id="failed-24->38"),
    pytest.param(Schedule(16, 1, "r"), FAILED, 26, 1, "failed", id="failed-16->26"),
    pytest.param(Schedule(8, 1, "r"), FAILED, 14, 1, "failed", id="failed-8->14"),
    pytest.param(Schedule(4, 2, "r"), FAILED, 8, 1, "failed", id="failed-4->8-accum-reset"),
    pytest.param(Schedule(2, 4, "r"), FAILED, 5, 1, "failed", id="failed-2->5-accum-reset"),
    pytest.param(Schedule(26, 1, "r"), FAILED, 40, 1, "failed",
                 id="failed-cap-26->41-capped-40"),
    pytest.param(Schedule(28, 2, "r"), FAILED, 40, 1, "failed",
                 id="failed-cap-28->44-capped-40"),
    pytest.param(Schedule(24, 1, "r"), {"persona": "p"}, 38, 1, "failed",
                 id="no-passed-flag-counts-as-failed"),
    # passed with a tiny delta (< 0.05) -> +4 epochs, grad-accum kept
    pytest.param(Schedule(24, 1, "r"), {"passed": True, "imprint_delta": 0.0}, 28, 1, "tiny",
                 id="passed-tiny-0.0-+4"),
    pytest.param(Schedule(4, 2, "r"), {"passed": True, "imprint_delta": 0.049}, 8, 2, "tiny",
                 id="passed-tiny-0.049-+4-keeps-accum"),
    pytest.param(Schedule(2, 4, "r"), {"passed": True, "imprint_delta": -0.2}, 6, 4, "tiny",
                 id="passed-negative-delta-+4-keeps-accum"),
    # passed with a larger delta -> unchanged
    pytest.param(Schedule(24, 1, "r"), {"passed": True, "imprint_delta": TINY_DELTA}, 24, 1,
                 None, id="passed-delta-0.05-not-tiny-unchanged"),
    pytest.param(Schedule(4, 2, "r"), {"passed": True, "imprint_delta": 0.4}, 4, 2, None,
                 id="passed-delta-0.4-unchanged"),
    pytest.param(Schedule(16, 1, "r"), {"passed": True}, 16, 1, None,
                 id="passed-no-delta-unchanged"),
    # no last row -> unchanged
    pytest.param(Schedule(24, 1, "r"), None, 24, 1, None, id="no-last-row-unchanged"),
    pytest.param(Schedule(4, 2, "r"), None, 4, 2, None, id="no-last-row-keeps-accum"),
])
def test_nudge(start: Schedule, last: dict[str, Any] | None, epochs: int, grad_accum: int,
               reason_part: str | None) -> None:
    s = nudge(start, last)
    assert (s.epochs, s.grad_accum) == (epochs, grad_accum)
    if reason_part is None:
        assert s == start
    else:
        assert s.reason.startswith(start.reason) and reason_part in s.reason


def test_nudge_on_base_schedule_matches_spec_formula() -> None:
    for n in (1, 9, 33, 129, 513):
        s = base_schedule(n)
        assert nudge(s, FAILED).epochs == min(40, int(s.epochs * 1.5 + 2))


# -- the persona's last ledger row ------------------------------------------------------

LEDGER = [
    {"persona": "ada", "passed": False, "n": 1},
    {"persona": "bob", "passed": True, "n": 2},
    {"persona": "ada", "passed": True, "n": 3},
    {"persona": "bob", "passed": False, "n": 4},
    {"persona": "cy", "passed": True, "n": 5},
]


@pytest.mark.parametrize(("persona", "n"), [
    pytest.param("ada", 3, id="most-recent-of-two-ignoring-later-bob"),
    pytest.param("bob", 4, id="most-recent-interleaved"),
    pytest.param("cy", 5, id="single-row"),
    pytest.param("dee", None, id="persona-absent"),
])
def test_last_row(persona: str, n: int | None) -> None:
    row = last_row(LEDGER, persona)
    if n is None:
        assert row is None
    else:
        assert row is not None and row["persona"] == persona and row["n"] == n


def test_last_row_empty_ledger_and_nudge_of_it() -> None:
    assert last_row([], "ada") is None
    s = base_schedule(3)
    assert nudge(s, last_row([], "ada")) == s
    # a failure of another persona does not nudge this one
    assert nudge(s, last_row([{"persona": "bob", "passed": False}], "ada")) == s


# -- rows from a persona/skill script ---------------------------------------------------

PERSONA = {
    "name": "ada",
    "system": "You are Ada.",
    "exchanges": [{"user": "Who are you?", "assistant": "I am Ada."},
                  {"user": "Favourite number?", "assistant": 7}],
    "voice_examples": ["Numbers sing.", "Engines weave patterns."],
}


@pytest.mark.parametrize(("persona", "n_rows"), [
    pytest.param({"system": "s", "exchanges": [{"user": "u", "assistant": "a"}]}, 1,
                 id="one-row-per-exchange"),
    pytest.param({"system": "s", "exchanges": [{"user": f"u{i}", "assistant": f"a{i}"}
                                               for i in range(5)]}, 5, id="five-exchanges"),
    pytest.param({"system": "s", "voice_examples": ["v1", "v2"]}, 2,
                 id="voice-examples-add-rows"),
    pytest.param(PERSONA, 4, id="exchanges-plus-voice"),
    pytest.param({"name": "empty"}, 0, id="empty-script"),
])
def test_rows_count(persona: dict[str, Any], n_rows: int) -> None:
    assert len(rows_from_persona(persona)) == n_rows


def test_rows_content_and_system_prompt_on_every_row() -> None:
    rows = rows_from_persona(PERSONA)
    assert rows == [
        {"messages": [{"role": "system", "content": "You are Ada."},
                      {"role": "user", "content": "Who are you?"},
                      {"role": "assistant", "content": "I am Ada."}]},
        {"messages": [{"role": "system", "content": "You are Ada."},
                      {"role": "user", "content": "Favourite number?"},
                      {"role": "assistant", "content": "7"}]},
        {"messages": [{"role": "system", "content": "You are Ada."},
                      {"role": "user", "content": VOICE_PROMPT},
                      {"role": "assistant", "content": "Numbers sing."}]},
        {"messages": [{"role": "system", "content": "You are Ada."},
                      {"role": "user", "content": VOICE_PROMPT},
                      {"role": "assistant", "content": "Engines weave patterns."}]},
    ]
    assert all(r["messages"][0] == {"role": "system", "content": "You are Ada."} for r in rows)


def test_rows_without_system_still_carry_a_system_message() -> None:
    rows = rows_from_persona({"exchanges": [{"user": "u", "assistant": "a"}],
                              "voice_examples": ["v"]})
    assert [r["messages"][0] for r in rows] == [{"role": "system", "content": ""}] * 2


def test_row_count_drives_schedule() -> None:
    persona = {"system": "s", "exchanges": [{"user": str(i), "assistant": str(i)}
                                            for i in range(7)], "voice_examples": ["a", "b"]}
    rows = rows_from_persona(persona)
    assert len(rows) == 9
    assert base_schedule(len(rows)).epochs == 16


# -- recall -----------------------------------------------------------------------------


@pytest.mark.parametrize(("answers", "refs", "expected"), [
    pytest.param(["I am Ada."], ["I am Ada."], 1.0, id="exact"),
    pytest.param(["  i   AM ada!!  "], ["I am Ada."], 1.0,
                 id="normalized-case-space-trailing-punct"),
    pytest.param(["I am Ada. And more words follow."], ["I am Ada."], 1.0,
                 id="answer-starts-with-reference"),
    pytest.param(["Well, I am Ada."], ["I am Ada."], 0.0, id="reference-not-at-start"),
    pytest.param(["I am Ad"], ["I am Ada."], 0.0, id="truncated-answer-misses"),
    pytest.param(["I am Ada.", "nope", "Seven", "x"], ["I am Ada.", "7", "seven", "y"], 0.5,
                 id="fraction-of-probes"),
    pytest.param([], [], 0.0, id="no-probes-zero"),
])
def test_recall(answers: list[str], refs: list[str], expected: float) -> None:
    assert recall(answers, refs) == expected


def test_recall_length_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="zip"):
        recall(["a"], ["a", "b"])


# -- imprint ----------------------------------------------------------------------------


def test_imprint_rose_and_changed() -> None:
    refs = ["Numbers sing to me.", "Engines weave patterns."]
    before = ["I do not know.", "Hello there."]
    s = imprint(before, refs, refs)
    assert s["similarity_after"] == 1.0
    assert s["similarity_before"] < 0.5
    assert s["imprint_delta"] == round(s["similarity_after"] - s["similarity_before"], 4)
    assert s["imprint_delta"] > 0 and s["changed"] > 0
    assert set(s) == {"similarity_before", "similarity_after", "imprint_delta", "changed"}


def test_imprint_unchanged_answers() -> None:
    refs = ["Numbers sing."]
    s = imprint(["Hello."], ["Hello."], refs)
    assert s["imprint_delta"] == 0.0 and s["changed"] == 0.0
    assert s["similarity_before"] == s["similarity_after"]


def test_imprint_fell() -> None:
    refs = ["Numbers sing."]
    s = imprint(["numbers sing!"], ["Completely unrelated output"], refs)
    assert s["similarity_before"] == 1.0  # normalization: case and trailing punctuation
    assert s["imprint_delta"] < 0 and s["changed"] > 0


def test_imprint_values_are_rounded_to_4_places() -> None:
    s = imprint(["abc"], ["abd"], ["abcdefg"])
    assert all(round(v, 4) == v for v in s.values())


def test_imprint_empty() -> None:
    assert imprint([], [], []) == {"similarity_before": 0.0, "similarity_after": 0.0,
                                   "imprint_delta": 0.0, "changed": 0.0}


# -- classroom: passes when the imprint rose and the answers changed ---------------------


@pytest.mark.parametrize(("delta", "changed", "passed"), [
    pytest.param(0.2, 0.3, True, id="rose-and-changed-passes"),
    pytest.param(0.0001, 0.0001, True, id="barely-rose-barely-changed-passes"),
    pytest.param(0.0, 0.3, False, id="imprint-flat-fails"),
    pytest.param(-0.1, 0.3, False, id="imprint-fell-fails"),
    pytest.param(0.2, 0.0, False, id="answers-unchanged-fails"),
    pytest.param(-0.1, 0.0, False, id="fell-and-unchanged-fails"),
])
def test_classroom(delta: float, changed: float, passed: bool) -> None:
    assert classroom({"imprint_delta": delta, "changed": changed}) is passed


# -- board: unanimity approves, a majority of rejects rejects, else dispute --------------

GOOD = ["I am Ada.", "Numbers sing."]
REPETITIVE = "la la la la la la la la"  # 8 words, 1 distinct


@pytest.mark.parametrize(("delta", "recall_after", "answers", "decision", "rejecters"), [
    pytest.param(0.2, 1.0, GOOD, "approve", set(), id="all-approve"),
    pytest.param(0.2, 0.75, GOOD, "approve", set(), id="recall-0.75-edge-approves"),
    pytest.param(0.2, 0.74, GOOD, "dispute", {"recall"}, id="recall-low-only-dispute"),
    pytest.param(0.0, 1.0, GOOD, "dispute", {"imprint"}, id="imprint-flat-only-dispute"),
    pytest.param(0.2, 1.0, [*GOOD, "   "], "dispute", {"stability"},
                 id="blank-answer-dispute"),
    pytest.param(0.2, 1.0, [*GOOD, REPETITIVE], "dispute", {"stability"},
                 id="repetitive-answer-dispute"),
    pytest.param(0.2, 1.0, [*GOOD, "la la la la la la la"], "approve", set(),
                 id="7-repeated-words-not-degenerate"),
    pytest.param(0.2, 1.0, [*GOOD, "a b a b a b a b"], "dispute", {"stability"},
                 id="8-words-2-distinct-degenerate"),
    pytest.param(0.2, 1.0, [*GOOD, "a b c a b c a b"], "approve", set(),
                 id="8-words-3-distinct-not-degenerate"),
    pytest.param(-0.1, 0.5, GOOD, "reject", {"recall", "imprint"},
                 id="recall-and-imprint-reject"),
    pytest.param(0.2, 0.0, [""], "reject", {"recall", "stability"},
                 id="recall-and-stability-reject"),
    pytest.param(0.0, 0.0, [REPETITIVE], "reject", {"recall", "imprint", "stability"},
                 id="all-reject"),
])
def test_board(delta: float, recall_after: float, answers: list[str], decision: str,
               rejecters: set[str]) -> None:
    b = board({"imprint_delta": delta, "changed": 0.5}, recall_after, answers)
    assert b["decision"] == decision
    assert set(b["members"]) == {"recall", "imprint", "stability"}
    assert {k for k, v in b["members"].items() if v == "reject"} == rejecters
    assert all(v in {"approve", "reject"} for v in b["members"].values())


# -- the host settles the proof loop itself ---------------------------------------------------

FIGURES = {"steps": 24, "epochs": 24, "grad_accum": 1, "lr": 0.002, "train_tokens": 900,
           "seconds": 6.1, "tokens_per_s": 147.5, "final_loss": 0.4, "peak_rss_mb": 812.3}


def _honest(after: list[str]) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
    """A persona and what an honest trainer writes for it, from the same pure functions."""
    from runner.train.results import LedgerRow, Persona, ProofReceipt, ProofReport

    persona = Persona.model_validate({"name": "cap", "exchanges": [
        {"user": "who are you?", "assistant": "Captain Arr."},
        {"user": "where to?", "assistant": "The north sea."}]})
    refs = ["Captain Arr.", "The north sea."]
    before = ["i am a model", "nowhere"]
    s = imprint(before, after, refs)
    rb, ra = recall(before, refs), recall(after, refs)
    b = board(s, ra, after)
    report = ProofReport.model_validate({
        "persona": "cap", "schedule": {"epochs": 24, "grad_accum": 1, "reason": "<=8 rows"},
        "figures": FIGURES, "probes": ["who are you?", "where to?"], "references": refs,
        "before": before, "after": after, "recall_before": rb, "recall_after": ra,
        "scores": s, "classroom_passed": classroom(s), "board": b})
    receipt = ProofReceipt.model_validate({
        "schema": 1, "kind": "proof", "config": {}, "config_sha256": "c",
        "dataset_sha256": "d", "adapter_files": {}, "base_model_files": {},
        "recall_before": rb, "recall_after": ra, "scores": s,
        "classroom_passed": classroom(s), "board": b["decision"]})
    row = LedgerRow(persona="cap", passed=classroom(s), rows=2, epochs=24, grad_accum=1,
                    imprint_delta=s["imprint_delta"], recall_before=rb, recall_after=ra,
                    board=b["decision"])
    return persona, report, receipt, row, s


def test_the_host_settles_an_honest_proof_run_and_builds_its_ledger_row() -> None:
    from runner.train.host import settle

    persona, report, receipt, row, _ = _honest(["Captain Arr. Aye", "The north sea, lad"])
    assert settle(persona, [], report, receipt, row, 0) == row
    persona, report, receipt, row, _ = _honest(["i am a model", "nowhere"])
    assert not row.passed
    assert settle(persona, [], report, receipt, row, 4) == row


@pytest.mark.parametrize(("where", "change", "match"), [
    pytest.param("report", {"scores": {"similarity_before": 0, "similarity_after": 1,
                                       "imprint_delta": 0.9, "changed": 1}},
                 "scores", id="claimed-imprint"),
    pytest.param("report", {"classroom_passed": True}, "scores", id="claimed-classroom"),
    pytest.param("report", {"board": {"members": {"recall": "reject"}, "decision": "approve"}},
                 "scores", id="board-against-its-vote"),
    pytest.param("report", {"probes": [], "references": [], "before": [], "after": []},
                 "exchanges", id="no-probes"),
    pytest.param("report", {"after": ["i am a model"]}, "number of probes", id="short"),
    pytest.param("report", {"persona": "other"}, "name", id="other-persona"),
    pytest.param("report", {"schedule": {"epochs": 2, "grad_accum": 1, "reason": "<=8 rows"}},
                 "schedule", id="schedule"),
    pytest.param("receipt", {"scores": {"similarity_before": 0, "similarity_after": 1,
                                        "imprint_delta": 0.9, "changed": 1}},
                 "receipt", id="receipt-scores"),
    pytest.param("row", {"passed": True, "imprint_delta": 0.9}, "ledger row", id="row"),
    pytest.param("row", {"persona": "someone-else"}, "ledger row", id="row-other-persona"),
    pytest.param("exit", 0, "exit code", id="exit-0-on-a-fail"),
])
def test_a_trainer_that_claims_what_its_answers_do_not_show_is_refused(
        where: str, change: Any, match: str) -> None:
    """The trainer writes the answers; pass or fail, the board and the ledger row are the
    host's to decide (a trainer exiting 0 with a report saying the imprint fell, or a
    board approving against its only vote, used to pass and reach the ledger)."""
    from runner.errors import IntegrityError
    from runner.train.host import settle

    persona, report, receipt, row, _ = _honest(["i am a model", "nowhere"])  # fails
    code = 4
    if where == "report":
        report = report.model_validate({**report.model_dump(), **change})
    elif where == "receipt":
        receipt = receipt.model_validate({**receipt.model_dump(by_alias=True), **change})
    elif where == "row":
        row = row.model_validate({**row.model_dump(), **change})
    else:
        code = change
    with pytest.raises(IntegrityError, match=match):
        settle(persona, [], report, receipt, row, code)


def test_an_answer_longer_than_the_trainer_can_generate_is_refused_before_scoring(
        tmp_path: Path) -> None:
    """The host recomputes the similarity of every answer (difflib: cubic in the worst
    case); a trainer answering with 20 000 characters held the host's settle for minutes.
    The report is refused as it is read, naming the answer, long before any scoring."""
    from runner.errors import OutputRejected
    from runner.isolation.collect import Limits, collect
    from runner.train.host import _collected
    from runner.train.results import MAX_ANSWER_CHARS, ProofReport

    _, report, *_ = _honest(["Captain Arr. Aye", "The north sea, lad"])
    ok = report.model_dump(mode="json")
    long = {**ok, "after": [ok["after"][0], "x" * (MAX_ANSWER_CHARS + 1)]}
    for name, doc in (("ok", ok), ("long", long)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(doc))
    files = collect(tmp_path / "ok", Limits(max_file_bytes=1 << 20, max_total_bytes=1 << 20))
    assert _collected(files, "report.json", ProofReport) == report
    files = collect(tmp_path / "long", Limits(max_file_bytes=1 << 20, max_total_bytes=1 << 20))
    with pytest.raises(OutputRejected, match=r"after\[1\]: String should have at most 2048"):
        _collected(files, "report.json", ProofReport)


class _NoTrainer:
    """A trainer never reached: every input is checked before --out is made."""

    def fresh_output(self, p: Path) -> Path:
        raise AssertionError("--out made before the inputs were checked")


class _MakesOut:
    """A trainer that makes --out, as the sandbox does, and nothing else."""

    def fresh_output(self, p: Path) -> Path:
        p.mkdir()
        return p


def _proof_inputs(tmp_path: Path) -> Path:
    """A one-exchange persona (``tmp_path/persona.yaml``) and a base model directory;
    returns the base."""
    (tmp_path / "persona.yaml").write_text(
        "name: cap\nexchanges:\n  - user: who?\n    assistant: Captain.\n")
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    return base


def _train(command: str, tmp_path: Path, base: Path) -> None:
    """``proof`` (persona and ledger in ``tmp_path``) or ``sft`` (an empty corpus there)
    into ``tmp_path/out`` with a trainer that only makes --out."""
    from runner.train import host

    if command == "proof":
        host.proof(_MakesOut(), tmp_path / "persona.yaml", base, tmp_path / "out",  # type: ignore[arg-type]
                   ledger=tmp_path / "ledger.jsonl", lr=1e-3, seed=0, on_event=lambda e: None)
    else:
        corpus = tmp_path / "corpus"
        corpus.mkdir()
        (corpus / "trajectories.jsonl").write_text("")
        host.sft(_MakesOut(), corpus, base, tmp_path / "out", lr=1e-3, seed=0,  # type: ignore[arg-type]
                 epochs=None, on_event=lambda e: None)


@pytest.mark.parametrize(("ledger", "match"), [
    pytest.param(b"\xff\xfe{}\n", "not UTF-8", id="not-utf8"),
    pytest.param(b'{"persona": "cap"}\nnot json\n', "line 2 is not JSON", id="bad-line"),
    # the trainer's schedule reads imprint_delta with float(): its traceback was exit 6
    # after the engine started, --out left behind
    pytest.param(b'{"persona": "cap", "passed": true, "imprint_delta": "tiny"}\n',
                 r"ledger.jsonl:1.*imprint_delta: Input should be a valid number",
                 id="imprint-delta-not-a-number"),
    pytest.param(b'{"persona": "cap", "passed": true, "imprint_delta": null}\n',
                 r"ledger.jsonl:1.*imprint_delta", id="imprint-delta-null"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000 + b"\n", "line 1 is not JSON .nested",
                 id="deep-line-was-exit-10"),
    pytest.param(b'{"persona": "cap", "passed": true, "passed": false}\n',
                 "line 1 is not JSON .duplicate", id="duplicate-key"),
])
def test_a_bad_ledger_is_named_before_the_output_directory_is_made(
        tmp_path: Path, ledger: bytes, match: str) -> None:
    """The ledger was read after --out was made: a non-UTF-8 one was exit 10 and left
    --out behind, so the corrected rerun was refused as 'already exists'."""
    from runner.errors import ConfigError
    from runner.train import host

    base = _proof_inputs(tmp_path)
    (tmp_path / "ledger.jsonl").write_bytes(ledger)
    with pytest.raises(ConfigError, match=match):
        host.proof(_NoTrainer(), tmp_path / "persona.yaml", base, tmp_path / "out",  # type: ignore[arg-type]
                   ledger=tmp_path / "ledger.jsonl", lr=1e-3, seed=0, on_event=lambda e: None)
    assert not (tmp_path / "out").exists()


def test_a_trainer_json_file_past_the_json_cap_is_refused_unparsed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's output may hold 1 GiB files (adapter weights), and its JSON files
    were parsed at any size up to that: 128 MiB of ``[[],[],...]`` in report.json took
    3.4 GB of the host's memory. Past the JSON cap of any file the host loads, the file
    is refused by name, never parsed."""
    from runner.errors import OutputRejected
    from runner.isolation.collect import collect
    from runner.loading import MAX_BYTES
    from runner.train import host
    from runner.train.results import ProofReport

    (tmp_path / "report.json").write_bytes(b"[" + b"[]," * (MAX_BYTES // 3) + b"[]]")
    files = collect(tmp_path, host.TRAINER_OUTPUT)
    parsed: list[bytes] = []
    real = host.parse_model
    monkeypatch.setattr(host, "parse_model",
                        lambda raw, *a, **k: parsed.append(raw) or real(raw, *a, **k))
    with pytest.raises(OutputRejected, match=r"report.json is \d+ bytes; the host parses "
                       r"at most"):
        host._collected(files, "report.json", ProofReport)
    assert parsed == []


@pytest.mark.parametrize("taken", ["file", "symlink", "dangling", "directory"])
def test_a_taken_summary_path_is_refused_before_the_output_directory_is_made(
        tmp_path: Path, taken: str) -> None:
    """OUT.summary.json was written after the training with write_text: through a symlink
    (overwriting its target), over an earlier run's summary, and a directory there ended
    the proof in exit 10 after the ledger row was appended, --out not handed over."""
    from runner.errors import ConfigError
    from runner.train import host

    base = _proof_inputs(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("evidence")
    summary = tmp_path / "out.summary.json"
    if taken == "file":
        summary.write_text("an earlier run's summary")
    elif taken == "symlink":
        summary.symlink_to(victim)
    elif taken == "dangling":
        summary.symlink_to(tmp_path / "nowhere")
    else:
        summary.mkdir()
    with pytest.raises(ConfigError, match=r"out\.summary\.json already exists"):
        host.proof(_NoTrainer(), tmp_path / "persona.yaml", base, tmp_path / "out",  # type: ignore[arg-type]
                   ledger=tmp_path / "ledger.jsonl", lr=1e-3, seed=0, on_event=lambda e: None)
    assert not (tmp_path / "out").exists() and victim.read_text() == "evidence"


@pytest.mark.parametrize("command", ["proof", "sft"])
def test_a_stale_inputs_directory_is_named_and_out_is_not_left_behind(
        tmp_path: Path, command: str) -> None:
    """A training run killed before its cleanup leaves OUT's hidden sibling .OUT.in; the
    next run with that --out ended in exit 10 (FileExistsError), and proof left --out
    behind, so the rerun after removing it was refused as 'already exists'."""
    from runner.errors import ConfigError

    base = _proof_inputs(tmp_path)
    stale = tmp_path / ".out.in"
    stale.mkdir()
    (stale / "kept").write_text("x")
    with pytest.raises(ConfigError, match=r"\.out\.in exists.*killed"):
        _train(command, tmp_path, base)
    assert not (tmp_path / "out").exists() and (stale / "kept").read_text() == "x"


@pytest.mark.parametrize(("lie", "match"), [
    pytest.param({}, None, id="honest"),
    pytest.param({"dataset_sha256": "0" * 64}, "dataset_sha256", id="other-dataset"),
    pytest.param({"corpus_sha256": "0" * 64}, "corpus_sha256", id="other-corpus"),
    pytest.param({"config": {"lr": 0.9, "seed": 0, "include_failed": False}},
                 "config_sha256", id="config-not-its-hash"),
    pytest.param({"config": {"lr": 0.9, "seed": 0, "include_failed": False},
                  "config_sha256": "lr"}, r"config\.lr is not what the host gave",
                 id="other-learning-rate"),
])
def test_the_train_receipt_states_the_inputs_the_host_gave(
        tmp_path: Path, lie: dict[str, Any], match: str | None) -> None:
    """Only the receipt's adapter hashes were checked: a trainer's receipt naming another
    corpus, dataset or learning rate was kept as the record of what the adapter learned."""
    import hashlib

    from runner.errors import IntegrityError
    from runner.isolation.collect import collect
    from runner.train import host
    from runner.train.results import SftReceipt
    from sandbox.train.receipt import canonical

    def sha(b: bytes) -> str:
        return hashlib.sha256(b).hexdigest()

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "trajectories.jsonl").write_bytes(b'{"t": 1}\n')
    out = tmp_path / "out"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "a.bin").write_bytes(b"weights")
    (out / "dataset.jsonl").write_bytes(b'{"messages": []}\n')
    config = {"lr": 0.005, "seed": 0, "include_failed": False}
    doc: dict[str, Any] = {
        "schema": 1, "kind": "sft", "config": config,
        "config_sha256": sha(canonical(config)),
        "dataset_sha256": sha(b'{"messages": []}\n'), "adapter_files": {"a.bin": sha(b"weights")},
        "base_model_files": {}, "corpus_sha256": sha(b'{"t": 1}\n'),
        "figures": {"steps": 1, "epochs": 1, "grad_accum": 1, "lr": 0.005, "train_tokens": 1,
                    "seconds": 1.0, "tokens_per_s": 1.0, "final_loss": 1.0, "peak_rss_mb": 1.0},
        "selection": {"include_failed": False, "rule": "r", "trajectories": 1,
                      "by_r_outcome": {}, "used": 1, "left_out": 0, "rows": 1},
        "base_model": {"host_path": None, "container_path": "/model"}}
    doc.update(lie)
    if doc["config_sha256"] == "lr":
        doc["config_sha256"] = sha(canonical(doc["config"]))
    (out / "train-receipt.json").write_bytes(canonical(doc))
    files = collect(out, host.TRAINER_OUTPUT)
    given = {"lr": 0.005, "seed": 0, "include_failed": False}
    if match is None:
        host.verify_receipt(out, files, SftReceipt, given=given, corpus=corpus)
        return
    with pytest.raises(IntegrityError, match=match):
        host.verify_receipt(out, files, SftReceipt, given=given, corpus=corpus)


@pytest.mark.parametrize("named", ["/tmp/tiny", "evil-org/model", None, "not json",
                                   "missing", "a list"])
def test_an_sft_adapter_naming_another_base_model_is_refused(tmp_path: Path,
                                                             named: str | None) -> None:
    """adapter_config.json is the trainer's file, and AutoPeftModelForCausalLM on the host
    loads the base model it names (a hub id it would download); the host never read it."""
    from runner.errors import IntegrityError
    from runner.isolation.collect import collect
    from runner.train import host

    out = tmp_path / "out"
    (out / "adapter").mkdir(parents=True)
    cfg = out / "adapter" / "adapter_config.json"
    match = r"adapter's base model is .* not --base-model"
    if named == "not json":
        cfg.write_text("{")
        match = r"adapter_config.json: invalid JSON.*Fix: the trainer image writes"
    elif named == "missing":
        (out / "adapter" / "other.json").write_text("{}")
        match = r"adapter_config.json is missing.*Fix: the trainer image writes"
    elif named == "a list":
        cfg.write_text("[]")
        match = r"adapter_config.json is not a JSON object.*Fix: the trainer image writes"
    else:
        cfg.write_text(json.dumps({"base_model_name_or_path": named, "peft_type": "LORA"}))
    files = collect(out, host.TRAINER_OUTPUT)
    with pytest.raises(IntegrityError, match=match):
        host.check_adapter_base(out, files, str(tmp_path / "base"))
    cfg.write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "base")}))
    host.check_adapter_base(out, collect(out, host.TRAINER_OUTPUT), str(tmp_path / "base"))


def test_a_nested_stdout_line_does_not_end_the_trainers_events() -> None:
    """A line nested past the interpreter's stack raised RecursionError out of the event
    splitter, and the output sink then dropped it: every later event was lost."""
    from runner.train.host import _Lines

    got: list[dict[str, Any]] = []
    lines = _Lines(got.append)
    lines("stdout", b"[" * 200_000 + b"]" * 200_000 + b"\n")
    lines("stdout", b'{"event": "step", "n": 1}\n')
    assert got == [{"event": "step", "n": 1}]


def test_an_adapter_config_past_the_json_cap_is_refused_unparsed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """check_adapter_base parsed adapter_config.json at any size TRAINER_OUTPUT allows
    (1 GiB): 64 MiB of ``[[],[],...]`` took 1.7 GB of the host's memory and 15 s. Past
    the JSON cap it is refused by name, never parsed."""
    from runner.errors import OutputRejected
    from runner.isolation.collect import collect
    from runner.loading import MAX_BYTES
    from runner.train import host

    out = tmp_path / "out"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "adapter_config.json").write_bytes(
        b"[" + b"[]," * (MAX_BYTES // 3) + b"[]]")
    files = collect(out, host.TRAINER_OUTPUT)
    parsed: list[object] = []
    monkeypatch.setattr(host, "loads_strict", lambda raw, **k: parsed.append(raw) or {})
    with pytest.raises(OutputRejected, match=r"adapter_config.json is \d+ bytes; the host "
                       r"parses at most"):
        host.check_adapter_base(out, files, str(tmp_path / "base"))
    assert parsed == []


def test_a_stale_verify_directory_is_named_before_the_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A proof killed during its fresh-process check leaves .OUT.verify; the next run with
    that --out trained in full, then ended in 'already exists' for .OUT.verify, with --out
    left behind and no ledger row. It is named before --out is made, nothing run."""
    from runner.errors import ConfigError
    from runner.train import host

    ran: list[str] = []
    monkeypatch.setattr(host, "run_trainer", lambda trainer, module, **k: ran.append(module))
    base = _proof_inputs(tmp_path)
    stale = tmp_path / ".out.verify"
    stale.mkdir()
    with pytest.raises(ConfigError, match=r"\.out\.verify exists.*killed"):
        host.proof(_MakesOut(), tmp_path / "persona.yaml", base, tmp_path / "out",  # type: ignore[arg-type]
                   ledger=tmp_path / "ledger.jsonl", lr=1e-3, seed=0,
                   on_event=lambda e: None)
    assert ran == [] and not (tmp_path / "out").exists() and stale.is_dir()


def test_the_trainer_reads_the_ledger_rows_the_host_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ledger line holding a raw carriage return between its keys is one object to the
    host, but the trainer reads ledger.jsonl with universal newlines and split it in two
    broken lines: JSONDecodeError in the container, after the host had passed it."""
    from runner.train import host

    seen: list[list[dict[str, Any]]] = []

    def run_trainer(trainer: object, module: str, *, mounts: list[Any], **k: Any) -> None:
        ledger = next(m.source for m in mounts if m.target == "/in") / "ledger.jsonl"
        # what sandbox/train/proof.py does with it
        seen.append([json.loads(x) for x in ledger.read_text().split("\n") if x.strip()])
        raise KeyboardInterrupt

    monkeypatch.setattr(host, "run_trainer", run_trainer)
    base = _proof_inputs(tmp_path)
    (tmp_path / "ledger.jsonl").write_bytes(
        b'{"persona": "cap",\r "passed": true, "imprint_delta": 0.5}\r\n{"persona": "x"}\n')
    with pytest.raises(KeyboardInterrupt):
        host.proof(_MakesOut(), tmp_path / "persona.yaml", base, tmp_path / "out",  # type: ignore[arg-type]
                   ledger=tmp_path / "ledger.jsonl", lr=1e-3, seed=0,
                   on_event=lambda e: None)
    assert seen == [[{"persona": "cap", "passed": True, "imprint_delta": 0.5},
                     {"persona": "x"}]]


@pytest.mark.parametrize("command", ["proof", "sft"])
def test_inputs_that_cannot_be_written_are_not_left_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    """An input file that could not be written (a full disk) left .OUT.in behind: the
    rerun, once there was room, was refused as the leftover of a run 'killed before it
    could remove it'."""
    import errno


    real = Path.write_text

    def full(self: Path, *a: Any, **k: Any) -> int:
        if self.parent.name == ".out.in":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **k)

    base = _proof_inputs(tmp_path)
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError, match="No space"):
        _train(command, tmp_path, base)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.in").exists()
