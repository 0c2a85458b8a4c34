"""One self-contained HTML file per report: no script, no fetch, inline CSS, a strict CSP.

Every value that came from the run directory passes through ``text.h`` (html.escape with
quote=True, controls made visible) and every attribute is double-quoted, so answers such
as ``<script>`` or ``<img onerror>`` show as text. Links are relative paths into the run
directory, percent-encoded, so they cannot carry a scheme.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

from runner.report.model import Attempt, CaseRow, Report, receipt_text
from runner.report.render import change_text, cost_text
from runner.report.text import h

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fff}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}
.banner{padding:.8em 1em;border-radius:6px;font-size:1.2em;font-weight:600;color:#fff}
.accept_for_review{background:#1f7a3a}.reject{background:#b3261e}
.invalid_comparison,.incomplete{background:#a66300}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.25em .5em;
vertical-align:top;text-align:left}th{background:#f0f0f0}
.pass{background:#e3f4e6}.fail{background:#fbe4e2}.muted{color:#777}
pre{background:#f6f8fa;padding:.6em;overflow-x:auto;white-space:pre-wrap;word-break:break-all}
.add{color:#1f7a3a}.del{color:#b3261e}.hunk{color:#6a4fa3}
code{word-break:break-all}
"""


def _href(run_dir: Path, rel: str, html_dir: Path) -> str:
    path = os.path.relpath(run_dir.resolve() / rel, html_dir.resolve())
    url = quote(Path(path).as_posix(), safe="/")
    return url if url.startswith(".") else "./" + url


def _label(rel: str) -> str:
    name = rel.rsplit("/", 1)[-1]
    return name.rsplit(".", 1)[-1] if name.endswith((".stdout", ".stderr")) else name


def _attempt_cell(a: Attempt | None, run_dir: Path, html_dir: Path) -> str:
    if a is None:
        return '<td class="muted">not run</td>'
    cls = "pass" if a.passed else "fail"
    grades = ", ".join(f"{k}={v}" for k, v in (a.grades or {}).items() if v is not None)
    detail = "pass" if a.passed else (f"{a.status}: {a.reason}" if a.status != "ok"
                                      else "failed " + ", ".join(a.failed_criteria))
    links = " ".join(f'<a href="{h(_href(run_dir, rel, html_dir))}">{h(_label(rel))}</a>'
                     for rel in a.logs)
    return (f'<td class="{cls}"><b>{h(detail)}</b><br>answer: <code>{h(a.answer or "-")}'
            f'</code><br><span class="muted">{h(grades or "no grades")}</span>'
            + (f"<br>{links}" if links else "") + "</td>")


def _case_rows(c: CaseRow, run_dir: Path, html_dir: Path) -> str:
    base = {a.trial: a for a in reversed(c.baseline)}  # the first of a trial, as before
    cand = {a.trial: a for a in reversed(c.candidate)}
    rows = []
    for t in sorted(base.keys() | cand.keys()):
        b, k = base.get(t), cand.get(t)
        flags = (" mandatory" if c.mandatory else "") + ("" if c.compared else " (not compared)")
        rows.append(f"<tr><td><code>{h(c.case_id)}</code><br><span class=\"muted\">"
                    f"{h(c.split)}{h(flags)} t{t}</span></td>"
                    + _attempt_cell(b, run_dir, html_dir) + _attempt_cell(k, run_dir, html_dir)
                    + "</tr>")
    return "".join(rows)


def _diff(patch: str) -> str:
    """A git patch, lines styled as git means them. Split on ``\n`` only, as git splits
    (``str.splitlines`` also breaks on CR, FF, U+2028 and more, so an added line with a
    CR in it showed its second half as unchanged context): such characters stay in their
    line and show escaped. A line's kind is read from the diff's structure: inside a
    hunk its first character says it (so added content starting ``++`` is an addition),
    and ``---``/``+++`` are file headers only before a file's first ``@@``."""
    out = []
    in_hunk = False
    for line in patch.split("\n"):
        if line.startswith("diff --git "):
            in_hunk, cls = False, ""
        elif line.startswith("@@"):
            in_hunk, cls = True, "hunk"
        elif in_hunk:
            cls = {"+": "add", "-": "del"}.get(line[:1], "")
        else:
            cls = ""
        out.append(f'<span class="{cls}">{h(line)}</span>' if cls else h(line))
    return "\n".join(out)


def render_html(r: Report, *, run_dir: Path, html_dir: Path) -> str:
    """The report as one HTML document; links are relative to ``html_dir``."""
    p: list[str] = [
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="referrer" content="no-referrer">',
        f"<title>cyclebox {h(r.name or '')}: {h(r.verdict)}</title><style>{_CSS}</style>",
        "</head><body>",
        f"<h1>cyclebox report: {h(r.name or '?')}</h1>",
        f'<div class="banner {h(r.verdict)}" id="verdict">{h(r.verdict)}</div>',
    ]
    if r.verdict == "accept_for_review":
        p.append("<p>Accepted <b>for review</b>: a person still decides whether to merge.</p>")
    if r.reasons:
        p.append("<ul>" + "".join(f"<li>{h(x)}</li>" for x in r.reasons) + "</ul>")
    if r.fixture:
        p.append("<p><b>fixture</b>: model calls came from scripted fixtures, not a real "
                 "model.</p>")
    p.append("<h2>Pass rates</h2><table><tr><th>arm</th><th>split</th><th>passed</th>"
             "<th>rows</th><th>not ok</th><th>rate</th></tr>")
    for pr in r.pass_rates:
        rate = "-" if pr.rate is None else f"{100 * pr.rate:.1f}%"
        p.append(f"<tr><td>{h(pr.arm)}</td><td>{h(pr.split)}</td><td>{pr.passed}</td>"
                 f"<td>{pr.rows}</td><td>{pr.rows - pr.ok}</td><td>{h(rate)}</td></tr>")
    p.append("</table>")
    for title, rows in (("Improved", r.improved), ("Regressed", r.regressed)):
        if rows:
            p.append(f"<h2>{title} ({len(rows)})</h2><ul>"
                     + "".join(f"<li>{h(change_text(c))}</li>" for c in rows) + "</ul>")
    if r.statistics is not None:
        s = r.statistics
        p.append(f"<p>Exact McNemar (beside the verdict, never instead): b={s.b}, c={s.c}, "
                 f"pairs={s.pairs}, p={h(f'{s.p_value:.4g}')}</p>")
    p.append("<h2>Cases</h2><table><tr><th>case</th><th>baseline</th><th>candidate</th></tr>")
    p += [_case_rows(c, run_dir, html_dir) for c in r.cases]
    p.append("</table><h2>Candidate patch</h2>")
    if r.patch is None:
        p.append('<p class="muted">no patch (no candidate was applied)</p>')
    else:
        p.append(f'<pre id="patch">{_diff(r.patch)}</pre>'
                 + ("<p><b>truncated</b></p>" if r.patch_truncated else ""))
    p.append("<h2>Cost per role</h2><table><tr><th>role</th><th>calls</th><th>ok</th>"
             "<th>tokens</th><th>cost</th><th>fixture calls</th></tr>")
    for c in r.costs:
        p.append(f"<tr><td>{h(c.role)}</td><td>{c.calls}</td><td>{c.ok}</td><td>{c.tokens}"
                 f"</td><td>{h(cost_text(c))}</td><td>{c.fixture_calls}</td></tr>")
    p.append("</table>")
    if r.timing:
        p.append("<p class=\"muted\">time per stage: " + h(", ".join(
            f"{k} {v:.1f}s" for k, v in r.timing.items() if "." not in k)) + "</p>")
    p.append(f"<p>receipt sha256 <code>{h(receipt_text(r))}</code>"
             f" · plan <code>{h(r.plan_hash or '?')}</code></p>")
    if r.problems:
        p.append("<h2>Problems reading the run</h2><ul>"
                 + "".join(f"<li>{h(x)}</li>" for x in r.problems) + "</ul>")
    p.append("</body></html>\n")
    return "\n".join(p)
