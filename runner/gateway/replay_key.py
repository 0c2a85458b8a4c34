"""The second key a replay may match a request by, when its exact bytes miss (pure).

Coding CLIs put fresh identifiers into every request: Codex CLI a ``client_metadata``
object (installation, session, thread and turn ids, a start timestamp), a
``prompt_cache_key`` (the session id) and item ids with a UUID in them; Claude Code a
``metadata.user_id`` (a device id and the session id). Two runs of the same agent on the
same case therefore never send the same bytes, and a replay by request hash alone could
only ever miss. This key is the request with those fields left out and every UUID
masked: what the model is asked (instructions, messages, tools, tool results, caps) must
still be identical to the byte, so a replay still fails closed on any real drift. The
fields left out never reach the model's input; they tag the call for the upstream's
caches and logs.

Not masked, deliberately: dates. Claude Code writes today's date into its system prompt,
so a replay on a later UTC day misses (``replay_miss``) rather than answering a prompt
that differs.

Also masked: the head Codex CLI writes above every exec_command output it returns to the
model, a random chunk id and the command's wall time (:data:`TOOL_HEADER`); the output
itself must match.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

VOLATILE: dict[str, frozenset[str]] = {
    "responses": frozenset({"client_metadata", "prompt_cache_key", "metadata",
                            "safety_identifier", "user"}),
    "chat": frozenset({"metadata", "user", "prompt_cache_key", "safety_identifier"}),
    "messages": frozenset({"metadata"}),
    "count_tokens": frozenset(),
    "embeddings": frozenset({"user"}),
}
"""Top-level request fields per API family that identify a call, never its content."""
UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
TOOL_HEADER = ((re.compile(r"Chunk ID: [0-9a-f]{1,16}\b"), "Chunk ID: <id>"),
               (re.compile(r"Wall time: [0-9]+(?:\.[0-9]+)? seconds"), "Wall time: <t> seconds"))
"""The head Codex CLI puts on its exec_command output (``Chunk ID: 765f32``, ``Wall time:
1.3057 seconds``, as JSON-escaped text): a random id and the command's wall time, not
what the command printed."""


def stable_key(request: bytes, api: str) -> str | None:
    """sha256 of ``request`` (a JSON object) without its family's :data:`VOLATILE` fields,
    keys sorted, every UUID replaced by ``<uuid>``; None when it is not a JSON object."""
    try:
        body: Any = json.loads(request)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    drop = VOLATILE.get(api, frozenset())
    kept = {k: v for k, v in body.items() if k not in drop}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for pattern, mask in TOOL_HEADER:
        text = pattern.sub(mask, text)
    return hashlib.sha256(UUID.sub("<uuid>", text).encode()).hexdigest()
