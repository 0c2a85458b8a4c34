"""Runs a cyclebox Gateway in its own process (bench/gateway.py, tests/security).

``_gateway_proc.py PORT``: forward to an openai-compatible upstream on 127.0.0.1:PORT.
``_gateway_proc.py '{upstream policy JSON}'``: any upstream policy (role analyst).
A second socket (``flood_dir``, stage ``flooded``) is there to be flooded.
``CBX_BENCH_BARE_HANDLER=1``: the handler is a bare forward (the floor's http_relay).
Prints {"dir", "token", "flood_dir", "run_dir", "pid"} once the sockets are up;
exits when stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from runner.gateway import server
from runner.gateway.budget import BudgetPolicy, RunBudget
from runner.gateway.config import parse_upstream
from runner.gateway.server import Gateway

# Ablations for the flooded-socket figure: CBX_BENCH_OFFLOAD_BYTES (parse/write on the
# loop below this size), CBX_BENCH_BYTE_RATE (per-socket body bytes/s).
server.OFFLOAD_BYTES = int(os.environ.get("CBX_BENCH_OFFLOAD_BYTES", server.OFFLOAD_BYTES))

if os.environ.get("CBX_BENCH_BARE_HANDLER"):
    # The floor's "http_relay" (bench/gateway.py --floor): the gateway's own HTTP server
    # (limits, token check) and upstream client, its handler replaced by a bare forward of
    # the request bytes: no parse, no policy, no usage, no budget, no record. An ablation
    # for the bench only; never a mode of the gateway.
    from runner.gateway.http import Head, Reply

    async def _bare(self: server._Handler, head: Head, body: bytes) -> Reply:
        p = self.gw._providers[self.name]  # type: ignore[index]
        status, data = await p._client.post(  # type: ignore[attr-defined]
            "chat/completions", body, p.headers(False))  # type: ignore[attr-defined]
        return Reply(status, data, "application/json")

    server._Handler.handle = _bare  # type: ignore[method-assign]

if sys.argv[1].startswith("{"):
    up = parse_upstream(json.loads(sys.argv[1]))
else:
    os.environ["CBX_BENCH_KEY"] = "sk-bench"
    up = parse_upstream({
        "provider": "openai", "base_url": f"http://127.0.0.1:{int(sys.argv[1])}/v1",
        "credential": {"env": "CBX_BENCH_KEY"}, "models": ["bench"],
        "prices": {"bench": {"input_per_mtok": 1, "output_per_mtok": 1}},
        # Every limit on, at its default, except the rate: the bench itself is a flood.
        "limits": {"rate_per_s": 1e6, "burst": 1_000_000, **({
            "body_bytes_per_s": int(os.environ["CBX_BENCH_BYTE_RATE"]),
            "body_bytes_burst": max(int(os.environ["CBX_BENCH_BYTE_RATE"]), 4 << 20)}
            if "CBX_BENCH_BYTE_RATE" in os.environ else {})}})
run_dir = Path(tempfile.mkdtemp(prefix="cbx-bench-gw-"))
with Gateway(run_dir, "bench", {"target": up}, {"analyst": "target"},
             RunBudget(BudgetPolicy(reservation_usd=0.01))) as gw, \
        gw.bound("analyst", stage="bench", uid=os.getuid()) as b, \
        gw.bound("analyst", stage="flooded", uid=os.getuid()) as flooded:
    print(json.dumps({"dir": str(b.directory), "token": gw.token_for("analyst"),
                      "flood_dir": str(flooded.directory), "run_dir": str(run_dir),
                      "pid": os.getpid()}), flush=True)
    sys.stdin.read()
