"""A fast local OpenAI-compatible upstream for bench/gateway.py (uvicorn, fixed reply)."""

from __future__ import annotations

import json
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

BODY = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 1, "model": "bench",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}).encode()


async def chat(request: Request) -> Response:
    await request.body()
    return Response(BODY, media_type="application/json")


app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
                access_log=False)
