"""The report model and renderers on a synthetic run directory (no Docker)."""

from __future__ import annotations

import io
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest
from junitparser import JUnitXml

from runner.cycle.receipt import _files
from runner.errors import OutputRejected
from runner.hashing import sha256_json
from runner.report import build_report
from runner.report.html import render_html
from runner.report.render import VERDICT_FILE, junit, markdown, terminal_rows
from runner.report.text import h, md, one_line, visible

HOSTILE = ("<script>document.title='pwned'</script><img src=x onerror=alert(1)> "
           "[click](javascript:alert(1)) @everyone | `x` \x1b[31mred\x1b[0m \u202eevil"
           "\x9b\u2028\u200b")
IDS = {"data_hash": "d", "reference_hash": "r", "scorer": "s", "judge": None}


def record(case: str, trial: int, split: str, ok: bool | None, *, answer: str = "42",
           status: str = "ok", reason: str | None = None) -> dict[str, Any]:
    grades = None if ok is None else {"correctness": ok, "evidence": True, "refusal": True}
    return {"case_id": case, "trial": trial, "split": split, "status": status, "reason": reason,
            "answer": {"answer": answer} if status == "ok" else None, "grades": grades,
            "latency_s": 1.0, "usage": {}, "identities": IDS}


def call(seq: int, role: str, cost: float | None) -> dict[str, Any]:
    return {"seq": seq, "ts": "2026-01-01T00:00:00+00:00", "run_id": "r", "role": role,
            "upstream": "target", "stage": "baseline", "turn": 0, "provider": "scripted",
            "model": "m", "fixture": True, "status": "ok", "latency_s": 0.1,
            "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
            "cost_usd": cost, "request_sha256": "a" * 64}


def jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    (d / "stages/compare").mkdir(parents=True)
    (d / "stages/baseline").mkdir()
    (d / "stages/candidate").mkdir()
    (d / "stages/apply").mkdir()
    (d / "gateway").mkdir()
    policy = {"cases": ["a1", "a2", "d1"], "criteria": ["correctness", "evidence", "refusal"],
              "mandatory": ["a2"], "trials": 2}
    plan = {"name": "syn", "trials": 2, "policy": policy}
    (d / "plan.json").write_text(json.dumps({"plan": plan, "plan_hash": sha256_json(plan)}))
    base = [record("d1", 0, "development", False), record("d1", 1, "development", False),
            record("a1", 0, "acceptance", False), record("a1", 1, "acceptance", True),
            record("a2", 0, "acceptance", True), record("a2", 1, "acceptance", True),
            record("x1", 0, "development", True)]
    cand = [record("d1", 0, "development", True), record("d1", 1, "development", True),
            record("a1", 0, "acceptance", True, answer=HOSTILE),
            record("a1", 1, "acceptance", None, status="infra_invalid",
                   reason="timeout: " + HOSTILE),
            record("a2", 0, "acceptance", False), record("a2", 1, "acceptance", True)]
    (d / "stages/baseline/records.jsonl").write_text(jsonl(base))
    (d / "stages/candidate/records.jsonl").write_text(jsonl(cand))
    change = {"trial": 0, "criterion": "correctness"}
    (d / "stages/compare/verdict.json").write_text(json.dumps({
        "verdict": "reject", "reasons": ["mandatory case a2 failed " + HOSTILE],
        "regressions": [{**change, "case_id": "a2", "baseline": True, "candidate": False}],
        "improvements": [{**change, "case_id": "d1", "baseline": False, "candidate": True}],
        "usage": {}, "statistics": {"method": "exact McNemar", "pairs": 6, "b": 1, "c": 3,
                                    "p_value": 0.625, "note": "beside"}}))
    (d / "gateway/calls.jsonl").write_text(jsonl([call(0, "analyst", 0.5),
                                                  call(1, "analyst", None),
                                                  call(2, "worker", 0.25)]))
    (d / "stages/apply/candidate.patch").write_text("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-old\n+"
                                                    + HOSTILE + "\n")
    (d / "receipt.json").write_text(json.dumps({  # a receipt of files alone: it verifies
        "schema": 1, "plan_hash": sha256_json(plan), "files": _files(d)[0], "external": {},
        "timing": {"baseline": 1.5}}))
    return d


def test_pass_rates_per_arm_and_split(run: Path) -> None:
    r = build_report(run)
    rates = {(p.arm, p.split): (p.passed, p.rows, p.ok) for p in r.pass_rates}
    assert rates == {("baseline", "acceptance"): (3, 4, 4),
                     ("baseline", "development"): (1, 3, 3),
                     ("candidate", "acceptance"): (2, 4, 3),
                     ("candidate", "development"): (2, 2, 2)}
    assert r.verdict == "reject" and r.exit_code == 1 and r.trials == 2
    assert not r.problems and r.receipt_verified


def test_improved_regressed_statistics_and_flags(run: Path) -> None:
    r = build_report(run)
    assert [(c.case_id, c.baseline, c.candidate) for c in r.improved] == [("d1", False, True)]
    assert [(c.case_id, c.baseline, c.candidate) for c in r.regressed] == [("a2", True, False)]
    assert r.statistics is not None and (r.statistics.b, r.statistics.c) == (1, 3)
    assert r.statistics.p_value == 0.625
    rows = {c.case_id: c for c in r.cases}
    assert rows["a2"].mandatory and rows["a1"].compared and not rows["x1"].compared
    infra = rows["a1"].candidate[1]
    assert not infra.passed and infra.status == "infra_invalid"


def test_unknown_cost_is_never_zero(run: Path) -> None:
    costs = {c.role: c for c in build_report(run).costs}
    assert costs["analyst"].cost_usd is None and not costs["analyst"].complete
    assert costs["analyst"].cost_usd_known_part == 0.5
    assert costs["worker"].cost_usd == 0.25 and costs["worker"].complete
    assert costs["total"].calls == 3 and costs["total"].fixture_calls == 3
    assert build_report(run).fixture is True


def test_receipt_hash_is_of_the_receipt_bytes(run: Path) -> None:
    import hashlib

    r = build_report(run)
    assert r.receipt_sha256 == hashlib.sha256((run / "receipt.json").read_bytes()).hexdigest()
    (run / "receipt.json").unlink()
    assert build_report(run).receipt_sha256 is None


def test_html_patch_lines_are_git_lines_styled_by_the_diffs_structure() -> None:
    """An added line holding a CR (or FF, U+2028, ...) is one line, shown escaped: split
    there, its second half read as unchanged context. Added content starting ``++`` is
    an addition, removed content starting ``--`` a removal; ``---``/``+++`` before a
    file's first hunk are its headers."""
    from runner.report.html import _diff

    patch = ("diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1,2 +1,2 @@\n"
             "-        1,\n+        1,\r         __import__('os').system('x'),\n"
             "+\u2028hidden\x0c form\n+++counter\n---gone\n context\n"
             "diff --git a/y b/y\n--- a/y\n+++ b/y\n@@ -0,0 +1 @@\n+new")
    lines = _diff(patch).split("\n")
    assert len(lines) == patch.count("\n") + 1
    assert lines[5] == ('<span class="add">+        1,\\u000d         __import__'
                        "(&#x27;os&#x27;).system(&#x27;x&#x27;),</span>")
    assert lines[6] == '<span class="add">+\\u2028hidden\\u000c form</span>'
    assert lines[7] == '<span class="add">+++counter</span>'
    assert lines[8] == '<span class="del">---gone</span>'
    assert lines[9] == " context"
    assert lines[1:3] == ["--- a/x.py", "+++ b/x.py"]
    assert lines[11:13] == ["--- a/y", "+++ b/y"]
    assert lines[14] == '<span class="add">+new</span>'


def test_html_escapes_every_hostile_string(run: Path) -> None:
    page = render_html(build_report(run), run_dir=run, html_dir=run.parent)
    assert "<script" not in page.lower()
    assert "<img" not in page.lower()
    assert "onerror=" not in page.replace("onerror=alert", "") or "&lt;img" in page
    assert "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;" in page
    assert "\x1b" not in page and "\u202e" not in page
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    # every tag that carries an attribute quotes it, and no attribute is an event handler
    for tag in re.findall(r"<[a-z]+\s[^>]*>", page):
        assert not re.search(r"\son\w+\s*=", tag), tag
    hrefs = re.findall(r'href="([^"]*)"', page)
    assert all(h.startswith(("./", "../")) for h in hrefs)


def test_markdown_is_inert(run: Path) -> None:
    text = markdown(build_report(run))
    assert "<script" not in text and "<img" not in text
    assert "@everyone" not in text and "](javascript" not in text
    assert "\x1b" not in text and "\u202e" not in text
    # a hostile '|' cannot add a column: every row of a table has its header's pipes
    tables: list[list[str]] = [[]]
    for ln in text.splitlines():
        if ln.startswith("|"):
            tables[-1].append(ln)
        elif tables[-1]:
            tables.append([])
    assert len([t for t in tables if t]) == 2
    for t in tables:
        assert len({len(re.findall(r"(?<!\\)\|", ln)) for ln in t}) <= 1, t
    assert "`reject`" in text and "b=1, c=3" in text


def test_terminal_rows_have_no_controls(run: Path) -> None:
    calls = run / "gateway" / "calls.jsonl"  # a role from a tampered run dir: a label
    calls.write_text(calls.read_text() + json.dumps(call(9, HOSTILE + "\x9b31m", 0.1)) + "\n")
    rows = list(terminal_rows(build_report(run)))
    assert any(k.startswith("cost <script>") for k, _ in rows)
    assert all(c not in k + v for k, v in rows for c in ("\x1b", "\u202e", "\x9b"))
    assert ("verdict", "reject (exit 1)") in rows
    assert any(k == "McNemar" and "p=0.625" in v for k, v in rows)


def test_junit_counts_read_by_junitparser(run: Path, tmp_path: Path) -> None:
    path = tmp_path / "j.xml"
    path.write_bytes(junit(build_report(run)))
    suites = {s.name: s for s in JUnitXml.fromfile(str(path))}
    assert set(suites) == {"baseline", "candidate"}
    assert (suites["baseline"].tests, suites["baseline"].failures) == (7, 3)
    assert (suites["candidate"].tests, suites["candidate"].failures) == (6, 2)
    failed = {c.name: c.result[0].message for c in suites["candidate"] if c.result}
    assert failed["a1 t1"].startswith("infra_invalid: timeout: <script>")
    assert failed["a2 t0"] == "failed: correctness"
    # legal in XML, but a CI page renders them: shown as escapes (an attack review)
    text = path.read_text(encoding="utf-8")
    assert all(c not in text for c in ("\x1b", "\u202e", "\x9b", "\u2028", "\u200b"))
    assert "\\u202eevil" in text


def test_symlinked_records_are_refused_not_followed(run: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.jsonl"
    secret.write_text(jsonl([record("leak", 0, "acceptance", True)]))
    target = run / "stages/candidate/records.jsonl"
    target.unlink()
    target.symlink_to(secret)
    r = build_report(run)
    assert all(c.case_id != "leak" for c in r.cases)
    assert any("records.jsonl" in p and "symlink" in p for p in r.problems)


def test_symlinked_stage_directory_is_refused(run: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (run / "stages/baseline").rename(outside)
    (run / "stages/baseline").symlink_to(outside)
    r = build_report(run)
    assert not any(p.arm == "baseline" for p in r.pass_rates)
    assert any("stages/baseline" in p for p in r.problems)


@pytest.mark.parametrize(("name", "text", "problem"), [
    pytest.param("receipt.json", '{"timing": {"baseline": 1' + "0" * 400 + "}}",
                 "timing 'baseline' is not a finite number", id="timing-400-digits"),
    pytest.param("plan.json", '{"plan": {"name": "syn"}, "plan_hash": {"x": 1}}',
                 "plan_hash is not a string", id="plan-hash-object"),
    pytest.param("plan.json", '{"plan": [1], "plan_hash": "p"}', "plan is not an object",
                 id="plan-list"),
])
def test_odd_values_in_a_run_directory_are_noted_not_a_crash(
        run: Path, name: str, text: str, problem: str) -> None:
    """A report shows what it can and notes the rest: these raised OverflowError, a
    ValidationError and AttributeError, and no report was written."""
    (run / name).write_text(text)
    r = build_report(run)
    assert any(problem in p for p in r.problems), r.problems
    render_html(r, run_dir=run, html_dir=run.parent), markdown(r), terminal_rows(r)


def test_not_a_run_directory(tmp_path: Path) -> None:
    with pytest.raises(OutputRejected, match=r"plan\.json"):
        build_report(tmp_path)


def test_line_progress_prints_stages_and_every_n_cases() -> None:
    from runner.cli.output import LineProgress

    buf = io.StringIO()
    p = LineProgress(buf, every=5)
    p("export", 0, 0)
    for i in range(13):
        p("baseline", i, 12)
    lines = buf.getvalue().splitlines()
    assert [ln.split("] ", 1)[1] for ln in lines] == [
        "export: started", "baseline: 5/12 cases",
        "baseline: 10/12 cases", "baseline: 12/12 cases"]


def test_gc_dry_run_removes_nothing() -> None:
    from runner.isolation.gc import sweep_containers

    class Engine:
        removed: list[str] = []  # noqa: RUF012

        def managed_containers(self) -> list[tuple[str, str, dict[str, str]]]:
            return [("c1", "cyclebox-x", {"io.cyclebox.run_id": "r"})]

        def remove(self, cid: str) -> bool:
            self.removed.append(cid)
            return True

    e = Engine()
    res = sweep_containers(e, dry_run=True)
    assert e.removed == [] and res[0].would_remove and not res[0].removed
    res = sweep_containers(e)
    assert e.removed == ["c1"] and res[0].removed


def test_reads_stop_at_the_cap(run: Path) -> None:
    from runner.report import readfs
    from runner.report.build import MAX_PATCH

    (run / "stages/apply/candidate.patch").write_bytes(b"+" * (MAX_PATCH + 10))
    r = build_report(run)
    assert r.patch_truncated and r.patch is not None and len(r.patch) == MAX_PATCH
    with pytest.raises(OutputRejected, match="cap"):
        readfs.read_bytes(run, "stages/apply/candidate.patch", cap=100)
    with pytest.raises(OutputRejected, match="relative path"):
        readfs.read_bytes(run, "../run/plan.json")


def test_output_file_symlink_is_replaced_not_followed(run: Path, tmp_path: Path) -> None:
    from runner.report.files import write_outputs

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / "summary.md"
    link.symlink_to(victim)
    write_outputs(run, markdown=link)
    assert victim.read_text() == "keep me"
    assert not link.is_symlink() and "`reject`" in link.read_text()


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_report_files_get_the_users_umask(run: Path, tmp_path: Path, mask: int) -> None:
    """Issue 20 item 6: every report file (JUnit, Markdown, HTML) was written 0600 by
    mkstemp whatever the umask; now 0666 less the umask."""
    import os
    import stat

    from runner.report.files import write_outputs

    out = tmp_path / "reports"
    out.mkdir()
    old = os.umask(mask)
    try:
        write_outputs(run, junit=out / "j.xml", markdown=out / "s.md", html=out / "r.html")
    finally:
        os.umask(old)
    for name in ("j.xml", "s.md", "r.html"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o666 & ~mask, name
    assert sorted(p.name for p in out.iterdir()) == ["j.xml", "r.html", "s.md"]


def test_output_dir_missing_is_a_config_error(run: Path, tmp_path: Path) -> None:
    from runner.errors import ConfigError
    from runner.report.files import check_targets

    with pytest.raises(ConfigError, match="--junit"):
        check_targets(junit=tmp_path / "nope" / "j.xml")


@pytest.mark.skipif(os.geteuid() != 0, reason="a bind mount needs root")
def test_a_report_into_a_bind_mount_of_the_run_is_refused(run: Path, tmp_path: Path) -> None:
    """The run directory mounted elsewhere: its path does not say it is the run, its
    device and inode do (a report there would change a file the receipt binds)."""
    import subprocess

    from runner.errors import ConfigError
    from runner.report.files import check_targets

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if subprocess.run(["mount", "--bind", str(run), str(elsewhere)],
                      check=False, capture_output=True).returncode != 0:
        pytest.skip("mount --bind is not allowed here")
    try:
        with pytest.raises(ConfigError, match="is inside"):
            check_targets(run, html=elsewhere / "stages" / "r.html")
        check_targets(run, html=tmp_path / "r.html")  # beside it: fine
    finally:
        subprocess.run(["umount", str(elsewhere)], check=True)


def test_a_run_that_stopped_early_reports_incomplete(run: Path) -> None:
    (run / "stages/compare/verdict.json").unlink()
    (run / "stages/candidate/records.jsonl").unlink()
    (run / "stages/apply/candidate.patch").unlink()
    r = build_report(run)
    assert r.verdict == "incomplete" and r.exit_code == 2 and r.patch is None
    assert all(not c.candidate for c in r.cases)
    assert "`incomplete`" in markdown(r)
    assert {p.arm for p in r.pass_rates} == {"baseline"}


def test_invisible_characters_are_shown_in_every_medium() -> None:
    # Format characters (termsafe's categories) that a fixed list missed: tag characters,
    # ZWSP, word joiner, BOM, Arabic letter mark, soft hyphen.
    hidden = "\U000e0069\U000e0067\u200b\u2060\ufeff\u061c\u00ad"
    for out in (h("ok" + hidden), md("ok" + hidden), one_line("ok" + hidden)):
        assert not any(ch in out for ch in hidden), repr(out)
        assert "\\U000e0069" in out and "\\u200b" in out and "\\u00ad" in out
    assert visible("a\tb\nc") == "a\tb\nc"


def test_markdown_values_never_autolink() -> None:
    out = md("see https://evil.example/x or www.evil.example and mailto:a")
    assert "https://" not in out and "mailto:" not in out and "www." not in out.lower()
    assert "https&#58;//evil.example/x" in out and "www&#46;evil.example" in out
    assert md("a | b") == "a \\| b"  # a table cell stays one cell


def test_markdown_values_never_mention_nor_reference() -> None:
    """GitHub finds @mentions and #references in the rendered HTML's text, where a
    character reference is decoded ("&#64;" still notifies): what the Markdown shows,
    entities decoded, must hold none."""
    import html as _html
    import re as _re

    hostile = "ping @octocat @org/security-team, fixes #12, org/repo#34, gh-56 and me@x.io"
    shown = _html.unescape(md(hostile))
    assert not _re.search(r"@[A-Za-z0-9]", shown), shown
    assert not _re.search(r"#[0-9]", shown) and not _re.search(r"(?i)gh-[0-9]", shown), shown
    assert shown.replace("\u200b", "").replace("\\", "") == hostile  # reads the same
    assert md("it's &#64;x") == "it&#x27;s &amp;#\u200b64;x"  # html.escape's own '#' kept


def test_a_markdown_value_opening_a_list_item_opens_no_list() -> None:
    """The improved/regressed lines are "- {md(case trial criterion ...)}", and the
    scenario id "1." is valid: "- 1. t0 ..." rendered as a nested ordered list (start=1,
    the id shown as its number); "- - x" and "- + x" likewise nest a list."""
    for value, shown in (("1. t0 c: True -> False", "1\\. t0 c&#58; True -&gt; False"),
                         ("123456789) x", "123456789\\) x"), ("- x", "\\- x"),
                         ("+ x", "\\+ x"), ("1.5 x", "1\\.5 x"), ("a-b 1. c", "a-b 1. c")):
        assert md(value) == shown


def test_the_terminal_summary_wraps_the_reason_instead_of_cutting_it(run: Path) -> None:
    """Issue 20 item 6: the reason row was cut at 300 characters."""
    from runner.cli.output import out, print_terminal

    reason = "invalid comparison: " + "".join(f"case-{i:04d}-failed;" for i in range(90)) + "END"
    doc = json.loads((run / "stages/compare/verdict.json").read_text())
    doc["reasons"] = [reason, "x" * 5000]
    (run / "stages/compare/verdict.json").write_text(json.dumps(doc))
    report = build_report(run)
    with out.capture() as cap:
        print_terminal(report)
    flat = re.sub(r"[\s│┃|]", "", cap.get())
    assert reason.replace(" ", "") in flat, "the reason was cut"
    rows = dict((k, v) for k, v in terminal_rows(report) if k == "reason" and v.startswith("x"))
    capped = rows["reason"]
    assert capped.endswith(f"/{VERDICT_FILE})") and "whole reason in" in capped
    assert len(capped) < 5000
    assert "case-0089-failed;END" in markdown(report)


def test_a_report_file_never_replaces_the_receipt_a_device_or_a_system_file(
        run: Path, tmp_path: Path) -> None:
    """A report is renamed into place: --html RUN/receipt.json replaced the receipt, and
    --markdown at a device (as root, /dev/null) replaced the device with a regular file."""
    from runner.errors import ConfigError
    from runner.report.files import write_outputs

    receipt = run / "receipt.json"
    receipt.write_text("{}")
    os.mkfifo(tmp_path / "fifo")
    for kwargs, match in [({"html": receipt}, r"inside the (cyclebox )?run"),
                          ({"markdown": run / "summary.md"}, r"inside the (cyclebox )?run"),
                          ({"junit": tmp_path / "fifo"}, "not a regular file"),
                          ({"markdown": Path("/dev/null")}, "system directory"),
                          ({"markdown": Path("/proc/self/x")}, "system directory")]:
        with pytest.raises(ConfigError, match=match):
            write_outputs(run, **kwargs)  # type: ignore[arg-type]
    assert receipt.read_text() == "{}" and not (run / "summary.md").exists()
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)
    write_outputs(run, markdown=tmp_path / "summary.md")  # beside the run: written
    assert (tmp_path / "summary.md").is_file()


def test_a_call_log_the_receipt_recorded_is_not_read_as_no_calls(run: Path) -> None:
    """With gateway/calls.jsonl gone, the report showed 0 calls, complete, and `gateway
    calls` said "no model calls recorded": a silent zero. The receipt says a log existed."""
    from runner.report.render import cost_text

    (run / "receipt.json").write_text(json.dumps({"files": {"gateway/calls.jsonl": "0" * 64}}))
    (run / "gateway" / "calls.jsonl").unlink()
    r = build_report(run)
    assert any("gateway/calls.jsonl: missing" in p for p in r.problems)
    total = next(c for c in r.costs if c.role == "total")
    assert not total.complete and total.cost_usd is None
    assert cost_text(total).startswith("unknown, ") and "INCOMPLETE" in cost_text(total)


@pytest.mark.parametrize(("key", "value", "problem"), [
    ("criteria", 5, "policy.criteria is not a list of names"),
    ("criteria", True, "policy.criteria is not a list of names"),
    ("criteria", ["bogus"], "policy.criteria names what no grade has"),
    ("cases", 1.5, "policy.cases is not a list of names"),
    ("mandatory", [1], "policy.mandatory is not a list of names"),
])
def test_an_edited_policy_in_plan_json_is_a_problem_not_a_crash(
        run: Path, key: str, value: object, problem: str) -> None:
    """An attack review: criteria 5 or true, cases 1.5 (TypeError) and criteria naming no
    grade (AttributeError) ended ``cyclebox report`` with exit 10."""
    doc = json.loads((run / "plan.json").read_text())
    doc["plan"]["policy"][key] = value
    (run / "plan.json").write_text(json.dumps(doc))
    r = build_report(run)
    assert any(problem in p for p in r.problems), r.problems
    assert r.verdict == "reject"


def test_a_records_file_of_many_empty_arrays_is_refused_unparsed(run: Path) -> None:
    """helper-39 F3: 100 MiB of ``[[],[],...]`` lines took the report 2.7 GB (1 GiB, the
    records cap, would take 27 GB). More objects and arrays than a report reads are a
    problem named before anything is parsed; the other arm still shows."""
    from runner.report.readfs import MAX_CONTAINERS

    line = b"[" + b"[]," * 99_999 + b"[]]\n"
    with (run / "stages/candidate/records.jsonl").open("ab") as f:
        for _ in range(MAX_CONTAINERS // 100_000 + 1):
            f.write(line)
    r = build_report(run)
    assert any("stages/candidate/records.jsonl" in p and "objects and arrays" in p
               for p in r.problems), r.problems
    assert any(p.arm == "baseline" for p in r.pass_rates)


def test_an_edited_run_is_shown_as_not_verified_in_every_output(run: Path,
                                                                tmp_path: Path) -> None:
    """helper-39 F4: a verdict edited after the run was shown beside the genuine receipt
    hash, with no problem listed. Every output now says whether the run matches it."""
    r = build_report(run)
    assert "(verified: the run matches it)" in dict(terminal_rows(r))["receipt sha256"]
    v = json.loads((run / VERDICT_FILE).read_text())
    (run / VERDICT_FILE).write_text(json.dumps({**v, "verdict": "accept_for_review",
                                                "reasons": []}))
    r = build_report(run)
    assert r.verdict == "accept_for_review" and r.receipt_verified is False
    assert any(p.startswith(f"receipt: does not verify: {VERDICT_FILE}") for p in r.problems)
    assert "NOT VERIFIED" in dict(terminal_rows(r))["receipt sha256"]
    assert "NOT VERIFIED" in markdown(r)
    assert "NOT VERIFIED" in render_html(r, run_dir=run, html_dir=tmp_path)
    suite = next(iter(JUnitXml.fromstring(junit(r).decode())))
    props = {p.name: p.value for p in suite.properties()}
    assert props["receipt_verified"] == "false"


def test_a_run_too_large_to_hash_is_shown_as_not_checked_quickly(run: Path) -> None:
    """helper-42 #4: the report's verify hashed an 8 GiB sparse file for 26 s (1 TiB would
    take an hour). Past the report's byte budget the receipt is shown as not checked
    here, at once; `receipt verify` still checks it in full."""
    import time

    from runner.report.build import REPORT_VERIFY_BYTES

    with (run / "stages/apply/candidate.patch").open("r+b") as f:
        f.truncate(REPORT_VERIFY_BYTES + 1)  # sparse: no disk used
    t = time.monotonic()
    r = build_report(run)
    assert time.monotonic() - t < 5
    assert r.receipt_verified is None
    assert "NOT VERIFIED here" in dict(terminal_rows(r))["receipt sha256"]
    assert any(p.startswith("receipt: not checked here") for p in r.problems), r.problems


def test_a_judge_that_gave_no_verdict_is_not_shown_as_a_pass(tmp_path: Path) -> None:
    from runner.cycle.models import Grades, Record
    from runner.report.build import _attempt, _Reader
    r = Record.model_validate({**record("a1", 0, "acceptance", True),
                               "grades": Grades(correctness=True, judge_error="prose")})
    a = _attempt(r, ("correctness",), "candidate", _Reader(tmp_path))
    assert not a.passed and a.failed_criteria == ("judge_error",)
