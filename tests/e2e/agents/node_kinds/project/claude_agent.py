"""Claude Code as a cyclebox agent: one non-interactive `claude -p` per case, its result
turned into /out/answer.json. A template: copy it into your project and set
`project.entry: [python3, /src/claude_agent.py]` (docs/agents.md, "Coding CLIs").

Everything here is Claude Code's own configuration, in the container's tmpfs:
- HOME, CLAUDE_CONFIG_DIR and the XDG directories live under /tmp/home (the image is
  read-only), fresh per case;
- the model is the gateway's (ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY, the per-run
  token, come from the launcher), ANTHROPIC_MODEL and the small-model slot both name
  CYCLEBOX_MODEL so that no call asks for a model the upstream does not allow;
- CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS=1: the gateway forwards no anthropic-beta
  header (a beta can switch on upstream behaviour it cannot bound), so Claude Code's
  beta-only request fields (context_management, system messages among the messages)
  would be refused; this is Claude Code's own switch for gateways;
- CLAUDE_CODE_MAX_RETRIES=0: a failed call is recorded and final, never retried (its
  default is ten retries with backoff, ~2 minutes of waiting on a refused call);
- telemetry, the auto-updater and error reports are switched off by the launcher for
  every bound container (DISABLE_TELEMETRY, ...); anything else it tries to reach is
  refused by the container's deny-all proxy and named in the run record.
- permissions are bypassed: the container is the sandbox (no network, read-only image,
  its own tmpfs), and nobody is there to answer a prompt. Claude Code refuses that mode
  as root; cyclebox roles never run as root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CLAUDE = "/node_modules/@anthropic-ai/claude-code-linux-x64/claude"
"""The native binary of the platform package. The main package's bin/claude.exe is a
placeholder its postinstall script overwrites; no install script runs in cyclebox."""
HOME = Path("/tmp/home")
PROMPT = Path(__file__).resolve().parent / "prompts" / "coding_cli.md"
"""The task, as the CLI is asked it (the cycle's worker may edit this file)."""


def answer_of(text: str) -> dict[str, object]:
    """The final message as an answer object: the JSON object it holds, else its text."""
    body = text.strip()
    if body.startswith("```"):
        body = body.strip("`").removeprefix("json").strip()
    try:
        got = json.loads(body)
    except ValueError:
        return {"answer": text.strip(), "refused": False, "evidence": []}
    if isinstance(got, dict) and "answer" in got:
        return got
    return {"answer": got, "refused": False, "evidence": []}


def main() -> int:
    env = dict(os.environ)
    for d in (HOME / ".claude", HOME / ".config", HOME / ".cache", HOME / ".local/share",
              HOME / ".local/state", HOME / "work"):
        d.mkdir(parents=True, exist_ok=True)
    model = env["CYCLEBOX_MODEL"]
    env.update(HOME=str(HOME), CLAUDE_CONFIG_DIR=str(HOME / ".claude"),
               XDG_CONFIG_HOME=str(HOME / ".config"), XDG_CACHE_HOME=str(HOME / ".cache"),
               XDG_DATA_HOME=str(HOME / ".local/share"),
               XDG_STATE_HOME=str(HOME / ".local/state"),
               ANTHROPIC_MODEL=model, ANTHROPIC_SMALL_FAST_MODEL=model,
               ANTHROPIC_DEFAULT_HAIKU_MODEL=model,
               CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS="1", CLAUDE_CODE_MAX_RETRIES="0")
    done = subprocess.run(
        [CLAUDE, "-p", PROMPT.read_text(), "--output-format", "json", "--model", model,
         "--dangerously-skip-permissions"],
        env=env, cwd=HOME / "work", stdin=subprocess.DEVNULL, capture_output=True,
        check=False)
    sys.stderr.buffer.write(done.stderr[-16384:])
    try:
        result = json.loads(done.stdout)
    except ValueError:
        result = None
    if not isinstance(result, dict) or result.get("is_error") or not isinstance(
            result.get("result"), str):
        sys.stderr.buffer.write(done.stdout[-4096:])
        print(f"\nclaude -p exited {done.returncode} without a result", file=sys.stderr)
        return done.returncode or 1
    Path("/out/answer.json").write_text(json.dumps(answer_of(result["result"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
