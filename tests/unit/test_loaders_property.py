"""Every loader, driven with generated and mutated inputs (hypothesis).

Seeds are the bundled example's real files (cycle, manifest, comparison policy, roles,
scripts) and real-shaped documents for the rest (proposal, records, receipt, plan). Each
example mutates bytes (flips, inserts of YAML/JSON hazards, deletions, truncation) or
values (any path set to None, bools, huge or non-finite numbers, odd strings, nested
containers; keys dropped or added). The property: a loader returns its model or raises
the documented bad-input error naming the file — never anything else.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.cycle.apply import load_proposal
from runner.cycle.compare import load_policy, load_records
from runner.cycle.config import check_inputs, load_cycle
from runner.cycle.manifest import load_manifest
from runner.cycle.plan import freeze, load_plan
from runner.cycle.receipt import load_receipt
from runner.errors import ConfigError, IntegrityError
from runner.gateway.providers import load_script
from runner.isolation.policy import load_policies
from runner.paths import PROJECT_ROOT
from runner.train.host import load_persona

EXAMPLE = PROJECT_ROOT / "examples" / "shop-analyst"
ROLES = PROJECT_ROOT / "policies" / "roles.yaml"
# A fast, fixed tier by default; CYCLEBOX_PROPERTY_EXAMPLES=2000 runs a deeper random search.
DEEP = int(os.environ.get("CYCLEBOX_PROPERTY_EXAMPLES", "0"))
SETTINGS = settings(max_examples=DEEP or 40, deadline=None, derandomize=not DEEP,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

HAZARDS = [b"&a ", b"*a", b"<<: ", b"!!python/object/apply:os.system ", b".inf", b".nan",
           b"-.inf", b"\xff", b"\x00", b"\xc3", b"[" * 80, b"{" * 80, b'"', b"NaN", b"1e999",
           b"Infinity", b'"\\ud800"', b"- ", b": ", b"\n", b"\t", b"~", b"null", b"? ",
           b"9" * 5000, b"\xef\xbb\xbf", b"%YAML 1.1\n---\n", b"---\n", b"..."]

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=24)
           | st.sampled_from(["", "..", "/etc", "../../x", "0", "-1", "inf", "nan", "512m",
                              "0m", "development", "acceptance", "train", "*", "a" * 300]))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=3)
                      | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=6)


def _paths(doc: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*at, i))


@st.composite
def mutated_doc(draw: st.DrawFn, doc: Any) -> Any:
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(doc))))
        if not path:
            doc = draw(values)
            continue
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        op = draw(st.sampled_from(["set", "set", "delete", "add"]))
        if op == "set":
            parent[path[-1]] = draw(values)
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=10))] = draw(values)
        else:
            parent.append(draw(values))
    return doc


@st.composite
def mutated_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    for _ in range(draw(st.integers(1, 3))):
        n = len(data)
        i = draw(st.integers(0, n))
        kind = draw(st.sampled_from(["flip", "insert", "insert", "delete", "truncate", "dup"]))
        if kind == "flip" and n:
            j = min(i, n - 1)
            data = data[:j] + bytes([draw(st.integers(0, 255))]) + data[j + 1:]
        elif kind == "insert":
            data = data[:i] + draw(st.sampled_from(HAZARDS) | st.binary(max_size=12)) + data[i:]
        elif kind == "delete":
            data = data[:i] + data[i + draw(st.integers(1, 64)):]
        elif kind == "truncate":
            data = data[:i]
        else:
            j = min(n, i + draw(st.integers(1, 200)))
            data = data[:j] + data[i:j] + data[j:]
    return data


def _dump(doc: Any, fmt: str) -> bytes:
    if fmt == "json":
        return json.dumps(doc, allow_nan=True).encode()
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False).encode()


def inputs(seed: bytes, fmt: str) -> st.SearchStrategy[bytes]:
    doc = json.loads(seed) if fmt == "json" else yaml.safe_load(seed)
    return (mutated_bytes(seed) | mutated_doc(doc).map(lambda d: _dump(d, fmt))
            | st.binary(max_size=64))


def holds(load: Callable[[Path], object], path: Path, data: bytes, *,
          integrity: bool = False) -> None:
    """The property for one input: a model, or the documented error naming the file."""
    path.write_bytes(data)
    try:
        load(path)
    except ConfigError as exc:
        assert path.name in str(exc), str(exc)
        assert "\x1b" not in str(exc) and "\x00" not in str(exc)
    except IntegrityError as exc:
        assert integrity, f"IntegrityError from a loader that documents none: {exc}"


# -- the seeds ---------------------------------------------------------------------------------
def _abs_cycle() -> bytes:
    doc = yaml.safe_load((EXAMPLE / "cycle.yaml").read_text())
    doc["project"]["repo"] = str(PROJECT_ROOT)
    doc["roles"] = str(ROLES)
    doc["scenarios"] = str(EXAMPLE / "manifest.json")
    doc["policy"] = str(EXAMPLE / "policy.yaml")
    doc["data_dir"] = str(EXAMPLE / "data")
    for up in doc["upstreams"].values():
        up["script"] = str((EXAMPLE / up["script"]).resolve())
    return yaml.safe_dump(doc, sort_keys=False).encode()


def _abs_roles() -> bytes:
    doc = yaml.safe_load(ROLES.read_text())
    return yaml.safe_dump(doc, sort_keys=False).encode()


RECORD = {"case_id": "d01", "trial": 0, "split": "development", "status": "ok",
          "reason": None, "answer": {"value": 1.5}, "latency_s": 0.2,
          "grades": {"correctness": True, "evidence": True, "refusal": None},
          "usage": {"analyst": {"calls": 1, "tokens": 10, "cost_usd": 0.001, "complete": True}},
          "identities": {"data_hash": "a" * 64, "reference_hash": "b" * 64, "scorer": "c" * 64}}
PROPOSAL = {"schema": 1, "files": [{"path": "prompts/system.md", "content": "be careful\n"}],
            "rationale": "r", "base": {"prompts/system.md": "d" * 64},
            "paths": ["prompts/system.md"], "allowlist": ["prompts/*.md"]}
_TOTALS = {"calls": 1, "ok": 1, "refused": 0, "infra_error": 0, "tokens": 9,
           "cost_usd": 0.5, "complete": True, "fixture_calls": 1}
RECEIPT = {"schema": 1, "generated_at": "2026-01-01T00:00:00+00:00", "plan_hash": "e" * 64,
           "inputs": {"plan": "1" * 64},
           "identities": {"reference_hash": "r", "data_hash": "d", "scorer": "s",
                          "judge_id": None, "manifest_sha256": "m"},
           "base_tree": "b" * 40, "images": {"analyst": "sha256:" + "a" * 64},
           "upstreams": {"target": {"provider": "scripted", "credential": None,
                                    "fixture": True, "id": "i"}},
           "containers": [{"stage": "baseline", "case": "c1", "trial": 0, "run_id": "r",
                           "role": "analyst", "image_id": "sha256:x", "container_name": "n",
                           "exit_code": 0, "stop_reason": "ok", "detail": "", "wall_s": 1.5,
                           "stdout_bytes": 0, "stderr_bytes": 0, "cleanup_confirmed": True,
                           "labels": {"io.cyclebox.role": "analyst"}}],
           "usage": {"per_role": {"analyst": _TOTALS}, "total": _TOTALS}, "fixture": True,
           "proposal_sha256": None, "patch_sha256": None,
           "verdict": {"verdict": "reject", "reasons": ["mandatory case c1 failed"],
                       "regressions": [], "improvements": [], "usage": {}, "statistics": None},
           "leftovers": [], "dream": None, "timing": {"baseline": 1.0},
           "outcome": {"inputs": "1" * 64, "proposal_sha256": None, "patch_sha256": None,
                       "candidate_tree": None, "verdict": "reject", "verdict_sha256": "v",
                       "baseline_records_sha256": None, "candidate_records_sha256": None,
                       "calls_sha256": "c"},
           "external": {"store:shop": {"path": "/nonexistent/shop.sqlite", "sha256": "0" * 64}},
           "files": {"plan.json": "f" * 64}, "files_not_utf8": {}}


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="cyclebox-prop-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def plan_seed(work: Path) -> Path:
    cycle = work / "seed-cycle.yaml"
    cycle.write_bytes(_abs_cycle())
    fake = {r: f"sha256:{'0' * 64}" for r in ("analyst", "worker", "evaluator", "apply")}
    freeze(cycle, work / "run", images=fake)
    return work / "run" / "plan.json"


# -- the properties ------------------------------------------------------------------------------
@SETTINGS
@given(data=inputs(_abs_cycle(), "yaml"))
def test_cycle_loader(data: bytes, work: Path) -> None:
    def load(p: Path) -> object:
        cycle, base = load_cycle(p)
        return check_inputs(cycle, p, base)

    holds(load, work / "cycle.yaml", data)


@SETTINGS
@given(data=inputs((EXAMPLE / "manifest.json").read_bytes(), "json"))
def test_manifest_loader(data: bytes, work: Path) -> None:
    holds(lambda p: load_manifest(p, EXAMPLE / "data"), work / "manifest.json", data,
          integrity=True)  # edited references or stores are drift against the hashes


@SETTINGS
@given(data=inputs((EXAMPLE / "policy.yaml").read_bytes(), "yaml"))
def test_policy_loader_yaml(data: bytes, work: Path) -> None:
    holds(load_policy, work / "policy.yaml", data)


@SETTINGS
@given(data=inputs(json.dumps(yaml.safe_load((EXAMPLE / "policy.yaml").read_text())).encode(),
                   "json"))
def test_policy_loader_json(data: bytes, work: Path) -> None:
    holds(load_policy, work / "policy.json", data)


@SETTINGS
@given(data=inputs(_abs_roles(), "yaml"))
def test_roles_loader(data: bytes, work: Path) -> None:
    holds(load_policies, work / "roles.yaml", data)


@SETTINGS
@given(data=inputs((EXAMPLE / "scripts" / "optimizer.yaml").read_bytes(), "yaml"))
def test_script_loader(data: bytes, work: Path) -> None:
    holds(load_script, work / "script.yaml", data)


@SETTINGS
@given(data=inputs(json.dumps(PROPOSAL).encode(), "json"))
def test_proposal_loader(data: bytes, work: Path) -> None:
    holds(load_proposal, work / "proposal.json", data)


@SETTINGS
@given(data=inputs(json.dumps(RECORD).encode(), "json"),
       more=st.sampled_from([b"", b"\n", b"\n" + json.dumps(RECORD).encode(), b"\n\n[]"]))
def test_records_loader(data: bytes, more: bytes, work: Path) -> None:
    holds(load_records, work / "records.jsonl", data + more)


@SETTINGS
@given(data=inputs((PROJECT_ROOT / "examples/persona/captain.yaml").read_bytes(), "yaml"))
def test_persona_loader(data: bytes, work: Path) -> None:
    holds(load_persona, work / "persona.yaml", data)


@SETTINGS
@given(data=inputs(json.dumps(RECEIPT).encode(), "json"))
def test_receipt_loader(data: bytes, work: Path) -> None:
    run = work / "receipt-run"
    run.mkdir(exist_ok=True)
    holds(lambda p: load_receipt(p.parent), run / "receipt.json", data)


@settings(max_examples=DEEP or 25, deadline=None, derandomize=not DEEP,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_plan_loader(data: st.DataObject, plan_seed: Path) -> None:
    seed = plan_seed.read_bytes()
    blob = data.draw(inputs(seed, "json"))
    target = plan_seed.parent / "plan-mutated.json"
    try:
        holds(load_plan, target, blob, integrity=True)  # edited plans fail their hashes
    finally:
        target.unlink(missing_ok=True)


def test_the_unmutated_seeds_load(plan_seed: Path, work: Path) -> None:
    """The property above is not vacuous: each seed is a valid input as it stands."""
    p = work / "seed.yaml"
    p.write_bytes(_abs_cycle())
    cycle, base = load_cycle(p)
    check_inputs(cycle, p, base)
    load_manifest(EXAMPLE / "manifest.json", EXAMPLE / "data")
    load_policy(EXAMPLE / "policy.yaml")
    (work / "roles-seed.yaml").write_bytes(_abs_roles())
    load_policies(work / "roles-seed.yaml")
    load_script(EXAMPLE / "scripts" / "optimizer.yaml")
    (work / "p.json").write_text(json.dumps(PROPOSAL))
    load_proposal(work / "p.json")
    (work / "r.jsonl").write_text(json.dumps(RECORD) + "\n")
    assert len(load_records(work / "r.jsonl")) == 1
    (work / "rr").mkdir(exist_ok=True)
    (work / "rr" / "receipt.json").write_text(json.dumps(RECEIPT))
    assert load_receipt(work / "rr").plan_hash == "e" * 64
    assert load_persona(PROJECT_ROOT / "examples/persona/captain.yaml").name == "captain-brine"
    assert load_plan(plan_seed)[0].name == "shop-analyst"
