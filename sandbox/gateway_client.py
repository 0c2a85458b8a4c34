"""In-container helper: a real ``openai.OpenAI`` client bound to the gateway socket.

The controller mounts a directory read-only at ``/run/cyclebox/gateway`` holding
``gateway.sock`` and ``token`` (a per-run, per-role capability, never a provider
key). Retries are off: the gateway records every attempt and never hides one.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx2
import openai

GATEWAY_DIR = Path(os.environ.get("CYCLEBOX_GATEWAY_DIR", "/run/cyclebox/gateway"))


def client(*, timeout_s: float = 300.0, gateway_dir: Path | None = None) -> openai.OpenAI:
    """An OpenAI SDK client that reaches the model only through the gateway socket."""
    d = gateway_dir or GATEWAY_DIR
    token = (d / "token").read_text().strip()
    # openai>=3 speaks httpx2; its default client class keeps the SDK's own settings.
    transport = httpx2.HTTPTransport(uds=str(d / "gateway.sock"), retries=0)
    http = openai.DefaultHttpx2Client(transport=transport, timeout=timeout_s)
    return openai.OpenAI(api_key=token, base_url="http://cyclebox-gateway/v1",
                         http_client=http, max_retries=0)
