"""A hostile agent (or model reply) cannot crash the controller: every crash class ends
``invalid_comparison`` with a receipt that verifies and exit 2 — never 1, never a
traceback.

One cycle carries every analyst-side class at once (each case of the example gets its
own attack, chosen by its question), so the tier pays for one baseline; the worker's
deep reply needs its own cycle. Each attack is checked on its own record: the case is
``infra_invalid`` with a reason naming what was refused. Were an attack to get through,
the run would crash (no verdict, no receipt, exit 1 or 10) or the case would be ``ok``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.fixtures.cycle_project import (
    EXAMPLE,
    cli_env,
    example_agent,
    project_with_agent,
    run_cli,
    verdict,
)
from tests.fixtures.deep import remove_deep

pytestmark = [pytest.mark.docker, pytest.mark.slow]

# attack -> (case id it is played on, words its record's reason must hold)
ATTACKS = {
    "deep_answer": ("d01-revenue-march", "deeper"),
    "surrogate_escape": ("d02-revenue-books", "surrogate"),
    "surrogate_bytes": ("d03-orders-february", "invalid JSON"),
    "surrogate_name": ("d04-customers-lyon", "not UTF-8"),
    "non_utf8_name": ("d06-top-product", "not UTF-8"),
    "control_name": ("a01-revenue-april", "control character"),
    "deep_dirs": ("a02-revenue-games", "nested deeper than"),
}

HOSTILE_AGENT = '''
import json, os
from pathlib import Path

ATTACKS = __ATTACKS__
case = json.loads(Path("/case/input.json").read_text())
attack = ATTACKS.get(case["question"], "none")
good = json.dumps({"answer": "42", "attack": attack})
out = Path("/out")
if attack == "deep_answer":
    (out / "answer.json").write_text('{"a":' + "[" * 10000 + "]" * 10000 + "}")
elif attack == "surrogate_escape":
    (out / "answer.json").write_text('{"answer": "\\\\ud800"}')
elif attack == "surrogate_bytes":
    (out / "answer.json").write_bytes(b'{"answer": "\\xed\\xa0\\x80"}')
else:
    (out / "answer.json").write_text(good)
if attack == "surrogate_name":
    with open(b"/out/\\xed\\xa0\\x80.txt", "wb") as f:
        f.write(b"\\xed\\xa0\\x80")
elif attack == "non_utf8_name":
    with open(b"/out/\\xff\\xfe.json", "wb") as f:
        f.write(b"{}")
elif attack == "control_name":
    Path("/out/evil\\x1b[31m\\nname.json").write_text("{}")
elif attack == "deep_dirs":
    os.chdir("/out")
    for _ in range(1000):
        os.mkdir("d")
        os.chdir("d")
    Path("leaf.txt").write_text("deep")
'''


@pytest.fixture
def deep_cleanup(tmp_path: Path) -> Iterator[None]:
    yield
    for deep in (tmp_path / "run" / "stages").glob("*/cases/*/out/d"):
        remove_deep(deep)


def _questions() -> dict[str, str]:
    manifest = json.loads((EXAMPLE / "manifest.json").read_text())
    return {s["id"]: s["input"]["question"] for s in manifest["scenarios"]}


def _records(run: Path, side: str) -> dict[str, dict[str, object]]:
    lines = (run / "stages" / side / "records.jsonl").read_text().splitlines()
    return {r["case_id"]: r for r in map(json.loads, lines)}


def _assert_invalid_with_receipt(res: object, run: Path, tmp: Path) -> None:
    rc, out, err = res.returncode, res.stdout, res.stderr  # type: ignore[attr-defined]
    assert rc == 2, f"rc {rc}\n{out}\n{err}"
    assert "Traceback" not in err and "Traceback" not in out
    assert verdict(run)["verdict"] == "invalid_comparison"
    ver = run_cli("receipt", "verify", str(run), env=cli_env(tmp))
    assert ver.returncode == 0, ver.stdout + ver.stderr


@pytest.mark.usefixtures("deep_cleanup")
def test_hostile_analyst_outputs_end_invalid_with_a_receipt(tmp_path: Path) -> None:
    questions = _questions()
    plays = {questions[case]: attack for attack, (case, _) in ATTACKS.items()}
    agent = HOSTILE_AGENT.replace("__ATTACKS__", repr(plays))
    cycle = project_with_agent(tmp_path / "cyc", agent)
    run = tmp_path / "run"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    res = run_cli("cycle", "run", str(cycle), "--out", str(run), env=cli_env(tmp))
    _assert_invalid_with_receipt(res, run, tmp)
    records = _records(run, "baseline")
    for attack, (case, words) in ATTACKS.items():
        rec = records[case]
        assert rec["status"] == "infra_invalid", (attack, rec)
        assert words in str(rec["reason"]), (attack, rec["reason"])
    # the untouched cases ran normally: the attacks hit only their own case
    assert records["a03-refunded-count"]["status"] == "ok"
    # (the brief built from these failures matches no scripted optimizer rule, so the
    # cycle ends at propose; the attacks' evidence is in the baseline records above)
    assert verdict(run)["reasons"]


def test_worker_reply_nested_5k_deep_ends_invalid(tmp_path: Path) -> None:
    cycle = project_with_agent(tmp_path / "cyc", example_agent())
    deep = '{"files": ' + "[" * 5000 + "]" * 5000 + "}"
    script = tmp_path / "cyc" / "scripts" / "optimizer-deep.yaml"
    script.write_text(yaml.safe_dump({"schema": 1, "rules": [
        {"when": {"role": "worker"}, "reply": deep}]}))
    cyc = yaml.safe_load(cycle.read_text())
    cyc["upstreams"]["optimizer"]["script"] = str(script)
    cycle.write_text(yaml.safe_dump(cyc))
    run = tmp_path / "run"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    res = run_cli("cycle", "run", str(cycle), "--out", str(run), env=cli_env(tmp))
    _assert_invalid_with_receipt(res, run, tmp)
    reasons = " ".join(verdict(run)["reasons"])
    assert "no candidate" in reasons and "malformed_proposal" in reasons, reasons
