"""In-container helper: a real ``openai.OpenAI`` client bound to the gateway socket, and
one-shot completions in the API family of the role's upstream.

The controller mounts a directory read-only at ``/run/cyclebox/gateway`` holding
``gateway.sock`` and ``token`` (a per-run, per-role capability, never a provider
key). Retries are off: the gateway records every attempt and never hides one.
``CYCLEBOX_API`` (set by the controller from the upstream's provider: ``chat``,
``responses`` or ``messages``) picks the family :func:`complete` speaks; the gateway
never translates between families.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx2
import openai

GATEWAY_DIR = Path(os.environ.get("CYCLEBOX_GATEWAY_DIR", "/run/cyclebox/gateway"))
API_ENV = "CYCLEBOX_API"
APIS = ("chat", "responses", "messages")
ANTHROPIC_VERSION = "2023-06-01"


def client(*, timeout_s: float = 300.0, gateway_dir: Path | None = None) -> openai.OpenAI:
    """An OpenAI SDK client that reaches the model only through the gateway socket."""
    d = gateway_dir or GATEWAY_DIR
    token = (d / "token").read_text().strip()
    # openai>=3 speaks httpx2; its default client class keeps the SDK's own settings.
    transport = httpx2.HTTPTransport(uds=str(d / "gateway.sock"), retries=0)
    http = openai.DefaultHttpx2Client(transport=transport, timeout=timeout_s)
    return openai.OpenAI(api_key=token, base_url="http://cyclebox-gateway/v1",
                         http_client=http, max_retries=0)


def api_family(api: str | None = None) -> str:
    """The family to speak: ``api``, else $CYCLEBOX_API, else chat; ValueError otherwise."""
    chosen = api or os.environ.get(API_ENV) or "chat"
    if chosen not in APIS:
        raise ValueError(f"{API_ENV}={chosen!r} is not one of {list(APIS)}")
    return chosen


def _messages(messages: list[dict[str, Any]], *, model: str, max_tokens: int,
              gateway_dir: Path | None, timeout_s: float) -> str:
    """One Anthropic Messages call over the socket (plain HTTP: the image needs no
    anthropic SDK); RuntimeError carrying the gateway's message on an error."""
    d = gateway_dir or GATEWAY_DIR
    token = (d / "token").read_text().strip()
    system = "\n\n".join(str(m["content"]) for m in messages if m.get("role") == "system")
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                            "messages": [m for m in messages if m.get("role") != "system"]}
    if system:
        body["system"] = system
    transport = httpx2.HTTPTransport(uds=str(d / "gateway.sock"), retries=0)
    with httpx2.Client(transport=transport, timeout=timeout_s) as http:
        resp = http.post("http://cyclebox-gateway/v1/messages", content=json.dumps(body),
                         headers={"x-api-key": token, "anthropic-version": ANTHROPIC_VERSION,
                                  "content-type": "application/json"})
    try:
        obj = resp.json()
    except ValueError:
        obj = None
    if resp.status_code != 200 or not isinstance(obj, dict):
        err = obj.get("error") if isinstance(obj, dict) else None
        msg = err.get("message") if isinstance(err, dict) else resp.text[:300]
        raise RuntimeError(f"messages call failed ({resp.status_code}): {msg}")
    return "".join(b.get("text", "") for b in obj.get("content") or []
                   if isinstance(b, dict) and b.get("type") == "text")


def complete(messages: list[dict[str, Any]], *, model: str, max_tokens: int,
             api: str | None = None, gateway_dir: Path | None = None,
             timeout_s: float = 300.0) -> str:
    """The reply text to chat-style ``messages`` (system/user/assistant, string content),
    at temperature 0, in the family :func:`api_family` picks."""
    family = api_family(api)
    if family == "messages":
        return _messages(messages, model=model, max_tokens=max_tokens,
                         gateway_dir=gateway_dir, timeout_s=timeout_s)
    c = client(timeout_s=timeout_s, gateway_dir=gateway_dir)
    if family == "responses":
        system = "\n\n".join(str(m["content"]) for m in messages if m.get("role") == "system")
        rest: Any = [{"role": m["role"], "content": m["content"]} for m in messages
                     if m.get("role") != "system"]
        r = c.responses.create(model=model, input=rest, max_output_tokens=max_tokens,
                               temperature=0, instructions=system or openai.omit)
        return r.output_text or ""
    chat: Any = messages
    return c.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens,
                                     messages=chat).choices[0].message.content or ""
