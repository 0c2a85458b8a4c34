"""Coding worker (runs in the worker container): one model call, no tools, in the API
family of the optimizer upstream ($CYCLEBOX_API).

Reads /in/request.json, asks the optimizer model (through the gateway) for replacement
files, validates the reply's shape and paths, and writes /out/proposal.json. It runs
nothing it receives. Exit 3 with /out/proposal-error.json on a malformed reply.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from sandbox.gateway_client import complete
from sandbox.proposal import Refused, check_changes, parse_reply

SYSTEM = """You are a coding worker improving an LLM agent's prompt, skill and code files.
You get a failure brief and the current contents of the files you may change.
Reply with exactly one JSON object and nothing else:
{"files": [{"path": "<one of the allowed paths>", "content": "<the full new file>"}],
 "rationale": "<one paragraph: what you changed and why>"}
Change as little as needed. Only the allowed paths can be changed."""


def prompt(req: dict[str, Any]) -> str:
    parts = [f"# Failure brief\n\n{req['brief']}", "# Allowed paths\n\n"
             + "\n".join(f"- {p}" for p in req["paths"])]
    for f in req["files"]:
        parts.append(f"# File: {f['path']}\n\n```\n{f['content']}```")
    return "\n\n".join(parts)


def main(in_dir: Path = Path("/in"), out_dir: Path = Path("/out")) -> int:
    req = json.loads((in_dir / "request.json").read_text())
    # The family ($CYCLEBOX_API: chat, responses or messages) is the optimizer upstream's.
    reply = complete([{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": prompt(req)}],
                     model=req["model"], max_tokens=req["max_tokens"])
    try:
        changes, rationale = parse_reply(reply)
        check_changes(changes, paths=set(req["paths"]), allowlist=list(req["allowlist"]))
    except Refused as exc:
        (out_dir / "proposal-error.json").write_text(json.dumps(
            {"reason": exc.reason, "message": exc.message, "reply": reply}))
        print(f"proposal refused: {exc}", file=sys.stderr)
        return 3
    base = {f["path"]: f["sha256"] for f in req["files"]}
    proposal = {"schema": 1, "files": [{"path": c.path, "content": c.content} for c in changes],
                "rationale": rationale, "base": {c.path: base.get(c.path) for c in changes}}
    # The path set and allowlist are the operator's (plan or apply flags): a proposal that
    # carried its own would be refused by `cyclebox apply`, so the worker never writes them.
    (out_dir / "proposal.json").write_text(json.dumps(proposal, sort_keys=True, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
