"""Entry of the coding-CLI cases: the case's ``variant`` picks the wrapper (codex_agent.py
for Codex CLI, claude_agent.py for Claude Code); each runs its CLI once on the case."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent
sys.path.insert(0, str(SRC))

WRAPPERS = {"codex": "codex_agent", "claude_code": "claude_agent"}


def main() -> int:
    variant = str(json.loads(Path("/case/input.json").read_text()).get("variant"))
    if variant not in WRAPPERS:
        print(f"unknown variant {variant!r}; one of {sorted(WRAPPERS)}", file=sys.stderr)
        return 2
    module = __import__(WRAPPERS[variant])
    return int(module.main())


if __name__ == "__main__":
    sys.exit(main())
