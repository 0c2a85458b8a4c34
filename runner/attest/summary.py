"""What ``receipt attest`` shows: the subjects and digests, as JSON and as Markdown.

Names and digests come from the run (a cycle name, file names): Markdown gets every
string through the report's :func:`runner.report.text.md` (HTML-escaped, punctuation and
``|`` backslash-escaped, no autolinks, mentions or issue references, one line), so none
can open a link, notify anyone, split a table cell or inject HTML in a step summary.
"""

from __future__ import annotations

from typing import Any

from runner.attest.bundle import Attested
from runner.report.text import md


def summary_json(done: Attested) -> dict[str, Any]:
    return {"bundle": str(done.path), "keyid": done.keyid, "scheme": done.keytype,
            "statements": [{"predicateType": s.predicateType,
                            "subject": [d.model_dump(exclude_none=True) for d in s.subject]}
                           for s in done.statements]}


def summary_markdown(done: Attested) -> str:
    rows = ["## cyclebox attestations", "",
            f"Bundle {md(done.path.name)}, signed by {md(done.keytype)} key "
            f"{md(done.keyid)}.", "",
            "| predicate | subject | digest |", "| --- | --- | --- |"]
    for s in done.statements:
        for d in s.subject:
            digests = "<br>".join(md(f"{k}:{v}") for k, v in sorted(d.digest.items()))
            rows.append(f"| {md(s.predicateType)} | {md(d.name or '')} | {digests} |")
    return "\n".join(rows) + "\n"
