"""Dream variants end to end: the paired receipt, optimizer-only calls, held-out isolation,
and dream off being byte-for-byte a cycle without the key."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.paths import PROJECT_ROOT

pytestmark = [pytest.mark.docker, pytest.mark.slow]
EXAMPLE = PROJECT_ROOT / "examples" / "shop-analyst"
CLI = str(Path(sys.executable).with_name("cyclebox"))


def cyclebox(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=900,
                          check=False)


@pytest.fixture(scope="module")
def paired(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("dream") / "paired"
    res = cyclebox("dream", "compare", str(EXAMPLE / "cycle-dream.yaml"), "--out", str(out),
                   "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    return out, json.loads((out / "dream-receipt.json").read_text())


def test_paired_receipt_matches_hand_count(paired: tuple[Path, dict[str, Any]]) -> None:
    out, r = paired
    on, off = r["arms"]["on"], r["arms"]["off"]
    # 6 development tasks x factor 2 (see DREAM_REPLIES in examples/shop-analyst/make_data.py):
    # accepted d01#0 d02#0 d03#0 d05#0 d05#1; d01#1 drops "2026" and d02#1 is the source
    # in capitals (deterministic_fidelity); d03#1 judged not equivalent (semantic_reject);
    # d04's reply is prefixed prose (malformed_generation x2); d06 has no reply
    # (generation_error x2).
    d = on["dream"]
    assert (d["source_tasks"], d["requested"], d["accepted"], d["fallback"]) == (6, 12, 5, 7)
    assert {k: v for k, v in d["reasons"].items() if v} == {
        "deterministic_fidelity": 2, "semantic_reject": 1, "malformed_generation": 2,
        "generation_error": 2}
    assert r["acceptance_rate"] == pytest.approx(5 / 12, abs=1e-6)
    assert r["fallback_rate"] == pytest.approx(7 / 12, abs=1e-6)
    # held-out = the 8 acceptance cases; baseline 4/8 in both arms; the candidate fixes the
    # refund cases in both arms and a08 ("takings") only with dream on.
    assert off["heldout"] == {"baseline": {"passed": 4, "total": 8, "rate": 0.5},
                              "candidate": {"passed": 7, "total": 8, "rate": 0.875}}
    assert on["heldout"] == {"baseline": {"passed": 4, "total": 8, "rate": 0.5},
                             "candidate": {"passed": 8, "total": 8, "rate": 1.0}}
    assert r["heldout_delta"] == 0.125 and r["lift_claimed"] is True
    assert off["verdict"] == on["verdict"] == "accept_for_review"
    assert r["incremental_cost_usd"] == pytest.approx(on["cost_usd"] - off["cost_usd"])
    assert r["incremental_cost_usd"] > 0
    assert (off["model_calls"], on["model_calls"]) == (29, 51)
    events = (out / "on/stages/dream/events.jsonl").read_text().splitlines()
    assert len(events) == 7
    assert on["dream"]["optimizer_tokens"] > 0


def _calls(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "gateway/calls.jsonl").read_text().splitlines()]


def test_dream_calls_use_optimizer_credentials_only(paired: tuple[Path, dict[str, Any]]
                                                    ) -> None:
    out, _ = paired
    dream_calls = [c for c in _calls(out / "on") if c["stage"].startswith("dream-")]
    assert len([c for c in dream_calls if c["stage"] == "dream-generate"]) == 6
    assert len([c for c in dream_calls if c["stage"] == "dream-verify"]) == 4
    assert {(c["role"], c["upstream"]) for c in dream_calls} == {("worker", "optimizer")}
    target_calls = [c for c in _calls(out / "on") if c["upstream"] == "target"]
    assert all(c["role"] == "analyst" and not c["stage"].startswith("dream")
               for c in target_calls)
    assert not [c for c in _calls(out / "off") if c["stage"].startswith("dream")]


def test_no_heldout_intent_reaches_the_generator(paired: tuple[Path, dict[str, Any]]) -> None:
    out, _ = paired
    manifest = json.loads((EXAMPLE / "manifest.json").read_text())
    held = [s["input"]["question"] for s in manifest["scenarios"] if s["split"] != "development"]
    blobs = out / "on/gateway/blobs"
    dream_requests = [(blobs / c["request_sha256"]).read_text()
                      for c in _calls(out / "on") if c["stage"].startswith("dream-")]
    assert dream_requests
    for text in dream_requests:
        decoded = json.dumps(json.loads(text))  # same escaping as the questions below
        for q in held:
            assert q not in text and json.dumps(q)[1:-1] not in decoded, q
    variants = json.loads((out / "on/stages/dream/variants.json").read_text())
    assert {v["derived_from"] for v in variants} <= {
        s["id"] for s in manifest["scenarios"] if s["split"] == "development"}
    assert all(v["split"] == "train" and v["origin"] == "dream" for v in variants)
    policy_cases = json.loads((out / "on/plan.json").read_text())["plan"]["policy"]["cases"]
    assert not {v["id"] for v in variants} & set(policy_cases)


def test_dream_off_equals_no_key(tmp_path: Path) -> None:
    runs = {}
    d = tmp_path / "example"
    shutil.copytree(EXAMPLE, d, ignore=shutil.ignore_patterns("project"))
    for name, extra in (("nokey", {}), ("off", {"dream": {"mode": "off", "factor": 3}})):
        cyc = yaml.safe_load((EXAMPLE / "cycle.yaml").read_text())
        cyc["project"]["repo"] = str(PROJECT_ROOT)
        cyc["roles"] = str(PROJECT_ROOT / "policies" / "roles.yaml")
        cyc["upstreams"]["judge"]["script"] = str(PROJECT_ROOT / "policies/scripts/default.yaml")
        cyc.update(extra)
        (d / f"cycle-{name}.yaml").write_text(yaml.safe_dump(cyc))
        res = cyclebox("cycle", "run", str(d / f"cycle-{name}.yaml"), "--out",
                       str(tmp_path / name))
        assert res.returncode == 0, res.stdout + res.stderr
        runs[name] = tmp_path / name
    a, b = (json.loads((runs[n] / "receipt.json").read_text()) for n in ("nokey", "off"))
    assert not (runs["off"] / "stages" / "dream").exists()
    assert not [c for c in _calls(runs["off"]) if c["stage"].startswith("dream")]
    assert {k: v for k, v in a["outcome"].items() if k != "inputs"} == {
        k: v for k, v in b["outcome"].items() if k != "inputs"}
    # every frozen section is equal except: the copied cycle file itself (inputs), the
    # dream factor that mode off never reads, and upstream script paths that point into
    # each run's own inputs/ (their content is bound by upstream_ids, which are equal)
    diff = {k for k in a["inputs"] if a["inputs"][k] != b["inputs"][k]}
    assert diff <= {"inputs", "dream", "upstreams"}
    assert a["inputs"]["upstream_ids"] == b["inputs"]["upstream_ids"]
    for rel in ("stages/propose/out/proposal.json", "stages/apply/candidate.patch",
                "stages/brief/brief.md", "stages/propose/in/request.json"):
        assert (runs["nokey"] / rel).read_bytes() == (runs["off"] / rel).read_bytes(), rel
    for side in ("baseline", "candidate"):  # identical but for measured latency
        rows = [[{k: v for k, v in json.loads(x).items() if k != "latency_s"}
                 for x in (runs[n] / f"stages/{side}/records.jsonl").read_text().splitlines()]
                for n in ("nokey", "off")]
        assert rows[0] == rows[1]
