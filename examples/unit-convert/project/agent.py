"""unit-convert: converts a quantity between units; the model parses, the code computes.

The contract (docs/contracts.md; `cyclebox schema answer`):
- the case is /case/input.json: {"question": "How many litres are 3 gallons?"};
- the unit table is /data/units.json (read-only), this source tree /src (read-only);
- the answer goes to /out/answer.json: {"answer": <number>, "evidence": [from, to], ...}
  or {"refused": true, ...};
- the model is reached with the OpenAI SDK as is (`OpenAI()`: cyclebox's environment
  points it at the container's own gateway endpoint); its name is in $CYCLEBOX_MODEL.

The model replies with one JSON object:
  {"value": <number>, "from": "<unit id>", "to": "<unit id>"}   a conversion to compute
  {"refuse": "<why>"}                                           not a unit conversion
The arithmetic is done here, from the table: the model only reads the question. A
conversion between different dimensions (metres to kilograms) is refused here too.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from openai import OpenAI

SRC = Path(__file__).resolve().parent


def instructions() -> str:
    """The system prompt: prompts/system.md, then every skill file (the worker edits these)."""
    parts = [(SRC / "prompts" / "system.md").read_text()]
    parts += [p.read_text() for p in sorted((SRC / "skills").glob("*.md"))]
    return "\n\n".join(parts)


def units() -> dict[str, dict[str, object]]:
    rows = json.loads(Path("/data/units.json").read_text())["units"]
    return {str(u["id"]): u for u in rows}


def convert(parsed: dict[str, object], table: dict[str, dict[str, object]]
            ) -> dict[str, object]:
    """The answer fields for a parsed conversion (refused when it cannot be done)."""
    src, dst, value = parsed.get("from"), parsed.get("to"), parsed.get("value")
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return {"refused": True, "reason": "no numeric quantity in the question"}
    if src not in table or dst not in table:
        return {"refused": True, "reason": f"unknown unit {src if src not in table else dst}"}
    a, b = table[str(src)], table[str(dst)]
    if a["dimension"] != b["dimension"]:
        return {"refused": True, "reason": f"cannot convert {a['dimension']} to "
                                           f"{b['dimension']}"}
    result = value * float(str(a["si"])) / float(str(b["si"]))
    return {"refused": False, "answer": round(result, 6), "evidence": [str(src), str(dst)]}


def main() -> int:
    model = os.environ.get("CYCLEBOX_MODEL")
    if not model:
        print("CYCLEBOX_MODEL is not set: run this agent under cyclebox", file=sys.stderr)
        return 2
    case = json.loads(Path("/case/input.json").read_text())
    table = units()
    listing = "\n".join(f"- {uid}: {u['name']} ({u['dimension']})" for uid, u in table.items())
    reply = OpenAI().chat.completions.create(
        model=model, temperature=0,
        messages=[{"role": "system", "content": instructions()},
                  {"role": "user", "content": f"{case['question']}\n\nUnits:\n{listing}"}],
    ).choices[0].message.content or ""
    answer: dict[str, object] = {"question": case["question"], "model_reply": reply,
                                 "refused": False, "answer": None, "evidence": []}
    try:
        parsed = json.loads(reply)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and "refuse" in parsed:
        answer.update(refused=True, reason=str(parsed["refuse"]))
    elif isinstance(parsed, dict):
        answer.update(convert(parsed, table))
    else:
        answer.update(error="model reply not understood")
    Path("/out/answer.json").write_text(json.dumps(answer, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
