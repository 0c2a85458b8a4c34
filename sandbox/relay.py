"""Model-call relay (runs in the worker image with the optimizer role): make each listed
call through the gateway, once, and write the replies. Used by dream variants, whose
decisions all happen on the host; this program only talks to the model.

/in/calls.json: {"model", "max_tokens", "calls": [{"id", "messages"}]}
/out/replies.json: {id: {"ok": true, "text": ...} | {"ok": false, "error": ...}}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sandbox.gateway_client import api_family, complete


def main(in_dir: Path = Path("/in"), out_dir: Path = Path("/out")) -> int:
    req = json.loads((in_dir / "calls.json").read_text())
    api = api_family()  # the optimizer upstream's family ($CYCLEBOX_API)
    replies: dict[str, dict[str, object]] = {}
    for call in req["calls"]:
        try:
            text = complete(call["messages"], model=req["model"],
                            max_tokens=req["max_tokens"], api=api)
            replies[call["id"]] = {"ok": True, "text": text}
        except Exception as exc:
            replies[call["id"]] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    (out_dir / "replies.json").write_text(json.dumps(replies, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
