"""What the in-container loopback endpoint costs per call.

One hardened analyst container, bound to a gateway with the offline scripted upstream.
Inside it, the same openai SDK makes the same chat completion N times through each path,
alternating in rounds of 10 so drift hits both alike: ``loopback`` is ``openai.OpenAI()``
with no argument (the environment points it at the holder's relay on 127.0.0.1:40080),
``socket`` is :func:`sandbox.gateway_client.client` (httpx straight on the unix socket).
Each call is timed inside the container; p50 and p90 per path and the added p50. The
binding's request-rate limit is raised for the run (a tight loop passes 50/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench._report import report
from runner.gateway.calllog import CallLog
from runner.gateway.config import load_upstreams
from runner.gateway.server import Gateway
from runner.isolation.docker.images import resolve_image
from runner.isolation.launcher import launch
from runner.isolation.policy import load_policies
from runner.isolation.registry import get_sandbox
from runner.paths import default_policies, default_upstreams

INSIDE = """
import json, sys, time, openai
from sandbox.gateway_client import client
n = int(sys.argv[1])
paths = {"loopback": openai.OpenAI(max_retries=0), "socket": client()}
msgs = [{"role": "user", "content": "ping"}]
lat = {k: [] for k in paths}
for k, c in paths.items():  # warm-up: connections open, imports done
    c.chat.completions.create(model="fixture-target", messages=msgs)
for r in range(0, n, 10):
    for k, c in paths.items():
        for _ in range(min(10, n - r)):
            t = time.perf_counter()
            assert c.chat.completions.create(model="fixture-target",
                                             messages=msgs).choices[0].message.content
            lat[k].append(time.perf_counter() - t)
print(json.dumps(lat))
"""


def unthrottled_upstreams() -> dict[str, Any]:
    """The offline upstreams with the target binding's request rate lifted: the default
    (50/s, burst 100) would refuse a tight loop of calls with 429."""
    ups: dict[str, Any] = dict(load_upstreams(default_upstreams()))
    target = ups["target"]
    ups["target"] = target.model_copy(update={"limits": target.limits.model_copy(
        update={"rate_per_s": 10_000.0, "burst": 10_000})})
    return ups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    policy = load_policies(default_policies()).roles["analyst"]
    policy = policy.model_copy(update={"timeout_s": 600.0})
    backend: Any = get_sandbox("docker")
    ups = unthrottled_upstreams()
    with tempfile.TemporaryDirectory() as tmp, \
            Gateway(Path(tmp), "bench", ups, {"analyst": "target"}) as gw:
        rec = launch(backend, policy, role="analyst", run_id="bench",
                     image=resolve_image("analyst"),
                     command=["python", "-c", INSIDE, str(a.calls)], gateway=gw,
                     stage="bench", case="c", trial=0)
        assert rec.stop_reason.value == "ok", rec.stderr_tail
        recorded = len(CallLog(Path(tmp) / "gateway").records())
    lat: dict[str, list[float]] = json.loads(rec.stdout_tail)

    def pct(v: list[float], q: float) -> float:
        return sorted(v)[int(q * (len(v) - 1))]

    p50 = {k: statistics.median(v) for k, v in lat.items()}
    result = {
        "bench": "loopback", "calls_per_path": a.calls, "recorded_calls": recorded,
        "p50_ms": {k: round(v * 1e3, 3) for k, v in p50.items()},
        "p90_ms": {k: round(pct(v, 0.9) * 1e3, 3) for k, v in lat.items()},
        "added_p50_ms": round((p50["loopback"] - p50["socket"]) * 1e3, 3),
        "ratio_p50_loopback_over_socket": round(p50["loopback"] / p50["socket"], 3),
        "paths": {"loopback": "openai.OpenAI() (environment) -> 127.0.0.1:40080 -> holder "
                              "relay -> gateway socket",
                  "socket": "sandbox.gateway_client.client() -> gateway socket"},
    }
    report(result, a.out)


if __name__ == "__main__":
    main()
