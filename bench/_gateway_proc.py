"""Runs a cyclebox Gateway in its own process for bench/gateway.py.

Prints {"dir": ..., "token": ...} once the socket is up; exits when stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from runner.gateway.budget import BudgetPolicy, RunBudget
from runner.gateway.config import UpstreamPolicy
from runner.gateway.server import Gateway

port = int(sys.argv[1])
os.environ["CBX_BENCH_KEY"] = "sk-bench"
up = UpstreamPolicy.model_validate({
    "provider": "openai", "base_url": f"http://127.0.0.1:{port}/v1",
    "credential": {"env": "CBX_BENCH_KEY"}, "models": ["bench"],
    "prices": {"bench": {"input_per_mtok": 1, "output_per_mtok": 1}}})
run_dir = Path(tempfile.mkdtemp(prefix="cbx-bench-gw-"))
with Gateway(run_dir, "bench", {"target": up}, {"analyst": "target"},
             RunBudget(BudgetPolicy(reservation_usd=0.01))) as gw, \
        gw.bound("analyst", stage="bench", uid=os.getuid()) as b:
    print(json.dumps({"dir": str(b.directory), "token": gw.token_for("analyst"),
                      "run_dir": str(run_dir)}), flush=True)
    sys.stdin.read()
