"""Codex CLI as a cyclebox agent: one non-interactive `codex exec` per case, its final
message turned into /out/answer.json. A template: copy it into your project and set
`project.entry: [python3, /src/codex_agent.py]` (docs/agents.md, "Coding CLIs").

Everything here is Codex's own configuration, in the container's tmpfs:
- HOME, CODEX_HOME and the XDG directories live under /tmp/home (the image is read-only;
  Codex refuses a CODEX_HOME that does not exist, so it is made here, fresh per case);
- config.toml names one model provider, the gateway endpoint the launcher sets in
  OPENAI_BASE_URL, keyed by OPENAI_API_KEY (the per-run gateway token), Responses API,
  HTTP streaming (no websocket), no retries (a failed call is recorded, never replaced);
- analytics, update checks, plugins and apps (which reach github.com and chatgpt.com)
  and the hosted web_search tool (run by the upstream, refused by the gateway) are off.
- Codex's own sandbox cannot nest in a cyclebox container (no user namespaces, no new
  privileges): the container is the sandbox, so its commands run unconfined inside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CODEX = "/node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
"""The native binary of the platform package: bin/codex.js only finds and execs it."""
HOME = Path("/tmp/home")
PROMPT = Path(__file__).resolve().parent / "prompts" / "coding_cli.md"
"""The task, as the CLI is asked it (the cycle's worker may edit this file)."""


def config(model: str, base_url: str) -> str:
    return f"""model = {json.dumps(model)}
model_provider = "cyclebox"
check_for_update_on_startup = false
web_search = "disabled"

[analytics]
enabled = false

[features]
plugins = false
apps = false

[model_providers.cyclebox]
name = "cyclebox gateway"
base_url = {json.dumps(base_url)}
env_key = "OPENAI_API_KEY"
wire_api = "responses"
supports_websockets = false
request_max_retries = 0
stream_max_retries = 0
"""


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
    codex_home = HOME / ".codex"
    for d in (codex_home, HOME / ".config", HOME / ".cache", HOME / ".local/share",
              HOME / ".local/state", HOME / "work"):
        d.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        config(env["CYCLEBOX_MODEL"], env["OPENAI_BASE_URL"]))
    env.update(HOME=str(HOME), CODEX_HOME=str(codex_home),
               XDG_CONFIG_HOME=str(HOME / ".config"), XDG_CACHE_HOME=str(HOME / ".cache"),
               XDG_DATA_HOME=str(HOME / ".local/share"),
               XDG_STATE_HOME=str(HOME / ".local/state"))
    last = HOME / "last-message.txt"
    done = subprocess.run(
        [CODEX, "exec", "--json", "--skip-git-repo-check", "--ephemeral",
         "--sandbox", "danger-full-access", "--cd", str(HOME / "work"),
         "--output-last-message", str(last), PROMPT.read_text()],
        env=env, stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0 or not last.is_file():
        print(f"codex exec exited {done.returncode}", file=sys.stderr)
        return done.returncode or 1
    Path("/out/answer.json").write_text(json.dumps(answer_of(last.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
