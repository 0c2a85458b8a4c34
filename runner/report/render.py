"""Terminal, Markdown and JUnit renderings of a Report. Pure: Report in, text out."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterator

from runner.report.model import Attempt, Change, Report, RoleCost, receipt_text
from runner.report.text import md, one_line, xml

REASON_SHOWN = 4000
"""Characters of one verdict reason shown on the terminal and in Markdown: every reason
the report keeps (``build.MAX_TEXT``) whole, wrapped by the table, never cut at a line."""
VERDICT_FILE = "stages/compare/verdict.json"


def reason_text(r: Report, reason: str) -> str:
    """One reason, visible and bounded; a reason the report had to cap points at the file
    that holds it whole."""
    shown = one_line(reason, REASON_SHOWN)
    if shown.endswith("…") or reason.endswith(" more chars]"):
        shown += f" (whole reason in {one_line(str(r.run_dir), 500)}/{VERDICT_FILE})"
    return shown


def _rate(passed: int, rows: int) -> str:
    return f"{passed}/{rows} ({100 * passed / rows:.0f}%)" if rows else "0/0"


def cost_text(c: RoleCost) -> str:
    if c.cost_usd is not None:
        usd = f"{c.cost_usd:.6f} USD"
    else:
        usd = ("unknown" if c.cost_usd_known_part is None
               else f"unknown (known part {c.cost_usd_known_part} USD)")
    if c.bounded_calls:
        usd += (f", {c.bounded_calls} of {c.calls} calls bounded (no usage reported: charged "
                "their worst case, not measured)")
    return usd + (", complete" if c.complete else ", INCOMPLETE")


def fixture_text(c: RoleCost) -> str:
    """How many of a role's calls were scripted fixtures: their cost is computed from the
    cycle's listed prices for made-up replies, not billed by any provider."""
    if not c.fixture_calls:
        return ""
    if c.fixture_calls == c.calls:
        return ", all fixture (scripted replies, not billed)"
    return f", {c.fixture_calls} of {c.calls} calls fixture (scripted, not billed)"


def change_text(c: Change) -> str:
    return f"{c.case_id} t{c.trial} {c.criterion}: {c.baseline} -> {c.candidate}"


def terminal_rows(r: Report) -> Iterator[tuple[str, str]]:
    """(label, value) rows for a two-column terminal table; labels and values already made
    visible (controls escaped) but not markup-escaped: print them with markup off."""
    yield "run", one_line(f"{r.name} ({r.run_dir})")
    yield "verdict", r.verdict + f" (exit {r.exit_code})"
    for reason in r.reasons:
        yield "reason", reason_text(r, reason)
    for p in r.pass_rates:
        yield one_line(f"pass {p.arm} {p.split}", 60), _rate(p.passed, p.rows) + (
            f", {p.rows - p.ok} not ok" if p.ok != p.rows else "")
    for ch in r.improved:
        yield "improved", one_line(change_text(ch))
    for ch in r.regressed:
        yield "regressed", one_line(change_text(ch))
    for rc in r.costs:
        yield one_line(f"cost {rc.role}", 60), (
            f"{rc.calls} calls ({rc.ok} ok), {rc.tokens} tokens, " + cost_text(rc)
            + fixture_text(rc))
    if r.statistics is not None:
        s = r.statistics
        yield "McNemar", f"b={s.b} c={s.c} pairs={s.pairs} p={s.p_value:.4g} (beside the verdict)"
    yield "fixture", "yes: scripted models, not a real model" if r.fixture else "no"
    yield "receipt sha256", receipt_text(r)
    for problem in r.problems:
        yield "problem", one_line(problem)


def markdown(r: Report) -> str:
    """A CI step summary / PR comment. Every run-derived string goes through ``md``."""
    mark = {"accept_for_review": "✅", "reject": "❌"}.get(r.verdict, "⚠️")
    lines = [f"## cyclebox {md(r.name or '?')}: {mark} `{r.verdict}`", ""]
    if r.verdict == "accept_for_review":
        lines += ["Accepted **for review**: a person still decides whether to merge.", ""]
    lines += [f"- reason: {md(x, REASON_SHOWN)}" for x in r.reasons]
    if r.fixture:
        lines.append("- model calls came from **scripted fixtures** (not a real model)")
    lines += ["", "| arm | split | passed | rows | not ok | rate |",
              "|---|---|---:|---:|---:|---:|"]
    for p in r.pass_rates:
        rate = "-" if p.rate is None else f"{100 * p.rate:.1f}%"
        lines.append(f"| {p.arm} | {md(p.split)} | {p.passed} | {p.rows} | {p.rows - p.ok} "
                     f"| {rate} |")
    for title, rows in (("Improved", r.improved), ("Regressed", r.regressed)):
        if rows:
            lines += ["", f"**{title}** ({len(rows)})", ""]
            lines += [f"- {md(change_text(c))}" for c in rows]
    lines += ["", "| role | calls | tokens | cost | fixture calls |", "|---|---:|---:|---|---:|"]
    for c in r.costs:
        lines.append(f"| {md(c.role)} | {c.calls} | {c.tokens} | {md(cost_text(c))} "
                     f"| {c.fixture_calls} |")
    if r.statistics is not None:
        s = r.statistics
        lines += ["", f"Exact McNemar (beside the verdict, never instead): b={s.b}, c={s.c}, "
                      f"pairs={s.pairs}, p={s.p_value:.4g}"]
    lines += ["", f"Receipt sha256: {md(receipt_text(r))}"
                  + (f" · plan {md(r.plan_hash[:16])}" if r.plan_hash else "")]
    lines += [f"- problem: {md(p)}" for p in r.problems]
    return "\n".join(lines) + "\n"


def _failure_message(a: Attempt) -> str:
    if a.status != "ok":
        return f"{a.status}: {a.reason or 'no reason recorded'}"
    return "failed: " + ", ".join(a.failed_criteria)


def junit(r: Report) -> bytes:
    """JUnit XML: one testsuite per arm, one testcase per (case, trial); a case that did
    not pass carries a <failure> with its reason or failed criteria."""
    root = ET.Element("testsuites", name=xml(f"cyclebox {r.name or ''}: {r.verdict}"))
    for arm in ("baseline", "candidate"):
        attempts = [(c, a) for c in r.cases for a in getattr(c, arm)]
        fails = sum(not a.passed for _, a in attempts)
        suite = ET.SubElement(root, "testsuite", name=arm, tests=str(len(attempts)),
                              failures=str(fails), errors="0", skipped="0",
                              time=f"{sum(a.latency_s or 0 for _, a in attempts):.3f}")
        props = ET.SubElement(suite, "properties")
        for k, v in (("verdict", r.verdict), ("receipt_sha256", r.receipt_sha256 or ""),
                     ("receipt_verified", str(bool(r.receipt_verified)).lower()),
                     ("fixture", str(r.fixture).lower())):
            ET.SubElement(props, "property", name=k, value=xml(v))
        for c, a in attempts:
            tc = ET.SubElement(suite, "testcase", classname=xml(f"{arm}.{c.split}"),
                               name=xml(f"{c.case_id} t{a.trial}"),
                               time=f"{a.latency_s or 0:.3f}")
            if not a.passed:
                msg = xml(_failure_message(a), 1000)
                fail = ET.SubElement(tc, "failure", message=msg,
                                     type=a.status if a.status != "ok" else "graded_fail")
                fail.text = xml(f"{msg}\nanswer: {a.answer}")
    ET.indent(root)
    body: bytes = ET.tostring(root, encoding="utf-8", xml_declaration=False)
    return b'<?xml version="1.0" encoding="utf-8"?>\n' + body
