"""A cyclebox agent: answers one question from a small fact file, through its model.

The contract (docs/contracts.md in cyclebox; `cyclebox schema answer`):
- the case is /case/input.json, here {"question": "..."};
- the data directory is /data (read-only), this source tree /src (read-only);
- the answer goes to /out/answer.json: {"answer", "refused", "evidence", ...};
- the model is reached with the OpenAI SDK as is: `OpenAI()` reads OPENAI_BASE_URL and
  OPENAI_API_KEY, which cyclebox points at the container's own gateway endpoint (the key
  is a per-run token, never a provider key); the model's name is in $CYCLEBOX_MODEL.

The model is asked to reply with one JSON object:
  {"answer": <number or text>, "evidence": ["<fact id>", ...]}   an answer from the facts
  {"refuse": "<why>"}                                             a declined request
"""

from __future__ import annotations

import json
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


def facts() -> str:
    rows = json.loads(Path("/data/facts.json").read_text())["facts"]
    return "\n".join(f"- [{f['id']}] {f['text']}" for f in rows)


def main() -> int:
    model = os.environ.get("CYCLEBOX_MODEL")
    if not model:
        print("CYCLEBOX_MODEL is not set: run this agent under cyclebox", file=sys.stderr)
        return 2
    case = json.loads(Path("/case/input.json").read_text())
    reply = OpenAI().chat.completions.create(
        model=model, temperature=0,
        messages=[{"role": "system", "content": instructions()},
                  {"role": "user", "content": f"{case['question']}\n\nFacts:\n{facts()}"}],
    ).choices[0].message.content or ""
    answer: dict[str, object] = {"question": case["question"], "model_reply": reply,
                                 "refused": False, "answer": None, "evidence": []}
    try:
        parsed = json.loads(reply)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and "refuse" in parsed:
        answer.update(refused=True, reason=str(parsed["refuse"]))
    elif isinstance(parsed, dict) and "answer" in parsed:
        evidence = parsed.get("evidence")
        answer.update(answer=parsed["answer"],
                      evidence=[str(e) for e in evidence] if isinstance(evidence, list) else [])
    else:
        answer.update(error="model reply not understood")
    Path("/out/answer.json").write_text(json.dumps(answer, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
