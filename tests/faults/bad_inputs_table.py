"""Print the bad-input table as Markdown: case, exit code, first line of the message,
anything written. Runs the same cases as ``test_bad_inputs.py``, through the same CLI.

    .venv/bin/python tests/faults/bad_inputs_table.py > bad-inputs.md
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.faults.test_bad_inputs import CASES, run_case


def _cell(text: str, root: str) -> str:
    text = text.replace(root, "…").removeprefix("error: ")  # run_case already did the path
    text = re.sub(r"\s+", " ", text).strip()
    return text.replace("|", "\\|").replace("`", "'")[:220]


def main() -> int:
    rows = ["| # | case | exit | expected | message (first line) | written |",
            "|---|---|---|---|---|---|"]
    bad = 0
    for i, c in enumerate(CASES, start=1):
        with tempfile.TemporaryDirectory(prefix="cyclebox-bad-") as tmp:
            o = run_case(c, Path(tmp))
            ok = (o.code == c.code and "Traceback" not in o.stderr and not o.written
                  and all(s in o.first_line for s in c.expect))
            bad += not ok
            rows.append(f"| {i} | {c.id} | {o.code} | {c.code} | {_cell(o.first_line, tmp)} | "
                        f"{', '.join(o.written) or 'no'}{'' if ok else ' **MISMATCH**'} |")
    print("\n".join(rows))
    print(f"\n{len(CASES)} cases, {len(CASES) - bad} as expected, {bad} not.")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
