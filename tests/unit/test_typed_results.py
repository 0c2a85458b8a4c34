"""Results are frozen models whose JSON is what the files always held.

Each writer now builds a model and writes ``model_dump(mode="json")``; these tests pin
that the bytes are unchanged (same keys, same values, no int turned float), that a value
of the wrong shape is refused naming its field, and the pure decisions that came with
the types (the apply container's claim, the worker's proposal, receipt comparison).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from runner.cycle.apply import read_claim, read_proposal
from runner.cycle.dream import DreamSummary
from runner.cycle.dream_compare import DreamReceipt
from runner.cycle.models import Applied, ApplyRefusal
from runner.cycle.receipt import Receipt, compare_receipts
from runner.errors import ConfigError, OutputRejected
from runner.gateway.calllog import CallRecord, Usage
from runner.gateway.report import summarize
from runner.hashing import canonical_bytes, write_json
from runner.isolation.sandbox import RunRecord, StopReason
from runner.loading import load_lines, parse_model
from runner.train.results import ProofReceipt, ProofReport, SftReceipt

TOTALS = {"calls": 3, "ok": 2, "refused": 1, "infra_error": 0, "tokens": 12,
          "cost_usd": 0.0021921, "complete": True, "fixture_calls": 2}
UNKNOWN = {**TOTALS, "cost_usd": None, "complete": False, "cost_usd_known_part": 0.5}
DREAM = {"mode": "model", "source_tasks": 2, "requested": 4, "accepted": 3, "fallback": 1,
         "reasons": {"duplicate": 1, "semantic_reject": 0}, "optimizer_tokens": 7,
         "optimizer_cost_usd": None, "cost_complete": False}
RECEIPT: dict[str, Any] = {
    "schema": 1, "candidate_git_bound": True, "generated_at": "2026-11-29T23:43:02+00:00",
    "plan_hash": "a" * 64,
    "inputs": {"brief": "b" * 64, "upstreams": "c" * 64},
    "identities": {"reference_hash": "r" * 64, "data_hash": "d" * 64, "scorer": "s" * 64,
                   "judge_id": None, "manifest_sha256": "m" * 64},
    "base_tree": "e" * 40, "images": {"analyst": "sha256:" + "1" * 64},
    "upstreams": {"target": {"provider": "scripted", "credential": None, "fixture": True,
                             "id": "9" * 64},
                  "judge": {"provider": "openai", "credential": "JUDGE_KEY", "fixture": False,
                            "id": None}},
    "containers": [{"stage": "baseline", "case": "d01", "trial": 0, "run_id": "shop-1",
                    "role": "analyst", "image_id": "sha256:" + "1" * 64,
                    "container_name": "cyclebox-shop-1-analyst-5c03646a", "exit_code": 0,
                    "stop_reason": "ok", "detail": "", "wall_s": 1.023, "stdout_bytes": 0,
                    "stderr_bytes": 0, "cleanup_confirmed": True,
                    "labels": {"io.cyclebox.case": "d01", "io.cyclebox.trial": "0"}},
                   {"stage": "apply", "case": None, "trial": None, "run_id": "shop-1",
                    "role": "apply", "image_id": "sha256:" + "2" * 64, "container_name": "c2",
                    "exit_code": None, "stop_reason": "timeout", "detail": "killed",
                    "wall_s": 30.0, "stdout_bytes": 5, "stderr_bytes": 1,
                    "cleanup_confirmed": True, "labels": {}}],
    "usage": {"per_role": {"analyst": UNKNOWN, "worker": TOTALS}, "total": UNKNOWN},
    "fixture": True, "proposal_sha256": "3" * 64, "patch_sha256": None,
    "verdict": {"verdict": "invalid_comparison", "reasons": ["apply: timeout"],
                "regressions": [{"case_id": "a1", "trial": 0, "criterion": "correctness",
                                 "baseline": True, "candidate": False}],
                "improvements": [], "usage": {"baseline": {"analyst": {"calls": 1}}},
                "statistics": {"method": "mcnemar_exact", "pairs": 2, "p": 0.5}},
    "leftovers": ["cyclebox-shop-1-apply-x"], "dream": DREAM,
    "timing": {"baseline": 7.244, "brief": 0.0},
    "outcome": {"inputs": "4" * 64, "proposal_sha256": "3" * 64, "patch_sha256": None,
                "candidate_tree": None, "verdict": "invalid_comparison",
                "verdict_sha256": "5" * 64, "baseline_records_sha256": "6" * 64,
                "candidate_records_sha256": None, "calls_sha256": "7" * 64},
    "external": {"store:shop": {"path": "/data/shop.sqlite", "sha256": "8" * 64}},
    "files": {"plan.json": "f" * 64}, "files_not_utf8": {"stages/caf\\xe9": "0" * 64},
}


def _call(role: str, status: str, cost: float | None, **kw: Any) -> CallRecord:
    return CallRecord(seq=0, ts="t", run_id="r", role=role, upstream="target", stage="s",
                      turn=0, provider="scripted", model="m", fixture=False, status=status,
                      latency_s=0.1, request_sha256="0" * 64, cost_usd=cost,
                      usage=Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3), **kw)


# -- the receipt ----------------------------------------------------------------------------------

def test_receipt_round_trips_to_the_same_canonical_bytes() -> None:
    receipt = Receipt.model_validate(RECEIPT)
    assert canonical_bytes(receipt) == canonical_bytes(RECEIPT)
    assert receipt.containers[1].stop_reason is StopReason.TIMEOUT
    assert receipt.usage.total.cost_usd_known_part == 0.5


@pytest.mark.parametrize(("edit", "field"), [
    (lambda r: r.pop("generated_at"), "generated_at"),
    (lambda r: r["usage"].update(total={**UNKNOWN, "calls": "many"}), "usage.total.calls"),
    (lambda r: r["outcome"].update(extra=1), "outcome.extra"),
    (lambda r: r["containers"][0].update(stop_reason="crashed"), "containers[0].stop_reason"),
])
def test_a_receipt_of_another_shape_names_the_field(edit: Any, field: str,
                                                    tmp_path: Path) -> None:
    doc = copy.deepcopy(RECEIPT)
    edit(doc)
    with pytest.raises(ConfigError) as info:
        parse_model(json.dumps(doc).encode(), Receipt, path="receipt.json", fix="f")
    assert info.value.field == field


def test_compare_receipts_rows_and_what_they_skip() -> None:
    a = Receipt.model_validate(RECEIPT)
    other = copy.deepcopy(RECEIPT)
    other["inputs"]["brief"] = "0" * 64
    other["inputs"]["upstreams"] = "1" * 64  # a replay answers from the recording: skipped
    other["outcome"]["calls_sha256"] = "2" * 64
    other["timing"] = {"baseline": 1.0}  # timings are never compared
    rows = {r.key: r for r in compare_receipts(a, Receipt.model_validate(other))}
    assert list(rows)[:3] == ["identities", "base_tree", "images"]
    assert "inputs.upstreams" not in rows and "outcome.inputs" not in rows
    assert [k for k, r in rows.items() if not r.equal] == ["inputs.brief",
                                                          "outcome.calls_sha256"]
    assert rows["identities"].recorded == RECEIPT["identities"]
    assert all(r.equal for r in compare_receipts(a, a))


# -- usage totals ---------------------------------------------------------------------------------

def test_usage_totals_name_the_known_part_only_when_a_cost_is_unknown() -> None:
    known = summarize([_call("analyst", "ok", 0.25), _call("analyst", "refused", None)])
    assert known.total.model_dump(mode="json") == {
        "calls": 2, "ok": 1, "refused": 1, "infra_error": 0, "tokens": 6, "cost_usd": 0.25,
        "complete": True, "fixture_calls": 0}
    mixed = summarize([_call("worker", "ok", 0.25), _call("analyst", "ok", None)])
    assert mixed.model_dump(mode="json")["total"]["cost_usd_known_part"] == 0.25
    assert mixed.total.cost_usd is None and mixed.total.complete is False
    assert list(mixed.per_role) == ["analyst", "worker"]
    assert "cost_usd_known_part" not in mixed.per_role["worker"].model_dump(mode="json")


# -- the apply container's claim ------------------------------------------------------------------

def _rec(stop: StopReason = StopReason.OK, detail: str = "") -> RunRecord:
    return RunRecord(run_id="r", role="apply", image_id="i", container_name="c", exit_code=0,
                     stop_reason=stop, detail=detail, wall_s=1.0, stdout_bytes=0,
                     stderr_bytes=0, stdout_tail="", stderr_tail="", cleanup_confirmed=True)


APPLIED = {"base_commit": "1" * 40, "branch": "cyclebox/candidate",
           "changed": ["prompts/system.md"], "commit": "2" * 40, "status": "applied",
           "tree": "3" * 40}


def test_an_applied_claim_keeps_the_bytes_the_stage_always_wrote(tmp_path: Path) -> None:
    claim = read_claim(APPLIED, _rec())
    assert isinstance(claim, Applied) and claim.commit == "2" * 40
    write_json(tmp_path / "a.json", APPLIED)
    write_json(tmp_path / "b.json", claim.model_dump(mode="json"))
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    refused = {"status": "refused", "reason": "outside_allowlist", "message": "x"}
    assert read_claim(refused, _rec()).model_dump(mode="json") == refused


@pytest.mark.parametrize(("data", "message"), [
    ([1], "result.json: expected a JSON object; container timeout (slow)"),
    ({**APPLIED, "commit": "--upload-pack=touch /tmp/pwned"},
     "result.json: commit is not a git object id"),
    ({**APPLIED, "commit": "A" * 40}, "result.json: commit is not a git object id"),
    ({"status": "applied", "commit": "2" * 40}, "result.json: applied.base_commit: Field "
                                                "required"),
    ({"status": "refused", "reason": "r", "message": "m", "extra": 1},
     "result.json: refused.extra: Extra inputs are not permitted"),
    ({"status": "maybe"}, "result.json: (top level): Input tag 'maybe'"),
])
def test_a_claim_of_another_shape_is_refused_naming_it(data: object, message: str) -> None:
    rec = _rec(StopReason.TIMEOUT, "slow") if isinstance(data, list) else _rec()
    claim = read_claim(data, rec)
    assert isinstance(claim, ApplyRefusal) and claim.reason == "output_refused"
    assert claim.message.startswith(message), claim.message


# -- the worker's proposal on the host ------------------------------------------------------------

def test_the_workers_proposal_is_written_on_unchanged(tmp_path: Path) -> None:
    # as sandbox/worker.py writes it
    doc = {"schema": 1, "files": [{"path": "prompts/system.md", "content": "Be brief.\n"}],
           "rationale": "shorter", "base": {"prompts/system.md": "0" * 64}}
    raw = json.dumps(doc, sort_keys=True, indent=1).encode()
    proposal = read_proposal(raw)
    write_json(tmp_path / "a.json", doc)
    write_json(tmp_path / "b.json", proposal.model_dump(mode="json", by_alias=True))
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


@pytest.mark.parametrize(("doc", "field"), [
    ({"files": [{"path": "a"}]}, "files[0].content"),
    ({"files": [], "paths": ["a"]}, "paths"),
    ({"files": "a"}, "files"),
])
def test_a_worker_proposal_of_another_shape_is_refused(doc: object, field: str) -> None:
    with pytest.raises(OutputRejected, match=re.escape(f"proposal.json: {field}: ")):
        read_proposal(json.dumps(doc).encode())


# -- dream and training ---------------------------------------------------------------------------

def test_dream_receipt_round_trips() -> None:
    arm = {"dir": "/x/off", "plan_hash": "p", "receipt_sha256": "r", "verdict": "reject",
           "reasons": ["a"], "heldout_cases": ["a1"],
           "heldout": {"baseline": {"passed": 1, "total": 2, "rate": 0.5}, "candidate": None},
           "cost_usd": 0.003, "cost_complete": True, "model_calls": 9, "dream": None,
           "patch_sha256": None}
    doc = {"schema": 1, "kind": "dream-paired", "cycle_sha256": "c",
           "dream": {"mode": "model", "factor": 2, "intent_key": "question"},
           "arms": {"off": arm, "on": {**arm, "dream": DREAM}}, "acceptance_rate": 0.75,
           "fallback_rate": 0.25, "heldout_delta": None, "incremental_cost_usd": 0.0,
           "lift_claimed": False, "claim": "no lift claimed"}
    assert canonical_bytes(DreamReceipt.model_validate(doc)) == canonical_bytes(doc)
    assert DreamSummary.model_validate(DREAM).model_dump(mode="json") == DREAM


FIGURES = {"steps": 24, "epochs": 24, "grad_accum": 1, "lr": 0.002, "train_tokens": 900,
           "seconds": 6.1, "tokens_per_s": 147.5, "final_loss": 0.4, "peak_rss_mb": 812.3}
SCORES = {"similarity_before": 0.2, "similarity_after": 0.9, "imprint_delta": 0.7,
          "changed": 0.8}


def test_train_files_round_trip_without_changing_a_number() -> None:
    base = {"schema": 1, "config": {"lr": 0.002, "seed": 0, "lora": {"r": 16}},
            "config_sha256": "c", "dataset_sha256": "d", "adapter_files": {"a": "1"},
            "base_model_files": {"config.json": "2"}}
    proof = {**base, "kind": "proof", "recall_before": 0.0, "recall_after": 1.0,
             "scores": SCORES, "classroom_passed": True, "board": "approve"}
    sft = {**base, "kind": "sft", "figures": {**FIGURES, "tokens_per_s": None},
           "selection": {"include_failed": False, "rule": "r_outcome == 1", "trajectories": 6,
                         "by_r_outcome": {"1": 3, "0": 2, "null": 1}, "used": 3,
                         "left_out": 3, "rows": 3, "rows_with_special_tokens": 0},
           "base_model": {"host_path": "/m", "container_path": "/model"},
           "corpus_sha256": "e"}
    report = {"persona": "p", "schedule": {"epochs": 24, "grad_accum": 1, "reason": "<=8"},
              "figures": FIGURES, "probes": ["q"], "references": ["a"], "before": ["x"],
              "after": ["a"], "recall_before": 0.0, "recall_after": 1.0, "scores": SCORES,
              "classroom_passed": True,
              "board": {"members": {"recall": "approve"}, "decision": "approve"}}
    for model, doc in ((ProofReceipt, proof), (SftReceipt, sft), (ProofReport, report)):
        assert json.dumps(model.model_validate(doc).model_dump(mode="json", by_alias=True),
                          sort_keys=True) == json.dumps(doc, sort_keys=True)
    with pytest.raises(ConfigError, match="kind"):
        parse_model(json.dumps(sft).encode(), ProofReceipt, path="train-receipt.json", fix="f")


# -- JSON Lines -----------------------------------------------------------------------------------

def test_load_lines_names_the_line_and_field(tmp_path: Path) -> None:
    good = json.dumps({"passed": 1, "total": 2, "rate": 0.5})
    f = tmp_path / "rows.jsonl"
    f.write_text(f"{good}\n\n{good}\n")
    from runner.cycle.dream_compare import Heldout

    assert len(load_lines(f, Heldout, fix="x")) == 2
    f.write_text(f'{good}\n{{"passed": 1, "total": "many", "rate": null}}\n')
    with pytest.raises(ConfigError, match=r"rows\.jsonl:2: total: ") as info:
        load_lines(f, Heldout, fix="x")
    assert info.value.field == "total"
