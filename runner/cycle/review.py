"""Human review packets and judge calibration (SPEC §7).

Invariants:
- A packet is written once, into a directory that did not exist; nothing is overwritten,
  and everything is computed before the directory is created (no half-written packets).
- ``review.md`` carries answers, cited evidence and blank anchored 0/1/2 criteria, never a
  model grade or score; model ratings live only in ``judge-ratings.json``. Answers, evidence
  and tasks are quoted as data (fenced, controls escaped, capped per block and per item,
  under a note that they are not instructions).
- ``packet_id`` is the sha256 of canonical ``{"items", "criteria"}``; ``packet.json`` also
  pins the sha256 of ``review.md``, and the labels and ratings files name their packet_id.
  :func:`calibrate` re-checks all of it and raises IntegrityError naming the file at fault.
- A missing label stays missing: it lowers coverage and is left out of every agreement
  statistic. Nothing is imputed. A criterion that does not apply (the reviewer wrote
  ``"na"``, or left it null where the scorer graded it not applicable) is not missing: it
  leaves the coverage denominator and every statistic.
- A packet made from a run's records is bound to that run: ``packet.json`` records the
  sha256 of the run's ``receipt.json`` and of the records file (which the receipt must
  name with the same hash), and the binding is part of ``packet_id``, so the labels and
  ratings files, and the calibration result, belong to one run. Export refuses a
  calibration bound to another run.
- Calibration reports numbers only. It sets no pass threshold; a consumer (corpus export)
  takes its threshold from its own policy.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from runner.cycle.models import CRITERIA, Criterion, Grades, Record
from runner.errors import ConfigError, IntegrityError
from runner.failures import is_environment_error
from runner.hashing import canonical_bytes, sha256_bytes, sha256_file, sha256_json
from runner.isolation.sandbox import Frozen
from runner.loading import load_with_bytes, show
from runner.outdir import refuse_inside_run
from runner.termsafe import DATA_NOTE, code_span, fence, plain

REVIEW_MD = "review.md"
PACKET_JSON = "packet.json"
LABELS_JSON = "human-labels.json"
RATINGS_JSON = "judge-ratings.json"
JUDGE_KEY = "judge"
"""Ratings key for the judge score on the 0/1/2 scale; humans rate no counterpart, so
calibration does not compare it."""
OVERALL = "overall"
"""Key for the value pooled over all criteria in the per-criterion maps."""
SCALE = (0, 1, 2)
ITEM_LIMIT = 12_000
"""Characters of quoted text (task, answer, evidence) shown for one item."""
BLOCK_LIMIT = 6_000
"""Characters of one quoted block; a visible marker shows a cut."""
BLOCK_MIN = 200
"""Characters a block keeps even when its item's budget is spent."""
MAX_EVIDENCE = 20
"""Evidence items shown per answer; the rest are counted."""
MAX_TOOL_CALLS = 20
"""Tool calls shown per item; the rest are counted."""
TOTAL_LIMIT = 8_000_000
"""Characters of review.md; a larger packet is refused before anything is written."""

# (question, 0 = fails, 1 = partly, 2 = fully meets)
ANCHORS: dict[Criterion, tuple[str, str, str, str]] = {
    "correctness": ("Is the answer right?",
                    "wrong, missing, or answers a different question",
                    "partly right: incomplete, or right approach with a wrong figure",
                    "fully right"),
    "evidence": ("Does the cited evidence support the answer?",
                 "nothing cited, or the citation does not support the answer",
                 "some support, but incomplete or loosely tied to the answer",
                 "the citation fully supports the answer"),
    "refusal": ("Did the agent decline exactly when it should?",
                "declined an answerable question, or answered one it should have declined",
                "hedged: partly declined, or answered with unwarranted caveats",
                "declined if and only if the data cannot answer the question"),
}

NA = "na"
"""Label meaning "this criterion does not apply to this item"; not missing coverage."""

Rating = int | str | None
Grid = dict[str, dict[str, Rating]]
M = TypeVar("M", bound=Frozen)


class PacketItem(Frozen):
    """One (case, trial) put in front of the reviewer."""

    item_id: str
    """``f"{case_id}#{trial}"``; the key in the labels and ratings files."""
    case_id: str
    trial: int = Field(ge=0)
    split: str
    answer_sha256: str
    """sha256 of the canonical JSON of the record's answer."""


class _RunReceipt(BaseModel):
    """The two fields of a run's receipt.json that bind a packet (the rest is carried
    along; ``runner.cycle.receipt.Receipt`` is the whole document)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    plan_hash: str
    files: dict[str, str]


class RunBinding(Frozen):
    """The run whose records a packet shows, pinned by hash."""

    receipt_sha256: str
    """sha256 of the run's ``receipt.json`` when the packet was made."""
    plan_hash: str
    """The run's plan hash, as its receipt records it."""
    records: str
    """Path of the records file inside the run directory, e.g. stages/baseline/records.jsonl."""
    records_sha256: str
    """sha256 of that records file; the run's receipt names it with this hash."""


class Packet(Frozen):
    """``packet.json``: what the reviewer was shown, pinned by hash."""

    schema_: Literal[1] = Field(default=1, alias="schema")
    packet_id: str
    """sha256 of canonical ``{"items": ..., "criteria": ...}``, plus ``"run"`` when bound."""
    items: tuple[PacketItem, ...] = Field(min_length=1)
    criteria: tuple[Criterion, ...]
    review_md_sha256: str
    """sha256 of ``review.md`` as written."""
    run: RunBinding | None = None
    """The run the records came from; None for records given without their run."""


class _LabelsFile(Frozen):
    schema_: Literal[1] = Field(alias="schema")
    packet_id: str
    reviewer: str
    labeled_at: AwareDatetime | None
    labels: dict[str, dict[str, Any]]


class _RatingsFile(Frozen):
    schema_: Literal[1] = Field(alias="schema")
    packet_id: str
    ratings: dict[str, dict[str, Any]]


class CalibrationResult(Frozen):
    """Agreement between one reviewer's labels and the model ratings on one packet.

    Maps keyed by criterion also carry :data:`OVERALL` (pooled over criteria), except
    ``disagreements``. Statistics use only items where both sides rated; None where undefined.
    """

    schema_: Literal[1] = Field(default=1, alias="schema")
    packet_id: str
    labels_sha256: str
    """sha256 of the human-labels file assessed."""
    ratings_sha256: str
    """sha256 of the judge-ratings file assessed."""
    reviewer: str
    packet_json_sha256: str | None = None
    """sha256 of the ``packet.json`` assessed."""
    run_receipt_sha256: str | None = None
    """sha256 of the receipt of the run the packet is bound to; None for an unbound packet
    (export refuses it)."""
    items: int
    criteria: tuple[Criterion, ...]
    not_applicable: dict[str, int] = Field(default_factory=dict)
    """Cells that do not apply (labelled "na", or null where the scorer graded n/a)."""
    coverage: dict[str, float]
    """Labelled items / applicable items; overall: labelled cells / applicable cells.
    1.0 when nothing applies."""
    pairs: dict[str, int]
    """Items where both a human label and a model rating exist."""
    disagreements: dict[str, tuple[str, ...]]
    """Item ids where both rated and the ratings differ, per criterion."""
    exact_agreement: dict[str, float | None]
    mean_abs_diff: dict[str, float | None]
    cohen_kappa: dict[str, float | None]
    """Unweighted kappa on the 0/1/2 categories; None under 2 pairs or when undefined."""
    complete: bool
    """Every applicable cell is labelled (overall coverage is 1.0)."""


def bind_run(run: Path, records_file: Path) -> RunBinding:
    """Pin ``records_file`` to the run ``run``: its receipt must name the file by that hash.

    Raises ConfigError when the records are not the run's (or the run has no receipt),
    IntegrityError when the receipt's hash of the records file differs from the file."""
    receipt_path = run / "receipt.json"
    receipt, data = load_with_bytes(receipt_path, _RunReceipt, fmt="json", what="run receipt",
                                    ref=(str(run), "--run"),
                                    fix="pass a finished cycle run directory")
    try:
        rel = records_file.resolve().relative_to(run.resolve()).as_posix()
    except ValueError:
        raise ConfigError(f"{records_file} is not inside the run directory {run}",
                          field="--records", fix="pass RUN/stages/<side>/records.jsonl of "
                          "the run given as --run") from None
    if rel not in receipt.files:
        raise ConfigError(f"the run's receipt does not name {rel}", path=str(receipt_path),
                          field="--records", fix="pass a records file the run wrote")
    actual = sha256_file(records_file)
    if receipt.files[rel] != actual:
        raise IntegrityError(f"{records_file}: sha256 {actual}, the run's receipt recorded "
                             f"{receipt.files[rel]}; the records changed after the run")
    return RunBinding(receipt_sha256=sha256_bytes(data), plan_hash=receipt.plan_hash,
                      records=rel, records_sha256=actual)



def run_of_records(records_file: Path) -> Path | None:
    """The run a records file belongs to when it sits where a run writes it
    (``RUN/stages/<side>/records.jsonl``) and that run has a receipt; else None."""
    parents = records_file.resolve().parents
    if len(parents) > 2 and (parents[2] / "receipt.json").is_file():
        return parents[2]
    return None


def manifest_questions(manifest: Path, intent_key: str = "question") -> dict[str, str]:
    """Case id -> the task as the agent received it (the scenario input's ``intent_key``,
    or the whole input as JSON), for the reviewer to judge correctness against."""
    from runner.cycle.manifest import MANIFEST_FIX
    from runner.cycle.models import Manifest
    from runner.loading import load_model

    doc = load_model(manifest, Manifest, fmt="json", what="scenario manifest", schema=1,
                     fix=MANIFEST_FIX)
    return {sc.id: str(sc.input.get(intent_key, json.dumps(sc.input))) for sc in doc.scenarios}

class ToolCall(Frozen):
    """One tool call the agent made, with the result it was given (if any)."""

    name: str
    arguments: str
    result: str | None = None


def tool_calls_of_run(run: Path, binding: RunBinding,
                      role: str = "analyst") -> dict[str, list[ToolCall]]:
    """Item id -> the tool calls of that (case, trial) in the bound records' stage, read
    from the run's call log (any API family, in turn order; each call's result is the
    tool message answering its id in a later request). Calls that do not parse are left
    out; the exact bytes stay in the log."""
    from runner.gateway.calllog import CallLog
    from runner.gateway.transcript import NOT_TURNS, transcript

    parts = binding.records.split("/")
    stage = parts[1] if len(parts) == 3 and parts[0] == "stages" else None
    log = CallLog.reader(run / "gateway")
    by_item: dict[str, list[Any]] = {}
    for c in sorted(log.records(), key=lambda c: (c.case or "", c.trial or 0, c.turn)):
        if (c.role != role or c.stage != stage or c.case is None or c.trial is None
                or c.status != "ok" or (c.api or "chat") in NOT_TURNS or not c.response_sha256):
            continue
        t = transcript(c.api, log.blob(c.request_sha256), log.blob(c.response_sha256),
                       stream=c.stream)
        by_item.setdefault(f"{c.case}#{c.trial}", []).append(t)
    out: dict[str, list[ToolCall]] = {}
    for item, turns in by_item.items():
        results: dict[str, str] = {}
        for t in turns:
            for m in t.messages:
                if m["role"] == "tool":
                    results.setdefault(m["tool_call_id"], m["content"])
        calls = [ToolCall(name=tc["function"]["name"], arguments=tc["function"]["arguments"],
                          result=results.get(tc["id"]))
                 for t in turns if t.reply is not None
                 for tc in t.reply.get("tool_calls", [])]
        if calls:
            out[item] = calls
    return out


def make_packet(records: Sequence[Record], out_dir: Path, *, reviewer: str = "",
                questions: Mapping[str, str] | None = None,
                run: RunBinding | None = None,
                tool_calls: Mapping[str, Sequence[ToolCall]] | None = None) -> Path:
    """Write a review packet for the ok records into the new directory ``out_dir``.

    ``questions`` (case id -> the task as the agent received it) lets the reviewer
    judge correctness; it comes from the scenario manifest, never from a model.
    ``run`` (from :func:`bind_run`) binds the packet, and so its calibration, to a run.
    ``tool_calls`` (item id -> calls, from :func:`tool_calls_of_run`) are shown under
    each item, quoted as data like every other model string."""
    refuse_inside_run(out_dir)
    ok = sorted((r for r in records if r.status == "ok"), key=lambda r: (r.case_id, r.trial))
    if not ok:
        raise ConfigError("no record with status ok to review", path=str(out_dir),
                          fix="pass graded records with status ok")
    items = tuple(PacketItem(item_id=_item_id(r), case_id=r.case_id, trial=r.trial,
                             split=r.split, answer_sha256=sha256_json(r.answer)) for r in ok)
    dups = sorted(i for i, n in Counter(i.item_id for i in items).items() if n > 1)
    if dups:
        raise ConfigError(f"duplicate (case, trial) items {dups}", field="records",
                          fix="pass each (case, trial) once")
    pid = _packet_id(items, CRITERIA, run)
    review = _render_review(ok, pid, reviewer, questions or {},
                            tool_calls or {}).encode("utf-8")
    packet = Packet(packet_id=pid, items=items, criteria=CRITERIA,
                    review_md_sha256=sha256_bytes(review), run=run)
    ratings = ratings_bytes(ok, pid)  # a judge score outside 0..1 is refused here
    labels = {"schema": 1, "packet_id": pid, "reviewer": reviewer, "labeled_at": None,
              "labels": {i.item_id: dict.fromkeys(CRITERIA) for i in items}}
    try:
        out_dir.mkdir(parents=True)
    except FileExistsError:
        raise ConfigError("already exists; review evidence is never overwritten",
                          path=str(out_dir), fix="choose a new packet directory") from None
    except OSError as exc:
        raise _unwritable(exc, out_dir, "choose a packet directory under one you can "
                          "write") from None
    _write_new(out_dir / REVIEW_MD, review)
    _write_new(out_dir / PACKET_JSON, canonical_bytes(packet))
    # A human edits this file, so it is indented; its hash is taken when it is assessed.
    _write_new(out_dir / LABELS_JSON, (json.dumps(labels, indent=2, sort_keys=True,
                                                  ensure_ascii=False) + "\n").encode("utf-8"))
    _write_new(out_dir / RATINGS_JSON, ratings)
    return out_dir


def ratings_bytes(records: Sequence[Record], packet_id: str) -> bytes:
    """``judge-ratings.json`` as :func:`make_packet` writes it for these records (the ok
    ones): export rebuilds it from the run's records and checks the calibration assessed
    exactly these ratings, so no other ratings file can stand in for the model's."""
    ok = sorted((r for r in records if r.status == "ok"), key=lambda r: (r.case_id, r.trial))
    return canonical_bytes({"schema": 1, "packet_id": packet_id,
                            "ratings": {_item_id(r): _model_ratings(r) for r in ok}})


def calibrate(packet_dir: Path, labels_path: Path, judges_path: Path) -> CalibrationResult:
    """Check the packet's identity, then compare human labels with model ratings."""
    packet, packet_sha = _load_packet(packet_dir)
    # Hash the bytes that were parsed, so the recorded sha is of what was assessed.
    lab, lab_sha = _read_model(labels_path, _LabelsFile, "human-labels file")
    rat, rat_sha = _read_model(judges_path, _RatingsFile, "judge-ratings file")
    human = _grid(labels_path, packet, lab.packet_id, lab.labels, extra=())
    model = _grid(judges_path, packet, rat.packet_id, rat.ratings, extra=(JUDGE_KEY,))
    ids = [i.item_id for i in packet.items]
    by: dict[str, list[tuple[str, int, int]]] = {
        c: [(i, h, j) for i in ids
            if isinstance(h := human[i].get(c), int) and isinstance(j := model[i].get(c), int)]
        for c in packet.criteria}
    by[OVERALL] = [p for c in packet.criteria for p in by[c]]
    labelled = {c: sum(isinstance(human[i].get(c), int) for i in ids) for c in packet.criteria}
    na = {c: sum(_not_applicable(human[i].get(c), model[i].get(c)) for i in ids)
          for c in packet.criteria}
    applicable = {c: len(ids) - na[c] for c in packet.criteria}
    cells = sum(applicable.values())
    return CalibrationResult(
        packet_id=packet.packet_id, labels_sha256=lab_sha, ratings_sha256=rat_sha,
        reviewer=lab.reviewer, packet_json_sha256=packet_sha,
        run_receipt_sha256=packet.run.receipt_sha256 if packet.run else None,
        items=len(ids), criteria=packet.criteria,
        not_applicable=na | {OVERALL: sum(na.values())},
        coverage={c: _ratio(n, applicable[c]) for c, n in labelled.items()}
        | {OVERALL: _ratio(sum(labelled.values()), cells)},
        pairs={k: len(v) for k, v in by.items()},
        disagreements={c: tuple(i for i, h, j in by[c] if h != j) for c in packet.criteria},
        exact_agreement={k: _mean([float(h == j) for _, h, j in v]) for k, v in by.items()},
        mean_abs_diff={k: _mean([abs(h - j) for _, h, j in v]) for k, v in by.items()},
        cohen_kappa={k: cohen_kappa([(h, j) for _, h, j in v]) for k, v in by.items()},
        complete=sum(labelled.values()) == cells)


def _not_applicable(human: Rating, model: Rating) -> bool:
    """The reviewer said n/a, or left blank a cell the scorer graded not applicable."""
    return human == NA or (human is None and model is None)


def _ratio(n: int, d: int) -> float:
    return n / d if d else 1.0


def write_calibration(result: CalibrationResult, out_file: Path) -> Path:
    """Write the result as canonical JSON to a file that must not exist yet (nor be in a
    run directory)."""
    refuse_inside_run(out_file)
    try:
        _write_new(out_file, canonical_bytes(result))
    except FileExistsError:
        raise ConfigError("already exists; a calibration result is never overwritten",
                          path=str(out_file), fix="write to a new file") from None
    except OSError as exc:
        raise _unwritable(exc, out_file, "write into an existing directory you can "
                          "write") from None
    return out_file


def load_calibration(path: Path) -> CalibrationResult:
    """Read a calibration result written by :func:`write_calibration`."""
    return _read_model(path, CalibrationResult, "calibration result")[0]


def cohen_kappa(pairs: Sequence[tuple[int, int]]) -> float | None:
    """Unweighted Cohen's kappa over (rater A, rater B) pairs on :data:`SCALE`.

    None under 2 pairs. When expected agreement is 1 (both raters always used one and the
    same category) kappa is 0/0; it is defined as 1.0 when observed agreement is 1.0.
    """
    n = len(pairs)
    if n < 2:
        return None
    # Fractions keep the pe == 1 test exact and the result independent of pair order.
    po = Fraction(sum(a == b for a, b in pairs), n)
    pe = sum((Fraction(sum(a == k for a, _ in pairs) * sum(b == k for _, b in pairs), n * n)
              for k in SCALE), Fraction(0))
    if pe == 1:
        return 1.0 if po == 1 else None
    return float((po - pe) / (1 - pe))


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _item_id(r: Record) -> str:
    return f"{r.case_id}#{r.trial}"


def _packet_id(items: Sequence[PacketItem], criteria: Sequence[str],
               run: RunBinding | None = None) -> str:
    body: dict[str, Any] = {"items": [i.model_dump(mode="json") for i in items],
                            "criteria": list(criteria)}
    if run is not None:
        body["run"] = run.model_dump(mode="json")
    return sha256_json(body)


def _model_ratings(r: Record) -> dict[str, Rating]:
    g = r.grades or Grades()
    flags: dict[str, bool | None] = {"correctness": g.correctness, "evidence": g.evidence,
                                     "refusal": g.refusal}
    out: dict[str, Rating] = {c: None if v is None else 2 * v for c, v in flags.items()}
    s = g.judge_score
    if s is not None and not 0.0 <= s <= 1.0:
        raise ConfigError(f"judge_score {s!r} is outside 0..1", field=f"{_item_id(r)}.grades",
                          fix="grade with a judge that reports scores in 0..1")
    # round() is half-to-even: 0.25 -> 0, 0.75 -> 2; the score is recorded, not re-judged.
    out[JUDGE_KEY] = None if s is None else round(s * 2)
    return out


def _unwritable(exc: OSError, path: Path, fix: str) -> Exception:
    """--out that cannot be written: bad input naming it, unless the machine failed (a
    full disk stays an environment failure)."""
    if is_environment_error(exc):
        return exc
    return ConfigError(f"cannot be written: {exc.strerror or exc}", path=str(path),
                       field="--out", fix=fix)


def _write_new(path: Path, data: bytes) -> None:
    with path.open("xb") as f:
        f.write(data)


def _read_model(path: Path, model: type[M], what: str) -> tuple[M, str]:
    doc, data = load_with_bytes(path, model, fmt="json", what=what,
                                fix=f"pass the {what} cyclebox wrote (fill in the values; "
                                    "keep its keys)")
    return doc, sha256_bytes(data)


def _load_packet(packet_dir: Path) -> tuple[Packet, str]:
    pj, md = packet_dir / PACKET_JSON, packet_dir / REVIEW_MD
    if not pj.exists() and not pj.is_symlink():  # a wrong path is bad input, not damage
        raise ConfigError(f"{show(str(packet_dir))} holds no {PACKET_JSON}", field="--packet",
                          fix="pass the directory `cyclebox review packet --out` wrote")
    try:
        packet, raw = load_with_bytes(pj, Packet, fmt="json", what="review packet",
                                      fix="make the packet again (cyclebox review packet)")
        md_sha = sha256_file(md)
    except (OSError, ConfigError) as exc:
        # the packet is cyclebox's own output: unreadable means it was damaged
        raise IntegrityError(f"{packet_dir}: packet unreadable: {exc}") from None
    want = _packet_id(packet.items, packet.criteria, packet.run)
    if packet.packet_id != want:
        raise IntegrityError(f"{pj}: packet_id {packet.packet_id} does not match its items, "
                             f"criteria and run ({want}); the packet was edited")
    if md_sha != packet.review_md_sha256:
        raise IntegrityError(f"{md}: sha256 {md_sha}, packet.json recorded "
                             f"{packet.review_md_sha256}; review.md changed after packing")
    return packet, sha256_bytes(raw)


def _grid(path: Path, packet: Packet, packet_id: str, table: Mapping[str, Mapping[str, Any]],
          *, extra: tuple[str, ...]) -> Grid:
    if packet_id != packet.packet_id:
        raise IntegrityError(f"{path}: packet_id {packet_id}, expected {packet.packet_id}; "
                             "this file belongs to another packet")
    ids = [i.item_id for i in packet.items]
    unknown = sorted(set(table) - set(ids))
    if unknown:
        raise IntegrityError(f"{path}: items not in packet {packet.packet_id}: {unknown}")
    grid: Grid = {}
    for item_id in ids:
        row = table.get(item_id, {})
        for key, v in row.items():
            where = f"item {item_id!r}, criterion {key!r}"
            if key not in packet.criteria and key not in extra:
                raise ConfigError("unknown criterion", path=str(path), field=where,
                                  fix=f"use only {list(packet.criteria)}")
            # type() is int, not isinstance: JSON true/false must not pass as 1/0.
            if v is not None and v != NA and not (type(v) is int and v in SCALE):
                raise ConfigError(f"rating must be 0, 1, 2, \"na\" or null, got {v!r}",
                                  path=str(path), field=where,
                                  fix='rate 0, 1 or 2, "na" if the criterion does not apply, '
                                  "or leave null")
        grid[item_id] = dict(row)
    return grid


def _as_text(v: object) -> str:
    return v if isinstance(v, str) else json.dumps(v, indent=2, sort_keys=True,
                                                   ensure_ascii=False)


class _Quoter:
    """Fences blocks of one item; each takes what is left of the item's budget (at least
    :data:`BLOCK_MIN`, at most :data:`BLOCK_LIMIT` characters)."""

    def __init__(self, budget: int) -> None:
        self.left = budget

    def __call__(self, v: object) -> str:
        text = _as_text(v)
        cap = max(BLOCK_MIN, min(BLOCK_LIMIT, self.left))
        self.left -= min(len(text), cap)
        return fence(text, cap)


def _render_review(records: Sequence[Record], packet_id: str, reviewer: str,
                   questions: Mapping[str, str],
                   tool_calls: Mapping[str, Sequence[ToolCall]] | None = None) -> str:
    """review.md. Every string from a record or the manifest is quoted as data: blocks
    fenced (one backtick longer than any run inside), names as code spans, controls
    escaped; each item's quoted text is capped at :data:`ITEM_LIMIT` characters and the
    file at :data:`TOTAL_LIMIT` (ConfigError before anything is written)."""
    out = ["# Review packet", "", f"Packet: `{packet_id}`",
           f"Reviewer: {code_span(reviewer) if reviewer else '(unassigned)'}", "",
           f"Rate every item on every criterion 0, 1 or 2 using the anchors, from the answer "
           f"and its cited evidence alone. Record ratings in `{LABELS_JSON}` under the item "
           "id; leave a rating null if you cannot decide.", "", DATA_NOTE, ""]
    for r in records:
        ans = r.answer or {}
        quote = _Quoter(ITEM_LIMIT)

        out += [f"## {plain(_item_id(r), 200, newlines=False)}", "",
                f"Case {code_span(r.case_id)}, trial {r.trial}, "
                f"split {code_span(r.split)}.", ""]
        if r.case_id in questions:
            out += ["### Task", "", quote(questions[r.case_id]), ""]
        out += ["### Answer", ""]
        out += [quote(ans["answer"]) if ans.get("answer") is not None
                else "(no answer given)", "", "### Cited evidence", ""]
        ev = ans.get("evidence")
        evs = ev if isinstance(ev, list) else [] if ev in (None, "") else [ev]
        out += [f"Evidence {k}:\n\n{quote(e)}\n" for k, e in
                enumerate(evs[:MAX_EVIDENCE], 1)] or ["(none cited)", ""]
        if len(evs) > MAX_EVIDENCE:
            out += [f"({len(evs) - MAX_EVIDENCE} more evidence item(s) not shown)", ""]
        calls = (tool_calls or {}).get(_item_id(r), ())
        if calls:
            out += ["### Tool calls", ""]
            for k, tc in enumerate(calls[:MAX_TOOL_CALLS], 1):
                out += [f"Call {k}: {code_span(tc.name)} with arguments:", "",
                        quote(tc.arguments), "", "Result:", "",
                        quote(tc.result) if tc.result is not None else "(no result recorded)",
                        ""]
            if len(calls) > MAX_TOOL_CALLS:
                out += [f"({len(calls) - MAX_TOOL_CALLS} more tool call(s) not shown)", ""]
        if "refused" in ans:
            v = ans["refused"]
            said = "yes" if v is True else "no" if v is False else code_span(_as_text(v))
            out += [f"Agent declined to answer: {said}", ""]
        out += ["### Ratings", "", "| Criterion | Question | 0 = fails | 1 = partly "
                "| 2 = fully meets | Rating |", "|---|---|---|---|---|---|"]
        out += [f"| {c} | {q} | {a0} | {a1} | {a2} |   |"
                for c, (q, a0, a1, a2) in ANCHORS.items()]
        out.append("")
    text = "\n".join(out)
    if len(text) > TOTAL_LIMIT:
        raise ConfigError(f"review.md would be {len(text)} characters, over the cap of "
                          f"{TOTAL_LIMIT}", field="records",
                          fix="split the records into several packets")
    return text
