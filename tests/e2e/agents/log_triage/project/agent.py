"""A log-triage agent, written eight ways: one per framework and API family.

The case (/case/input.json) is {"question": "...", "variant": "..."}; the variant may also
be given as the first argument (``python /src/agent.py openai_agents``). Each variant
answers with ONE call of the function tool ``read_log(service)`` (a log excerpt from
/data/logs.json) and a final answer naming the failing component.

Nothing here knows it runs under cyclebox: every client is built with its framework's
defaults and reads its endpoint and key from the environment (OPENAI_BASE_URL,
OPENAI_API_KEY, ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY); the model name comes from
$CYCLEBOX_MODEL.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parent
sys.path.insert(0, str(SRC))

from variants import common  # noqa: E402


def main() -> int:
    case = json.loads(Path("/case/input.json").read_text())
    variant = sys.argv[1] if len(sys.argv) > 1 else str(case.get("variant", ""))
    if not variant.isidentifier() or not (SRC / "variants" / f"{variant}.py").is_file():
        print(f"unknown variant {variant!r}", file=sys.stderr)
        return 2
    model = os.environ.get("CYCLEBOX_MODEL", "")
    system = (SRC / "prompts" / "system.md").read_text()
    t0 = time.monotonic()
    module = importlib.import_module(f"variants.{variant}")
    imported = time.monotonic()
    reply = module.run(case["question"], system, model)
    answer = {"answer": reply.strip(), "refused": False, "evidence": list(common.READ),
              "variant": variant, "tool_calls": list(common.CALLS)}
    answer.update(common.EXTRA)
    # timings go to stderr: answer.json must be the same when a replay runs it again
    print(f"variant {variant}: import {imported - t0:.2f}s, run "
          f"{time.monotonic() - imported:.2f}s", file=sys.stderr)
    Path("/out/answer.json").write_text(json.dumps(answer, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
