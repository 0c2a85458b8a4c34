"""shop-analyst: a small analyst agent answering questions over a read-only SQLite store.

Contract with cyclebox (analyst role): the case is /case/input.json ({"question",
"store"}), data stores are under /data (read-only), this source tree is /src
(read-only), and the answer goes to /out/answer.json. The model is reached only
through the openai SDK, bound to the cyclebox gateway socket.

The model chooses what to do and replies with one JSON object:
  {"action": "sql", "sql": "SELECT ..."}      run a read-only query; its first cell is the answer
  {"action": "refuse", "reason": "..."}       decline the request
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

from openai import OpenAI

SRC = Path(__file__).resolve().parent
MODEL = "fixture-target"


def instructions() -> str:
    parts = [(SRC / "prompts" / "system.md").read_text()]
    parts += [p.read_text() for p in sorted((SRC / "skills").glob("*.md"))]
    return "\n\n".join(parts)


def schema(db: sqlite3.Connection) -> str:
    rows = db.execute("SELECT sql FROM sqlite_master WHERE type='table' ORDER BY name")
    return "\n".join(r[0] for r in rows)


def main() -> int:
    case = json.loads(Path("/case/input.json").read_text())
    store = Path("/data") / f"{case['store']}.sqlite"
    db = sqlite3.connect(f"file:{store}?mode=ro&immutable=1", uri=True)
    db.execute("PRAGMA query_only = ON")
    reply = OpenAI().chat.completions.create(
        model=MODEL, temperature=0,
        messages=[{"role": "system", "content": instructions()},
                  {"role": "user", "content": f"{case['question']}\n\nSchema:\n{schema(db)}"}],
    ).choices[0].message.content or ""
    answer: dict[str, object] = {"question": case["question"], "model_reply": reply}
    try:
        action = json.loads(reply)
    except json.JSONDecodeError:
        action = {"action": "invalid"}
    if action.get("action") == "refuse":
        answer.update(refused=True, answer=None, evidence=[], reason=action.get("reason"))
    elif action.get("action") == "sql":
        sql = str(action.get("sql", ""))
        try:
            row = db.execute(sql).fetchone()
            value = None if row is None else row[0]
            answer.update(refused=False, answer=value, evidence=[sql])
        except sqlite3.Error as exc:
            answer.update(refused=False, answer=None, evidence=[sql], error=str(exc))
    else:
        answer.update(refused=False, answer=None, evidence=[], error="model reply not understood")
    Path("/out/answer.json").write_text(json.dumps(answer, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
