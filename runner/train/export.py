"""Training corpus export (SPEC §11): the gateway's call log and the evaluator's grades
become trajectories, one per (stage, case, trial), turns in order.

Invariants: each turn's prompt is the exact recorded request bytes (a missing or
corrupted blob fails the export, naming the call; nothing is re-assembled);
``r_format`` is 1 only when every turn of the trajectory parsed; ``r_outcome`` is the
evaluator's correctness where graded, the refusal grade on a case whose frozen reference
says the agent must decline, and null where nothing was graded, never 0 for missing;
grades join trajectories by a hash of their identity, never by position; export is
refused without a calibration whose coverage is complete, whose kappa meets the export
policy and whose review packet was made from this run (bound by the run's receipt hash).

Besides the byte-exact ``trajectories.jsonl`` the export writes what verl's own loaders
read (verl 0.9 ``RLHFDataset`` / ``MultiTurnSFTDataset``): ``rl.parquet`` with
``data_source``, ``prompt`` (the first turn's recorded chat messages), ``ability``,
``reward_model: {style: "rule", ground_truth}`` (the frozen reference as canonical JSON)
and ``extra_info`` (``index``, ids, rewards, the sha256 of the exact request bytes);
``sft.parquet`` with ``messages`` (the last turn's recorded messages plus its reply) for
trajectories that passed (``r_outcome == 1``). The parquet rows are derived from the
JSONL; the JSONL stays the evidence.

Every API family is exported as chat messages (:mod:`runner.gateway.transcript`):
assistant turns keep ``tool_calls``, tool results keep ``tool_call_id``, and the request's
tools go in a ``tools`` column (see :mod:`runner.train.verl_parquet`). A turn parsed when
its request and reply read in their family's shape and the reply is either tool calls
whose arguments are each one JSON object, or content that is one JSON object (the agent
protocol the scorer relies on); otherwise its ``reason`` names what did not. Embeddings
and count_tokens calls are not turns: they are counted in the summary, not exported.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from runner.cycle.models import RECORDS_MAX_BYTES, Manifest, Record, Reference
from runner.cycle.review import OVERALL, CalibrationResult, load_calibration, ratings_bytes
from runner.errors import ConfigError, IntegrityError, OutputRejected
from runner.gateway.calllog import CallLog, CallRecord
from runner.gateway.transcript import NOT_TURNS, Unparsed, arguments_are_objects, transcript
from runner.hashing import canonical_bytes, sha256_bytes, sha256_file, sha256_json
from runner.isolation.collect import loads_strict
from runner.isolation.sandbox import Frozen
from runner.loading import (
    decode_utf8,
    load_model,
    parse_json,
    parse_model,
    read_capped,
    show,
    validate,
)
from runner.outdir import refuse_inside_run, staged

SIDES = {"baseline": "baseline", "candidate": "candidate"}


class ExportPolicy(Frozen):
    schema_: int = Field(alias="schema")
    min_kappa: float = Field(ge=-1, le=1)
    """Overall Cohen's kappa a calibration must reach before any export."""
    roles: tuple[Literal["analyst", "worker", "evaluator"], ...] = Field(
        default=("analyst",), min_length=1)
    """The roles whose calls are exported (a misspelt one exported nothing, exit 0)."""


def load_export_policy(path: Path) -> ExportPolicy:
    return load_model(path, ExportPolicy, fmt="yaml", what="export policy",
                      fix="see ExportPolicy in runner/train/export.py "
                      "(default policies/export.yaml)")


RL_PARQUET = "rl.parquet"
SFT_PARQUET = "sft.parquet"


class ExportSummary(Frozen):
    """``summary.json`` of an export (also inside ``export-receipt.json``)."""

    trajectories: int
    turns: int
    r_format: dict[str, int]
    """"1" (every turn parsed) and "0" -> trajectories."""
    r_outcome: dict[str, int]
    """"1", "0" and "null" (nothing graded) -> trajectories."""
    r_outcome_basis: dict[str, int]
    """correctness and refusal -> trajectories graded on it."""
    format_pass_rate: float | None
    """Share with r_format 1 (4 places); None without trajectories."""
    rl_rows: int
    sft_rows: int
    not_in_parquet: dict[str, int]
    """Reason -> trajectories left out of a parquet file (see :func:`verl_rows`)."""
    format_reasons: dict[str, int] = Field(default_factory=dict)
    """Why turns did not parse: reason (up to its first colon) -> turns."""
    not_turns: dict[str, int] = Field(default_factory=dict)
    """API family -> calls that are not conversation turns (embeddings, count_tokens)."""
    tool_calls: int = 0
    """Tool calls in the exported replies."""
    tools_column: dict[str, str] = Field(default_factory=dict)
    """rl / sft -> how the parquet ``tools`` column is stored: ``struct`` (tool objects,
    what verl and TRL read) or ``json_text`` (the rows' tool schemas have no common Arrow
    type; TRL reads it, verl 0.9 does not); ``tools_json`` always has the exact text."""
    fixture: bool
    """Some exported turn was answered by the scripted provider."""


class ExportReceipt(Frozen):
    """``export-receipt.json``: what the corpus was made from and the hash of each file."""

    schema_: int = Field(default=2, alias="schema")
    format: str
    run: str
    run_receipt_sha256: str
    """The run's receipt.json, which the calibration's review packet is bound to."""
    calibration_sha256: str
    kappa: float | None
    min_kappa: float
    trajectories_sha256: str
    rl_parquet_sha256: str
    sft_parquet_sha256: str
    summary: ExportSummary


def check_calibration(calibration: Path | None, run: Path,
                      policy: ExportPolicy) -> tuple[CalibrationResult, str]:
    """(result, sha256 of its file) when the calibration exists, is complete, meets
    ``min_kappa`` and is of this run.

    Raises ConfigError naming the reason: ``calibration_missing``,
    ``calibration_inconsistent``, ``calibration_incomplete``, ``kappa_below_policy``,
    ``calibration_unbound``, ``run_has_no_receipt`` or ``calibration_of_another_run``
    (and, once the records are read, ``calibration_ratings_not_of_run``)."""
    if not run.is_dir():
        raise ConfigError(f"{run} is not a directory", field="--run",
                          fix="pass a finished cycle run directory (`cycle run --out`)")
    if calibration is not None and calibration.exists() and not calibration.is_file():
        raise ConfigError(f"{calibration} is not a regular file", field="--calibration",
                          fix="pass the result file `cyclebox review calibrate --out` wrote")
    if calibration is None or not calibration.is_file():
        raise ConfigError("calibration_missing: export needs human-model agreement first",
                          field="--calibration", fix="run `cyclebox review packet` on the run's "
                          "records, label it, then `cyclebox review calibrate ... --out FILE` "
                          "and pass --calibration FILE")
    cal = load_calibration(calibration)
    cal_sha = sha256_file(calibration)
    kappa = cal.cohen_kappa.get(OVERALL)
    pairs = cal.pairs.get(OVERALL, 0)
    if (kappa is not None and (pairs < 2 or not -1.0 <= kappa <= 1.0)) or (
            cal.complete and cal.coverage.get(OVERALL) != 1.0):
        raise ConfigError(f"calibration_inconsistent: kappa {kappa} over {pairs} pairs, "
                          f"complete {cal.complete} at coverage {cal.coverage.get(OVERALL)}; "
                          "`cyclebox review calibrate` writes no such result",
                          path=str(calibration), field="--calibration",
                          fix="calibrate again with `cyclebox review calibrate`")
    if not cal.complete:
        raise ConfigError(f"calibration_incomplete: coverage {cal.coverage.get(OVERALL)} of "
                          "the applicable cells", path=str(calibration), field="--calibration",
                          fix='label every cell 0, 1, 2 or "na", then `cyclebox review '
                          'calibrate` again')
    if kappa is None or kappa < policy.min_kappa:
        raise ConfigError(f"kappa_below_policy: calibration kappa {kappa} is below the export "
                          f"policy's min_kappa {policy.min_kappa}", field="--calibration",
                          fix="improve the judge/scorer or relabel, then `cyclebox review "
                          "calibrate` again")
    if cal.run_receipt_sha256 is None:
        raise ConfigError("calibration_unbound: its review packet names no run, so nothing "
                          "shows it was made from this run", path=str(calibration),
                          field="--calibration", fix=f"`cyclebox review packet --run {run} "
                          "--records RUN/stages/baseline/records.jsonl`, label it and calibrate")
    receipt = run / "receipt.json"
    if not receipt.is_file():
        raise ConfigError("run_has_no_receipt: a calibration binds to the run's receipt, and "
                          "this run has none", path=str(receipt), field="--run",
                          fix="export a finished run (one with receipt.json)")
    actual = sha256_file(receipt)
    if actual != cal.run_receipt_sha256:
        raise ConfigError(f"calibration_of_another_run: the calibration's packet was made from "
                          f"the run whose receipt sha256 is {cal.run_receipt_sha256}; {receipt} "
                          f"has sha256 {actual}", path=str(calibration), field="--calibration",
                          fix="calibrate a review packet made from this run's records")
    return cal, cal_sha


class _PlanFields(BaseModel):
    """The fields of a run's plan the export reads (the plan itself is bound by the run's
    receipt; ``runner.cycle.plan.Plan`` is the whole of it)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    dataset: str
    manifest_sha256: str


class _PlanFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    plan: _PlanFields


RUN_FIX = "pass a cycle run directory (plan.json and inputs/)"


def _run_plan(run: Path) -> _PlanFields:
    return load_model(run / "plan.json", _PlanFile, fmt="json", what="plan",
                      ref=(str(run), "--run"), fix=RUN_FIX).plan


class FrozenReference(Frozen):
    """A case's frozen reference as the export uses it (from the run's manifest)."""

    reference: Reference
    split: str
    mandatory: bool
    refusal: bool = False
    """Scored by the refusal scorer (kind: refuse, or scorer: refusal): graded on refusal."""


def _check_run(run: Path) -> None:
    """The run directory is what its receipt binds (the receipt the calibration is bound
    to): every file the export reads (plan, frozen manifest, call log and blobs, records)
    re-hashed, none linked. IntegrityError naming the first problems: a changed reference,
    a relabelled call or a file swapped for a link would otherwise be exported as data."""
    from runner.cycle.receipt import require_unaltered

    require_unaltered(run, what="export the run as its cycle wrote it")


def frozen_references(run: Path) -> dict[str, FrozenReference]:
    """case id -> reference, split and mandatory from the run's frozen manifest (checked
    against the plan's hash before it is parsed)."""
    path = run / "inputs" / "manifest.json"
    want = _run_plan(run).manifest_sha256
    data = read_capped(path, what="frozen manifest", ref=(str(run), "--run"), fix=RUN_FIX)
    if sha256_bytes(data) != want:
        raise IntegrityError(f"{path}: sha256 {sha256_bytes(data)}, plan.json froze {want}; "
                             "the references changed after freeze")
    manifest = parse_model(data, Manifest, path=show(str(path)), fix=RUN_FIX)
    default = manifest.scoring.default if manifest.scoring else None
    return {s.id: FrozenReference(
                reference=s.reference, split=s.split, mandatory=s.mandatory,
                refusal=getattr(s.reference.selected(default), "name", None) == "refusal")
            for s in manifest.scenarios}


def outcome(rec: Record | None, reference: FrozenReference | None
            ) -> tuple[float | None, str | None]:
    """(r_outcome, what it was graded on). A case scored by the refusal scorer (kind:
    refuse) is graded on refusal correctness; any other case on correctness; None where
    that grade is missing."""
    if rec is None or rec.grades is None:
        return None, None
    if reference is not None and reference.refusal:
        v, basis = rec.grades.refusal, "refusal"
    else:
        v, basis = rec.grades.correctness, "correctness"
    return (None, None) if v is None else (1.0 if v else 0.0, basis)


def join_key(stage: str, case: str | None, trial: int | None) -> str:
    """Content hash joining a trajectory to its graded record."""
    return sha256_json([stage, case, trial])


def read_turn(api: str | None, request: bytes, response: bytes | None, *,
              stream: bool = False) -> dict[str, Any]:
    """One recorded call as the fields of a trajectory turn: ``api``, ``messages`` and
    ``tools`` (the request in chat shape), ``reply_message`` (the assistant message, None
    without a usable reply), ``reply`` (its text), ``parsed`` and ``reason`` (None when
    parsed, else what did not: a shape named by :func:`transcript`,
    ``tool_arguments_not_json_object`` or ``reply_not_json_object``)."""
    t = transcript(api, request, response, stream=stream)
    reply = t.reply
    reason = t.reason
    if reason is None and reply is not None:
        if reply.get("tool_calls"):
            if not arguments_are_objects(reply):
                reason = "tool_arguments_not_json_object"
        elif not _is_json_object(reply["content"]):
            reason = "reply_not_json_object"
    return {"api": t.api, "messages": t.messages, "tools": t.tools, "reply_message": reply,
            "reply": None if reply is None else reply["content"],
            "parsed": reason is None, "reason": reason}


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(loads_strict(text, source="reply"), dict)
    except OutputRejected:
        return False


def reply_of(response: bytes) -> tuple[str | None, bool]:
    """(assistant text, parsed) of a recorded chat completion or SSE stream (see
    :func:`read_turn`, which also keeps tool calls)."""
    turn = read_turn("chat", b'{"messages":[{"role":"user","content":""}]}', response)
    return turn["reply"], turn["parsed"]


class _ReceiptFiles(BaseModel):
    """The run receipt's file table (path -> sha256), which the export checks the records
    files against; ``runner.cycle.receipt.Receipt`` is the whole document."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    files: dict[str, str]


def _check_ratings(cal: CalibrationResult, sides: dict[str, list[Record]],
                   calibration: Path | None) -> None:
    """The calibration assessed the model ratings of this run's records (of one arm),
    byte for byte: a judge-ratings file written by hand (e.g. a copy of the human labels,
    which makes kappa 1.0) is ``calibration_ratings_not_of_run``."""
    if any(sha256_bytes(ratings_bytes(rs, cal.packet_id)) == cal.ratings_sha256
           for rs in sides.values()):
        return
    raise ConfigError("calibration_ratings_not_of_run: the judge ratings the calibration "
                      f"assessed (sha256 {cal.ratings_sha256[:16]}…) are not the ratings this "
                      "run's records give", path=str(calibration), field="--calibration",
                      fix="calibrate with the judge-ratings.json `cyclebox review packet` "
                          "wrote, unchanged")


def _grades(run: Path) -> tuple[dict[str, Record], dict[str, list[Record]]]:
    """The graded records of both arms, joined by :func:`join_key`, and each arm's list.

    Each records file the run's receipt names must be there with the bytes the receipt
    hashed (IntegrityError naming the file otherwise: a missing file is not "nothing was
    graded"); a file the receipt does not name is refused too. A line that is not a record
    is a ConfigError naming ``file:line``."""
    receipt = load_model(run / "receipt.json", _ReceiptFiles, fmt="json", what="run receipt",
                         ref=(str(run), "--run"), fix=RUN_FIX)
    out = {}
    sides: dict[str, list[Record]] = {}
    for side in SIDES:
        rel = f"stages/{side}/records.jsonl"
        f = run / rel
        want = receipt.files.get(rel)
        try:
            present = f.is_file() or f.is_symlink() or f.exists()
        except OSError:
            present = True  # read below, and named there
        if want is None:
            if present:
                raise IntegrityError(f"{f}: the run's receipt does not name this records "
                                     "file; it was added after the run")
            continue
        if not present:
            raise IntegrityError(f"{f} is missing; the run's receipt recorded it (sha256 "
                                 f"{want[:16]}…), so its grades cannot be left out")
        data = read_capped(f, what="records file", fix=RUN_FIX, max_bytes=RECORDS_MAX_BYTES)
        got = sha256_bytes(data)
        if got != want:
            raise IntegrityError(f"{f}: sha256 {got}, the run's receipt recorded {want}; the "
                                 "records changed after the run")
        text = decode_utf8(data, path=show(str(f)))
        for n, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            where = f"{show(str(f))}:{n}"
            r = validate(Record, parse_json(line, path=where), path=where, fix=RUN_FIX)
            key = join_key(side, r.case_id, r.trial)
            if key in out:  # a run records each (case, trial) once: which grade is it?
                raise IntegrityError(f"{where}: a second record of case {show(r.case_id)} "
                                     f"trial {r.trial}; the run records each once")
            out[key] = r
            sides.setdefault(side, []).append(r)
    return out, sides


def export(run: Path, out: Path, *, calibration: Path | None, policy: ExportPolicy,
           fmt: str = "verl") -> ExportSummary:
    """Write trajectories.jsonl, summary.json and export-receipt.json into a new ``out``."""
    if fmt != "verl":
        raise ConfigError(f"unknown format {fmt!r}", field="--format", fix="use verl")
    refuse_inside_run(out)  # before any reading: a corpus in the run broke its receipt
    cal, cal_sha = check_calibration(calibration, run, policy)
    kappa = cal.cohen_kappa.get(OVERALL)
    if out.exists():
        raise ConfigError(f"{out} exists; evidence is never overwritten", field="--out")
    _check_run(run)
    log = CallLog.reader(run / "gateway")
    calls = [c for c in log.records() if c.role in policy.roles and c.status != "refused"]
    groups: dict[tuple[str, str | None, int | None], list[CallRecord]] = defaultdict(list)
    not_turns: dict[str, int] = defaultdict(int)
    for c in calls:
        if (c.api or "chat") in NOT_TURNS:
            not_turns[c.api or "chat"] += 1
            continue
        groups[(c.stage, c.case, c.trial)].append(c)
    grades, sides = _grades(run)
    _check_ratings(cal, sides, calibration)
    refs = frozen_references(run)
    dataset = _run_plan(run).dataset
    trajectories: list[dict[str, Any]] = []
    for (stage, case, trial), turns in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1] or "", kv[0][2] if kv[0][2] is not None else -1)):
        turns.sort(key=lambda c: c.turn)
        rows = []
        for c in turns:
            try:
                prompt = log.blob(c.request_sha256)
            except IntegrityError as exc:
                raise IntegrityError(f"call seq {c.seq} ({stage}/{case}/t{trial} turn "
                                     f"{c.turn}): {exc}") from None
            response = None
            if c.response_sha256:
                try:
                    response = log.blob(c.response_sha256)
                except IntegrityError as exc:
                    raise IntegrityError(f"call seq {c.seq}: {exc}") from None
            try:
                prompt_text = prompt.decode("utf-8")
            except UnicodeDecodeError:
                raise IntegrityError(f"call seq {c.seq}: recorded request is not UTF-8; "
                                     "it cannot be exported byte-exactly as text") from None
            rows.append({"turn": c.turn, "prompt": prompt_text,
                         "prompt_sha256": c.request_sha256,
                         "response_sha256": c.response_sha256, "status": c.status,
                         "stream": c.stream,
                         **read_turn(c.api, prompt, response, stream=c.stream)})
        rec = grades.get(join_key(stage, case, trial))
        r_outcome, basis = outcome(rec, refs.get(case) if case is not None else None)
        trajectories.append({
            "data_source": dataset, "trajectory_id": join_key(stage, case, trial),
            "stage": stage, "case_id": case, "trial": trial, "turns": rows,
            "r_format": 1 if rows and all(r["parsed"] for r in rows) else 0,
            "r_outcome": r_outcome, "r_outcome_basis": basis,
            "fixture": any(c.fixture for c in turns)})
    rl_rows, sft_rows, skipped = verl_rows(trajectories, refs, ability=",".join(policy.roles))
    from runner.train.verl_parquet import write_rl, write_sft

    # written under a hidden sibling name and renamed into place: a failure, a full disk
    # or a signal leaves no partial corpus, and nothing at --out that blocks the rerun
    with staged(out) as tmp:
        body = "".join(json.dumps(t, sort_keys=True, ensure_ascii=False) + "\n"
                       for t in trajectories)
        (tmp / "trajectories.jsonl").write_text(body, encoding="utf-8")
        tools_kind = {"rl": write_rl(rl_rows, tmp / RL_PARQUET),
                      "sft": write_sft(sft_rows, tmp / SFT_PARQUET)}
        fmt_pass = sum(t["r_format"] for t in trajectories)
        summary = ExportSummary(
            trajectories=len(trajectories), turns=sum(len(t["turns"]) for t in trajectories),
            r_format={"1": fmt_pass, "0": len(trajectories) - fmt_pass},
            r_outcome={"1": sum(t["r_outcome"] == 1.0 for t in trajectories),
                       "0": sum(t["r_outcome"] == 0.0 for t in trajectories),
                       "null": sum(t["r_outcome"] is None for t in trajectories)},
            r_outcome_basis={b: sum(t["r_outcome_basis"] == b for t in trajectories)
                             for b in ("correctness", "refusal")},
            format_pass_rate=round(fmt_pass / len(trajectories), 4) if trajectories else None,
            rl_rows=len(rl_rows), sft_rows=len(sft_rows), not_in_parquet=skipped,
            format_reasons=format_reasons(trajectories),
            not_turns=dict(sorted(not_turns.items())),
            tool_calls=sum(len((r["reply_message"] or {}).get("tool_calls", []))
                           for t in trajectories for r in t["turns"]),
            tools_column=tools_kind, fixture=any(t["fixture"] for t in trajectories))
        (tmp / "summary.json").write_text(json.dumps(summary.model_dump(mode="json"), indent=1,
                                                     sort_keys=True))
        receipt = ExportReceipt(
            format=fmt, run=str(run), run_receipt_sha256=cal.run_receipt_sha256,
            calibration_sha256=cal_sha, kappa=kappa, min_kappa=policy.min_kappa,
            trajectories_sha256=sha256_bytes(body.encode("utf-8")),
            rl_parquet_sha256=sha256_file(tmp / RL_PARQUET),
            sft_parquet_sha256=sha256_file(tmp / SFT_PARQUET), summary=summary)
        (tmp / "export-receipt.json").write_bytes(canonical_bytes(receipt))
    return summary


def format_reasons(trajectories: list[dict[str, Any]]) -> dict[str, int]:
    """Reason (up to its first colon) -> turns that did not parse."""
    out: dict[str, int] = defaultdict(int)
    for t in trajectories:
        for r in t["turns"]:
            if r["reason"] is not None:
                out[r["reason"].split(":", 1)[0]] += 1
    return dict(sorted(out.items()))


def chat_messages(request: str) -> list[dict[str, Any]]:
    """A recorded chat-completions request's messages in chat shape (tool calls kept; see
    :func:`runner.gateway.transcript.chat_request`). Raises ValueError or OutputRejected
    when the request has no usable messages list."""
    from runner.gateway.transcript import chat_request

    req = loads_strict(request.encode("utf-8"), source="request")
    try:
        return chat_request(req)[0]
    except Unparsed as exc:
        raise ValueError(exc.reason) from None


Call = tuple[str, str, str]
Said = tuple[str, tuple[Call, ...]]


def said(message: dict[str, Any]) -> Said:
    """What an assistant message says: its text and its tool calls (id, name, arguments;
    arguments that parse as JSON compared as canonical JSON, since SDKs re-serialize
    them, and no arguments as ``{}``)."""
    calls = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function") or {}
        args = str(fn.get("arguments", "")).strip() or "{}"
        with contextlib.suppress(OutputRejected):  # not JSON: compared as the text
            args = json.dumps(loads_strict(args, source="arguments"), sort_keys=True,
                              separators=(",", ":"))
        calls.append((str(c.get("id", "")), str(fn.get("name", "")), args))
    return str(message.get("content") or ""), tuple(calls)


def _key(m: dict[str, Any]) -> tuple[Any, ...]:
    """A chat message as compared between requests of one trajectory."""
    if m["role"] == "assistant":
        return ("assistant", *said(m))
    return (m["role"], m.get("content"), m.get("tool_call_id"))


def history_from_model(turns: list[dict[str, Any]]) -> bool:
    """Whether every assistant turn in the last request's history is what the model
    answered there: it follows the request of an earlier turn (that request is a prefix
    of the history) and, with the other assistant messages up to the next such request,
    says that turn's reply (its text, split over the answer's items or not, and no call
    the reply did not make). A reply said elsewhere (a side call made to be parroted),
    moved, repeated or invented fails; so does a history the agent trimmed or rewrote."""
    final = turns[-1]["messages"] or []
    keys = [_key(m) for m in final]
    spans: dict[int, list[Said]] = defaultdict(list)  # prefix length -> replies after it
    for t in turns[:-1]:
        prefix = [_key(m) for m in (t["messages"] or [])]
        if t["reply_message"] and prefix and keys[:len(prefix)] == prefix:
            spans[len(prefix)].append(said(t["reply_message"]))
    starts = sorted(spans)
    for k, m in enumerate(final):
        if m["role"] == "assistant" and not any(s <= k for s in starts):
            return False  # an assistant turn before any request the model answered
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(final)
        if not any(m["role"] == "assistant" for m in final[start:end]):
            continue
        if not _reply_in_place(final[start:end]):
            return False
        span = [said(m) for m in final[start:end] if m["role"] == "assistant"]
        text = "".join(t for t, _ in span)
        calls = [c for _, cs in span for c in cs]
        if not any(text == rt and _within(calls, rc) for rt, rc in spans[start]):
            return False
    return True


def as_the_model_spelled(turns: list[dict[str, Any]],
                         messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each assistant tool call's arguments as the model's recorded reply
    spelled them. :func:`history_from_model` matches arguments as JSON (SDKs re-serialize
    them), so the history's own text could differ in what JSON ignores: 200 000 spaces
    or ``\\u0031`` for ``1`` in the arguments passed, and SFT learned them as the
    model's."""
    spelled: dict[Call, str] = {}
    for t in turns[:-1]:
        for c in (t["reply_message"] or {}).get("tool_calls") or []:
            spelled.setdefault(said({"tool_calls": [c]})[1][0], c["function"]["arguments"])

    def respelled(c: dict[str, Any]) -> dict[str, Any]:
        text = spelled.get(said({"tool_calls": [c]})[1][0], c["function"]["arguments"])
        return {**c, "function": {**c["function"], "arguments": text}}

    return [{**m, "tool_calls": [respelled(c) for c in m["tool_calls"]]}
            if m["role"] == "assistant" and m.get("tool_calls") else m for m in messages]


def _reply_in_place(span: list[dict[str, Any]]) -> bool:
    """The messages after a request, up to the next: the reply starts right after the
    request, and until its last piece only the results of calls it made come between
    its pieces, with no text after a result (the model saw none when it spoke). A user or
    system message spliced between two pieces of a reply would make a piece a training
    target after words the model never read."""
    last = max(i for i, m in enumerate(span) if m["role"] == "assistant")
    if span[0]["role"] != "assistant":
        return False
    made: set[str] = set()
    answered = False
    for m in span[:last + 1]:
        if m["role"] == "assistant":
            text, calls = said(m)
            if answered and text:
                return False
            made.update(c[0] for c in calls)
        elif m["role"] == "tool" and m.get("tool_call_id") in made:
            answered = True
        else:
            return False
    return True


CONTROL_TOKEN = re.compile(
    r"<[|\uff5c][^<>\n]{1,60}[|\uff5c]>"  # ChatML, Llama 3, Phi; DeepSeek's fullwidth bars
    r"|\[/?(?:INST|SYSTEM_PROMPT|TOOL_CALLS|AVAILABLE_TOOLS|TOOL_RESULTS|TOOL_CONTENT"
    r"|IMG|IMG_BREAK|IMG_END|PREFIX|MIDDLE|SUFFIX)\]"  # Mistral
    r"|<(?:start|end)_of_turn>|<(?:bos|eos|pad|unk|sop|eop|mask)>|</?s>")  # Gemma, GLM, ...
"""Chat-template control tokens (ChatML ``<|im_start|>``, Llama 3 ``<|eot_id|>``, Phi
``<|end|>``, DeepSeek's (its bars fullwidth, U+FF5C), Mistral ``[INST]`` and
``[TOOL_CALLS]``, Gemma ``<start_of_turn>``, ``<bos>``, ``</s>``): written in a
message's text, a tokenizer reads them as the real tokens, so a tool result or a reply
could open turns of its own in a training row. ``train sft`` also checks the base
tokenizer's own special and added tokens."""


def control_token_in(value: Any) -> bool:
    """Whether any string in ``value`` (messages, tools; keys too) holds a control token."""
    return bool(CONTROL_TOKEN.search(json.dumps(value, ensure_ascii=False)))


def ambiguous_call_ids(messages: list[dict[str, Any]]) -> bool:
    """Whether an assistant message names one tool-call id twice, or two tool results
    after it answer the same id: no loader could tell which result is whose (ids left
    empty by a provider are not compared)."""
    calls: set[str] = set()
    answered: set[str] = set()
    for m in messages:
        if m["role"] == "assistant":
            calls, answered = set(), set()
            for c in m.get("tool_calls") or []:
                cid = str(c.get("id") or "")
                if cid and cid in calls:
                    return True
                calls.add(cid)
        elif m["role"] == "tool" and (cid := str(m.get("tool_call_id") or "")):
            if cid in answered:
                return True
            answered.add(cid)
    return False


def _within(calls: list[Call], reply: tuple[Call, ...]) -> bool:
    left = list(reply)
    for c in calls:
        if c not in left:
            return False
        left.remove(c)
    return True


def verl_rows(trajectories: list[dict[str, Any]], refs: dict[str, FrozenReference], *,
              ability: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, int]]:
    """(rl rows, sft rows, {reason: count} of trajectories left out of the parquet).

    A trajectory is left out of rl.parquet when its first or last request did not read
    as chat messages or its case has no frozen reference; out of sft.parquet also when it
    did not pass (``r_outcome != 1``), its last call failed (``sft_last_call_failed``:
    status ``infra_error``; a truncated stream's partial reply is recorded, but the
    container was answered 502 and never saw it), its last turn has no reply (neither
    text nor tool calls), a text of it holds a chat-template control token
    (``sft_control_token_in_content``, :data:`CONTROL_TOKEN`), a tool-call id is
    ambiguous (``sft_duplicate_tool_call_id``), or its last request holds an assistant
    turn that is not the reply the gateway recorded at that point of the same trajectory
    (``sft_history_not_from_model``, see :func:`history_from_model`: the history is
    written by the container, and SFT trains on every assistant turn in it). Each reason
    is counted. Rows carry the request's ``tools`` (rl: the first turn's, sft: the last
    turn's). An sft row's history tool calls carry their arguments as the model's reply
    spelled them (:func:`as_the_model_spelled`)."""
    rl: list[dict[str, Any]] = []
    sft: list[dict[str, Any]] = []
    skipped: dict[str, int] = defaultdict(int)
    for t in trajectories:
        first, last = t["turns"][0], t["turns"][-1]
        ref = refs.get(t["case_id"]) if t["case_id"] is not None else None
        prompt, final = first["messages"], last["messages"]
        if not prompt or not final:
            skipped["request_without_chat_messages"] += 1
            continue
        if ref is None:
            skipped["no_frozen_reference"] += 1
            continue
        extra = {"index": len(rl), "trajectory_id": t["trajectory_id"], "stage": t["stage"],
                 "case_id": t["case_id"], "trial": t["trial"], "split": ref.split,
                 "mandatory": ref.mandatory, "turns": len(t["turns"]),
                 "r_format": t["r_format"], "r_outcome": t["r_outcome"],
                 "r_outcome_basis": t["r_outcome_basis"],
                 "request_sha256": first["prompt_sha256"],
                 "last_request_sha256": last["prompt_sha256"],
                 "last_response_sha256": last["response_sha256"], "fixture": t["fixture"]}
        rl.append({"data_source": t["data_source"], "prompt": prompt, "ability": ability,
                   "reward_model": {"style": "rule", "ground_truth": json.dumps(
                       ref.reference.model_dump(mode="json"), sort_keys=True,
                       separators=(",", ":"))},
                   "extra_info": extra, "tools": first["tools"]})
        reply = last["reply_message"]
        if t["r_outcome"] != 1.0:
            skipped["sft_not_passed"] += 1
        elif last["status"] != "ok":
            skipped["sft_last_call_failed"] += 1
        elif reply is None or not (reply["content"] or reply.get("tool_calls")):
            skipped["sft_no_reply"] += 1
        elif not history_from_model(t["turns"]):
            skipped["sft_history_not_from_model"] += 1
        elif control_token_in([final := as_the_model_spelled(t["turns"], final), reply,
                               last["tools"]]):
            skipped["sft_control_token_in_content"] += 1
        elif ambiguous_call_ids([*final, reply]):
            skipped["sft_duplicate_tool_call_id"] += 1
        else:
            sft.append({"data_source": t["data_source"], "messages": [*final, reply],
                        "extra_info": {**extra, "index": len(sft)}, "tools": last["tools"]})
    return rl, sft, dict(sorted(skipped.items()))
