"""Terminal injection: untrusted strings reach the CLI's output only as visible escapes.

Each test runs the real `cyclebox` CLI in a subprocess on input carrying ESC/OSC/CSI
sequences, BEL, CR-overwrite, backspace, DEL, a C1 CSI, bidi overrides and rich markup
(`[bold]`, `[link=...]`, an unbalanced `[/]`), and asserts: no crash, no raw control or
bidi character in stdout/stderr, and the escaped form visible (so the test fails if the
string was simply dropped, or if it got through raw).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from runner.gateway.calllog import CallRecord
from runner.hashing import sha256_bytes, sha256_json

CLI = [str(Path(sys.executable).with_name("cyclebox"))]
if not Path(CLI[0]).exists():  # pragma: no cover - fallback when not installed as a script
    CLI = [sys.executable, "-m", "runner.cli"]

OSC_LINK = "\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\"
HOSTILE = (f"{OSC_LINK} \x1b]0;pwned-title\x07 \x1b[2J\x1b[31mred\x1b[0m bell\x07 "
           "visible\rOVERWRITE back\x08\x08 del\x7f c1\x9b31m \u202eevil\u202c "
           "\u2066iso\u2069 [bold]bold[/bold] [link=http://evil.example]link[/link] [/] ]")
MARKUP = ("[bold]bold[/bold]", "[link=http://evil.example]link[/link]")


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE")}
    env.update({"COLUMNS": "400", "TERM": "xterm-256color", "PYTHONIOENCODING": "utf-8"})
    return subprocess.run([*CLI, *args], capture_output=True, timeout=120, check=False,
                          env=env, cwd=cwd)


def assert_clean(res: subprocess.CompletedProcess[bytes]) -> str:
    """Decoded stdout+stderr; fails on a crash or on any raw control/format character."""
    text = (res.stdout + b"\n" + res.stderr).decode("utf-8")
    assert "Traceback" not in text, text
    bad = sorted({f"U+{ord(c):04X}" for c in text
                  if c not in "\n\t" and unicodedata.category(c) in ("Cc", "Cf", "Cs")})
    assert not bad, f"raw control/format characters reached the terminal: {bad}\n{text!r}"
    return text


def assert_shown_escaped(text: str) -> None:
    """The hostile string was shown, as escapes and literal markup."""
    assert "\\x1b]0;pwned-title\\x07" in text, text
    assert "\\u202eevil" in text and "\\x9b31m" in text
    # the CLI's own escape of CR, or show()'s (a reason already escaped where it is made)
    assert "visible\\x0dOVERWRITE" in text or "visible\\rOVERWRITE" in text, text
    for m in MARKUP:
        assert m in text, f"markup {m!r} was interpreted, not shown: {text!r}"


# -- gateway calls ----------------------------------------------------------------------

def _call(seq: int, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "seq": seq, "ts": "2026-01-01T00:00:00+00:00", "run_id": "r", "role": "analyst",
        "upstream": "target", "stage": "baseline", "case": "c1", "trial": 0, "turn": 0,
        "provider": "openai", "model": "m", "fixture": False, "status": "refused",
        "error": "model_not_allowed", "latency_s": 0.01, "request_sha256": "0" * 64}
    return CallRecord.model_validate({**base, **over}).model_dump(mode="json")


def _call_log(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    run = tmp_path / "run"
    (run / "gateway").mkdir(parents=True)
    (run / "gateway" / "calls.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return run


def test_gateway_calls_model_name(tmp_path: Path) -> None:
    # The model name is whatever the container put in its request body.
    run = _call_log(tmp_path, [_call(1, model=HOSTILE)])
    res = run_cli("gateway", "calls", str(run))
    assert res.returncode == 0, res.stderr.decode()
    assert_shown_escaped(assert_clean(res))


def test_gateway_calls_case_and_error(tmp_path: Path) -> None:
    run = _call_log(tmp_path, [_call(1, case=HOSTILE), _call(2, error=HOSTILE, role=HOSTILE)])
    res = run_cli("gateway", "calls", str(run))
    assert res.returncode == 0, res.stderr.decode()
    text = assert_clean(res)
    assert text.count("\\x1b]0;pwned-title") >= 3, text


def test_gateway_calls_unbalanced_markup_does_not_crash(tmp_path: Path) -> None:
    run = _call_log(tmp_path, [_call(1, model="[/]"), _call(2, model="[/bold]x[link=]"),
                               _call(3, model="a\\"), _call(4, model="[")])
    res = run_cli("gateway", "calls", str(run))
    assert res.returncode == 0, res.stderr.decode()
    text = assert_clean(res)
    for m in ("[/]", "[/bold]x[link=]", "a\\"):
        assert m in text


def test_gateway_calls_json_is_ascii_json(tmp_path: Path) -> None:
    # C1/bidi characters: --json must stay valid, ASCII JSON.
    model = HOSTILE + " \u00e9"
    run = _call_log(tmp_path, [_call(1, model=model)])
    res = run_cli("gateway", "calls", str(run), "--json")
    assert res.returncode == 0, res.stderr.decode()
    assert_clean(res)
    res.stdout.decode("ascii")  # raises on any non-ASCII byte
    assert json.loads(res.stdout)["calls"][0]["model"] == model


def test_gateway_calls_refuses_a_lone_surrogate_cleanly(tmp_path: Path) -> None:
    # The gateway never writes one (its records are strict JSON); a tampered log with a
    # lone surrogate is refused as unreadable (exit 8, file and line named), escaped.
    model = HOSTILE + " \ud800"
    run = _call_log(tmp_path, [_call(1)])
    (run / "gateway" / "calls.jsonl").write_text(
        json.dumps(_call(1, model=model)) + "\n", encoding="utf-8")
    res = run_cli("gateway", "calls", str(run), "--json")
    assert res.returncode == 8
    assert_clean(res)
    assert b"calls.jsonl:1" in res.stderr and b"lone surrogate" in res.stderr


# -- compare ----------------------------------------------------------------------------

IDS = {"data_hash": "d" * 64, "reference_hash": "r" * 64, "scorer": "s"}


def test_compare_reason_and_case_id(tmp_path: Path) -> None:
    case = "case\x1b[2J" + "\u202e"
    rec = {"case_id": case, "trial": 0, "split": "acceptance", "status": "infra_invalid",
           "reason": HOSTILE, "identities": IDS}
    ok = {**rec, "status": "ok", "reason": None, "answer": {"answer": HOSTILE},
          "grades": {"correctness": True}}
    (tmp_path / "b.jsonl").write_text(json.dumps(ok) + "\n")
    (tmp_path / "c.jsonl").write_text(json.dumps(rec) + "\n")
    (tmp_path / "p.json").write_text(json.dumps({"schema": 1, "cases": [case], "trials": 1}))
    res = run_cli("compare", "--baseline", str(tmp_path / "b.jsonl"), "--candidate",
                  str(tmp_path / "c.jsonl"), "--policy", str(tmp_path / "p.json"),
                  "--out", str(tmp_path / "out"))
    assert res.returncode == 2, res.stdout.decode() + res.stderr.decode()
    text = assert_clean(res)
    assert "invalid_comparison" in text
    assert_shown_escaped(text)
    assert "case\\x1b[2J\\u202e" in text


def test_error_message_names_hostile_directory(tmp_path: Path) -> None:
    # The error path (the CLI boundary) names the directory; its name may have been chosen by
    # whoever created it (e.g. iterating over run directories). Escaped, markup shown.
    run = tmp_path / HOSTILE.replace("/", "_")
    run.mkdir()
    res = run_cli("receipt", "verify", str(run))
    assert res.returncode == 3, res.stdout.decode() + res.stderr.decode()
    text = assert_clean(res)
    assert "error:" in text and "receipt.json: does not exist" in text
    assert "\\x1b]0;pwned-title\\x07" in text and "\\u202eevil" in text
    assert "[bold]bold[_bold]" in text


# -- file names in a run directory --------------------------------------------------------

def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    plan = {"plan": {}, "plan_hash": sha256_json({})}
    (run / "plan.json").write_text(json.dumps(plan))
    receipt = {"schema": 1, "plan_hash": sha256_json({}),
               "files": {"plan.json": sha256_bytes((run / "plan.json").read_bytes())}}
    (run / "receipt.json").write_text(json.dumps(receipt))
    return run


def test_receipt_verify_hostile_file_name(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    name = "out\x1b]0;pwned-title\x07\u202etxt.exe\rX [bold]b[red]"
    (run / name).write_text("planted by a container")
    res = run_cli("receipt", "verify", str(run))
    assert res.returncode == 8
    text = assert_clean(res)
    assert "out\\x1b]0;pwned-title\\x07\\u202etxt.exe\\x0dX [bold]b[red]" in text, text
    assert "not named by the receipt" in text

    js = run_cli("receipt", "verify", str(run), "--json")
    assert js.returncode == 8
    js.stdout.decode("ascii")
    assert json.loads(js.stdout)["problems"][0].startswith(name)


def test_review_packet_answer_in_review_md(tmp_path: Path) -> None:
    # review.md is read by a human, often with `cat`: the answer must not carry raw escapes.
    ok = {"case_id": "c1", "trial": 0, "split": "acceptance", "status": "ok",
          "answer": {"answer": HOSTILE, "evidence": [HOSTILE]}, "identities": IDS}
    (tmp_path / "r.jsonl").write_text(json.dumps(ok) + "\n")
    res = run_cli("review", "packet", "--records", str(tmp_path / "r.jsonl"), "--out",
                  str(tmp_path / "p"), "--reviewer", "rev\x1b[31m")
    assert res.returncode == 0, res.stderr.decode()
    assert_clean(res)
    md = (tmp_path / "p" / "review.md").read_bytes()
    assert_shown_escaped(assert_clean(subprocess.CompletedProcess([], 0, md, b"")))


# -- a worker's message in the cycle summary ------------------------------------------------

def test_cycle_summary_worker_rationale(tmp_path: Path) -> None:
    # A refused proposal's message (written by the worker container) ends up in the
    # verdict's reasons; the summary table prints them. Driven through the CLI's own
    # renderer in a separate process, writing to a real pipe.
    driver = f"""
from pathlib import Path
from runner.cli.output import print_terminal
from runner.report.model import Report
reason = "no candidate: proposal refused (malformed_proposal: " + {HOSTILE!r} + ")"
report = Report.model_construct(
    name={HOSTILE!r}, run_dir=str(Path({str(tmp_path)!r}) / "run\x1b[2J"),
    verdict="invalid_comparison", exit_code=2, reasons=(reason,), pass_rates=(),
    improved=(), regressed=(), costs=(), statistics=None, fixture=True,
    receipt_sha256=None, problems=())
print_terminal(report, extra=(("time per stage", "propose 1.0s"),
                              ("receipt", {HOSTILE!r})))
"""
    env = {k: v for k, v in os.environ.items() if k != "FORCE_COLOR"}
    env["COLUMNS"] = "400"
    res = subprocess.run([sys.executable, "-c", driver], capture_output=True, timeout=60,
                         check=False, env=env)
    assert res.returncode == 0, res.stderr.decode()
    text = assert_clean(res)
    # The summary is the report's renderer (runner/report/text.py): JSON-style escapes.
    assert "\\u001b]0;pwned-title\\u0007" in text and "\\u202eevil" in text, text
    assert "\\u009b31m" in text and "visible\\u000dOVERWRITE" in text
    for m in MARKUP:
        assert m in text, f"markup {m!r} was interpreted, not shown: {text!r}"


# -- a container's own output, relayed live ---------------------------------------------------

@pytest.mark.docker
def test_sandbox_exec_relays_container_output_escaped(tmp_path: Path) -> None:
    script = (f"import sys; sys.stdout.write({HOSTILE!r}); "
              f"sys.stderr.buffer.write(b'\\xc2\\x9b6n \\xe2\\x80\\xae \\x1b]52;c;AAAA\\x07')")
    res = run_cli("sandbox", "exec", "--role", "evaluator", "--out", str(tmp_path / "o"),
                  "--", "python3", "-c", script)
    assert res.returncode == 0, res.stderr.decode()
    text = assert_clean(res)
    assert_shown_escaped(text)
    assert "\\x1b]52;c;AAAA\\x07" in text


def test_gateway_calls_on_a_run_with_no_calls_says_so(tmp_path: Path) -> None:
    """Issue 20 item 6: an empty call log printed an empty table; a run directory whose
    roles reached no model (no gateway/ at all) was refused as "calls.jsonl not found"."""
    run = _call_log(tmp_path, [])
    res = run_cli("gateway", "calls", str(run))
    assert res.returncode == 0, res.stderr.decode()
    assert b"no model calls recorded in" in res.stdout and b"seq" not in res.stdout
    bare = tmp_path / "bare-run"
    bare.mkdir()
    (bare / "plan.json").write_text("{}")
    res = run_cli("gateway", "calls", str(bare))
    assert res.returncode == 0, res.stderr.decode()
    assert b"no model calls recorded in" in res.stdout
    res = run_cli("gateway", "calls", str(bare), "--json")
    assert json.loads(res.stdout)["calls"] == []


def test_a_newline_in_a_path_cannot_start_a_line_of_its_own(tmp_path: Path) -> None:
    """helper-45: a path holding a newline printed, after `error: --out: .../x`, a line of
    its own reading "receipt verified: ..." (the one-line error contract). Every line
    after an error's first is indented now."""
    forged = "receipt verified: every named file matches"
    res = run_cli("report", str(tmp_path / f"x\n{forged}"))
    assert res.returncode == 3, res
    lines = res.stderr.decode().splitlines()
    assert lines[0].startswith("error:"), lines
    assert not any(line.startswith(forged) for line in lines), lines
    assert any(line.startswith("  " + forged) for line in lines), lines
