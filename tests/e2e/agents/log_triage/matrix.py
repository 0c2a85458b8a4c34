"""The log-triage agent's framework matrix: incidents, variants, and the files made of them.

One agent project (``project/``) answers each incident with ONE function tool call,
``read_log(service)`` (a log excerpt from ``/data/logs.json``), then a final answer
naming the failing component. Eight variants, one per framework and API family, each
on its framework's defaults (``project/variants/``). A scenario is an incident run by one
variant: its input names both, so one cycle's baseline and candidate cover the whole
matrix with one derived analyst image.

``python tests/e2e/agents/log_triage/matrix.py`` rewrites the committed files from the
tables below (the full matrix: 11 incidents x 8 variants); ``write(dest, ...)`` writes a
smaller selection elsewhere (the e2e test: a few incidents per variant).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent

# (id, service, question detail, failing component, log excerpt)
INCIDENTS: list[tuple[str, str, str, str, str]] = [
    ("INC-101", "checkout", "checkout requests fail with HTTP 502", "payments-db",
     "12:00:01 ERROR checkout: upstream payments-db: connection pool exhausted (50/50)\n"
     "12:00:02 WARN checkout: retry 3/3 failed, returning 502"),
    ("INC-102", "search", "search returns no results", "elasticsearch",
     "08:14:10 ERROR search: elasticsearch cluster health RED, 12 shards unassigned\n"
     "08:14:11 WARN search: falling back to empty result set"),
    ("INC-103", "login", "users are logged out every few minutes", "auth-redis",
     "21:03:55 ERROR login: auth-redis OOM command not allowed when used memory > maxmemory\n"
     "21:03:56 WARN login: session write failed, issuing anonymous session"),
    ("INC-104", "email", "password reset mails never arrive", "smtp-relay",
     "03:22:07 ERROR email: smtp-relay TLS handshake failed: certificate has expired\n"
     "03:22:08 WARN email: message queued for retry (attempt 9)"),
    ("INC-105", "uploads", "file uploads hang at 99%", "s3-gateway",
     "10:40:12 ERROR uploads: s3-gateway PutObject: no space left on device\n"
     "10:40:12 WARN uploads: multipart upload aborted"),
    ("INC-106", "billing", "invoices are not generated", "ledger-api",
     "00:00:30 ERROR billing: ledger-api POST /entries timed out after 30s\n"
     "00:00:31 WARN billing: invoice run aborted, 0 of 1200 written"),
    ("INC-107", "notifications", "push notifications are delayed by hours", "kafka-broker",
     "14:55:02 ERROR notifications: kafka-broker-2 LEADER_NOT_AVAILABLE for topic push\n"
     "14:55:03 WARN notifications: producer buffer full, blocking"),
    ("INC-108", "reports", "the nightly report is missing", "cron-scheduler",
     "02:00:00 ERROR reports: cron-scheduler lock held by a dead worker since yesterday\n"
     "02:00:00 WARN reports: job nightly-report skipped"),
    ("INC-109", "inventory", "stock counts freeze during the sale", "inventory-db",
     "18:30:44 ERROR inventory: inventory-db deadlock detected, transaction rolled back\n"
     "18:30:45 WARN inventory: 340 reservations pending"),
    ("INC-110", "images", "product pictures show as broken", "thumbnailer",
     "07:12:09 ERROR images: thumbnailer worker exited on signal 11 (segfault)\n"
     "07:12:09 WARN images: serving placeholder for 4211 requests"),
    ("INC-111", "api", "partners get HTTP 429 on every call", "rate-limiter",
     "16:01:20 ERROR api: rate-limiter config reload set limit=0 for tier partner\n"
     "16:01:21 WARN api: rejecting request from partner acme"),
]
DEVELOPMENT = 4
"""The first incidents are the development split (briefed to the worker), the rest held out."""

# variant -> (framework, family, stream, tools)
VARIANTS: dict[str, tuple[str, str, bool, bool]] = {
    "openai_chat": ("openai", "chat", False, True),
    "openai_chat_stream": ("openai", "chat", True, True),
    "openai_responses_stream": ("openai", "responses", True, True),
    "openai_agents": ("openai-agents", "responses", False, True),
    "anthropic_messages_stream": ("anthropic", "messages", True, True),
    "langgraph_react": ("langchain-openai+langgraph", "chat", False, True),
    "pydantic_ai": ("pydantic-ai", "responses", False, True),
    "litellm_tools": ("litellm", "chat", False, True),
}
EMBEDDINGS_VARIANT = "openai_chat"
"""The variant that also embeds the question (POST /v1/embeddings)."""
TARGET_MODEL = "fixture-target"
EMBED_MODEL = "fixture-embed"
SHORT_RULE = "Reply with the failing component's name only"
"""The line the worker's edit adds to prompts/system.md; the scripted model then answers
with the bare name, which the text scorer accepts (the long sentence it gives before
does not)."""


def question(inc: tuple[str, str, str, str, str]) -> str:
    iid, service, detail, _, _ = inc
    return (f"Incident {iid}: {detail}. Read the {service} service's log and name the "
            "failing component.")


def case_id(n: int, variant: str) -> str:
    split = "d" if n < DEVELOPMENT else "a"
    return f"{split}{n + 1:02d}-{INCIDENTS[n][1]}--{variant.replace('_', '-')}"


def scenarios(incidents: list[int], variants: list[str]) -> dict[str, Any]:
    rows = []
    for v in variants:
        for n in incidents:
            inc = INCIDENTS[n]
            rows.append({
                "id": case_id(n, v),
                "split": "development" if n < DEVELOPMENT else "acceptance",
                "input": {"question": question(inc), "variant": v},
                "reference": {"kind": "text", "value": inc[3], "evidence": [inc[1]]},
            })
    return {"schema": 1, "dataset": "log-triage", "stores": {"logs": "logs.json"},
            "scenarios": rows}


def policy(ids: list[str]) -> dict[str, Any]:
    return {"schema": 1, "cases": ids, "trials": 1, "mandatory": [],
            "criteria": ["correctness", "evidence", "refusal"], "require_judge": False,
            "max_case_latency_s": 120, "max_total_cost_usd": 1.0,
            "require_improvement": True}


def target_script() -> dict[str, Any]:
    """The scripted target model, for every API family alike: the first turn of an
    incident asks for read_log(service); once the tool result is in, the final answer
    (the bare component name when the system prompt asks for it)."""
    rules: list[dict[str, Any]] = []
    for iid, service, _, component, _ in INCIDENTS:
        rules += [
            {"when": {"tool_result": True, "contains": [iid, SHORT_RULE]},
             "reply": component},
            {"when": {"tool_result": True, "contains": [iid]},
             "reply": f"The failing component is {component}, according to the {service} log."},
            {"when": {"tool_result": False, "contains": [iid]},
             "tool_call": {"name": "read_log", "arguments": {"service": service}}},
        ]
    return {"schema": 1, "rules": rules,
            "default": {"reply": "no scripted reply for this request"}}


def optimizer_script() -> dict[str, Any]:
    system = (HERE / "project" / "prompts" / "system.md").read_text()
    return {"schema": 1, "rules": [{
        "when": {"role": "worker", "contains": ["failed criteria: correctness"]},
        "reply_json": {
            "files": [{"path": "prompts/system.md",
                       "content": system.rstrip("\n") + f"\n\n{SHORT_RULE}, e.g. payments-db: "
                                                        "no sentence, no punctuation.\n"}],
            "rationale": "Answers came as sentences the text scorer cannot match; the prompt "
                         "now asks for the component name alone."}}]}


def logs() -> dict[str, Any]:
    return {"services": {inc[1]: inc[4] for inc in INCIDENTS}}


def _yaml(path: Path, doc: Any, header: str) -> None:
    path.write_text(header + yaml.safe_dump(doc, sort_keys=False, width=100))


def write(dest: Path, incidents: list[int] | None = None,
          variants: list[str] | None = None) -> list[str]:
    """Write scenarios.yaml, policy.yaml, the scripts and data/ for a selection into
    ``dest`` (the committed directory by default); returns the case ids."""
    incidents = list(range(len(INCIDENTS))) if incidents is None else incidents
    variants = list(VARIANTS) if variants is None else variants
    gen = "# Generated by matrix.py from its tables; edit those, then run it again.\n"
    (dest / "scripts").mkdir(parents=True, exist_ok=True)
    (dest / "data").mkdir(parents=True, exist_ok=True)
    doc = scenarios(incidents, variants)
    _yaml(dest / "scenarios.yaml", doc, gen)
    ids = [s["id"] for s in doc["scenarios"]]
    _yaml(dest / "policy.yaml", policy(ids), gen)
    _yaml(dest / "scripts" / "target.yaml", target_script(), gen)
    _yaml(dest / "scripts" / "optimizer.yaml", optimizer_script(), gen)
    (dest / "data" / "logs.json").write_text(json.dumps(logs(), indent=1) + "\n")
    return ids


def copy_project(dest: Path) -> None:
    """The agent project (project/, cycle.yaml) copied to ``dest``."""
    shutil.copytree(HERE / "project", dest / "project",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(HERE / "cycle.yaml", dest / "cycle.yaml")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--incidents", type=int, default=len(INCIDENTS),
                    help="first N incidents per variant")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    ids = write(args.out, list(range(args.incidents)), args.variants.split(","))
    print(f"{len(ids)} cases written to {args.out}")


if __name__ == "__main__":
    main()
