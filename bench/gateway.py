"""Latency the gateway adds and the request rate it sustains, against the same local upstream.

Three processes: a uvicorn upstream on 127.0.0.1, the cyclebox gateway (its own process,
forwarding to that upstream with the openai provider and recording every call), and this
client. Gateway and direct requests carry the same body; concurrency 1 and 8; one run.
Targets (issue 20, as ratios within one run, all gateway limits on, every call recorded):
concurrency 1 gateway p50 <= 1.3x direct p50; concurrency 8 gateway requests/s >= 0.9x
direct. The figures are ratios of two paths measured in the same run on a shared machine:
run it three times and take medians (the machine's load is reported as ``loadavg``).
``gateway_cpu_us_per_call``: CPU seconds the gateway process spent (``/proc/PID/stat``)
per call, which the load of other processes does not distort.

``--floor``: c1 p50 of four paths interleaved in one set of rounds: direct; a byte pipe
in the gateway's place (``bench/_pipe_proc.py``: the same unix socket to TCP hop on uvloop,
nothing parsed, checked or recorded); ``http_relay``, the gateway's own HTTP server (its
limits and token check) and upstream client with the handler a bare forward (no parse,
policy, usage, budget or record; ``CBX_BENCH_BARE_HANDLER``, a bench-only ablation); and
the whole gateway. What the hop, the HTTP layer and the gateway's own work each add, with
the CPU per call of the two gateway processes.

``sdk_client``: the same c1 comparison with the client an agent runs instead of
httpx2: the ``openai`` SDK's synchronous client (``chat.completions.create``, retries off),
to 127.0.0.1 directly and to the gateway socket. A figure beside the target, not the
target: the SDK's own per-call work is in both paths, so its ratio is the one an agent sees.

``--in-container``: also the in-container path (issue 20): an unmodified SDK
(``openai.OpenAI()``, no arguments) inside a real hardened analyst container, through the
loopback endpoint 127.0.0.1:40080 its holder relays to the gateway socket, beside the
same container calling the socket directly (``sandbox.gateway_client``); the figure is
the added p50 per call of loopback over socket. It needs Docker, the role images and a
holder with the relay; without them the field says why it was not run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx2

from bench._report import report

BODY = b'{"model":"bench","messages":[{"role":"user","content":"ping"}]}'
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def load(client: httpx2.AsyncClient, url: str, headers: dict[str, str], n: int,
               conc: int) -> tuple[list[float], float]:
    lat: list[float] = []
    sem = asyncio.Semaphore(conc)

    async def one() -> None:
        async with sem:
            t = time.perf_counter()
            r = await client.post(url, content=BODY, headers=headers)
            lat.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return lat, time.perf_counter() - t0


FLOOD = """
import sys, threading, httpx2
d, token = sys.argv[1], sys.argv[2]
body = b'{"model":"not-allowed","messages":[{"role":"user","content":"' + b"x" * (1 << 20) + b'"}]}'
def run():
    with httpx2.Client(transport=httpx2.HTTPTransport(uds=d + "/gateway.sock"), timeout=60) as c:
        while True:
            c.post("http://gw/v1/chat/completions", content=body,
                   headers={"Authorization": "Bearer " + token})
for _ in range(4):
    threading.Thread(target=run, daemon=True).start()
sys.stdin.read()
"""


async def victim(info: dict[str, str], n: int) -> dict[str, float]:
    """Concurrency-1 latency on one socket while another process floods a second socket
    with 1 MiB requests the gateway must parse and refuse (model not allowed)."""
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, info["flood_dir"], info["token"]],
                             stdin=subprocess.PIPE)
    try:
        await asyncio.sleep(1.0)
        gw = httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(
            uds=str(Path(info["dir"]) / "gateway.sock")), timeout=30)
        h = {"Authorization": f"Bearer {info['token']}", "Content-Type": "application/json"}
        lat, _ = await load(gw, "http://gw/v1/chat/completions", h, n, 1)
        await gw.aclose()
    finally:
        flood.kill()
        flood.wait()
    return {"p50_ms": round(1000 * statistics.median(lat), 3),
            "p99_ms": round(1000 * pct(lat, 0.99), 3)}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


Sides = dict[str, tuple[httpx2.AsyncClient, str, dict[str, str]]]
"""name -> (client, url, headers) of each path measured."""


async def warm_up(sides: Sides, conc: int) -> None:
    for c, url, h in sides.values():
        await load(c, url, h, 50, conc)


async def interleaved(sides: Sides, n: int,
                      conc: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """``n`` requests per side at ``conc``, in 4 rounds alternating the sides so that drift
    hits them all: latencies and wall time per side."""
    rows: dict[str, list[float]] = {name: [] for name in sides}
    walls: dict[str, float] = dict.fromkeys(sides, 0.0)
    for _ in range(4):
        for name, (c, url, h) in sides.items():
            lat, wall = await load(c, url, h, n // 4, conc)
            rows[name] += lat
            walls[name] += wall
    return rows, walls


async def measure(info: dict[str, str], port: int, n: int) -> dict[str, object]:
    """c1 and c8 rounds, gateway and direct interleaved; the gateway's CPU per call from
    /proc (clock ticks: use enough requests for the figure to be more than a few ticks)."""
    gw_headers = {"Authorization": f"Bearer {info['token']}", "Content-Type": "application/json"}
    direct_headers = {"Authorization": "Bearer sk-bench", "Content-Type": "application/json"}
    limits = httpx2.Limits(max_connections=16, max_keepalive_connections=16)
    gw = httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(
        uds=str(Path(info["dir"]) / "gateway.sock"), limits=limits), timeout=30)
    direct = httpx2.AsyncClient(limits=limits, timeout=30)
    gw_url = "http://gw/v1/chat/completions"
    direct_url = f"http://127.0.0.1:{port}/v1/chat/completions"
    out: dict[str, object] = {}
    for conc in (1, 8):
        sides = {"gateway": (gw, gw_url, gw_headers),
                 "direct": (direct, direct_url, direct_headers)}
        await warm_up(sides, conc)  # outside the CPU figure
        cpu0 = cpu_s(int(info["pid"]))  # the gateway idles (no CPU) in the direct rounds
        rows, walls = await interleaved(sides, n, conc)
        gw_cpu = cpu_s(int(info["pid"])) - cpu0
        res = {}
        for name, lat in rows.items():
            res[name] = {"p50_ms": round(1000 * statistics.median(lat), 3),
                         "p99_ms": round(1000 * pct(lat, 0.99), 3),
                         "requests_per_s": round(len(lat) / walls[name], 1)}
        res["added_p50_ms"] = round(res["gateway"]["p50_ms"] - res["direct"]["p50_ms"], 3)
        res["added_p99_ms"] = round(res["gateway"]["p99_ms"] - res["direct"]["p99_ms"], 3)
        # CPU the gateway process spent per call: what the machine's load does not distort
        # (the latency ratios above are wall-clock figures on a shared CPU).
        res["gateway_cpu_us_per_call"] = round(1e6 * gw_cpu / len(rows["gateway"]), 1)
        out[f"concurrency_{conc}"] = res
    await gw.aclose()
    await direct.aclose()
    return out


async def floor(info: dict[str, str], port: int, n: int) -> dict[str, object]:
    """c1 p50 of direct, a byte pipe (``_pipe_proc.py``), the gateway's HTTP layer alone
    (``_gateway_proc.py`` with ``CBX_BENCH_BARE_HANDLER``: its server, limits, token check
    and upstream client, the handler a bare forward) and the whole gateway, rounds
    interleaved: what the hop, the HTTP layer and the gateway's own work each add."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="cbx-bench-pipe-") as tmp:
        path = str(Path(tmp) / "pipe.sock")
        pipe = subprocess.Popen([sys.executable, str(HERE / "_pipe_proc.py"), str(port), path],
                                stdout=subprocess.PIPE, text=True)
        bare = subprocess.Popen([sys.executable, str(HERE / "_gateway_proc.py"), str(port)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "CBX_BENCH_BARE_HANDLER": "1"})
        try:
            assert pipe.stdout is not None and bare.stdout is not None
            pipe.stdout.readline()
            relay = json.loads(bare.stdout.readline())
            h = {"Authorization": "Bearer sk-bench", "Content-Type": "application/json"}
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            clients = [httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(uds=d),
                                          timeout=30)
                       for d in (path, str(Path(relay["dir"]) / "gateway.sock"),
                                 str(Path(info["dir"]) / "gateway.sock"))]
            direct = httpx2.AsyncClient(timeout=30)
            sides: Sides = {
                "direct": (direct, url, h), "pipe": (clients[0], url, h),
                "http_relay": (clients[1], url, {**h, "Authorization":
                                                 f"Bearer {relay['token']}"}),
                "gateway": (clients[2], url, {**h, "Authorization":
                                              f"Bearer {info['token']}"})}
            await warm_up(sides, 1)
            cpu0 = {k: cpu_s(int(d["pid"])) for k, d in (("http_relay", relay),
                                                           ("gateway", info))}
            rows, _walls = await interleaved(sides, n, 1)
            cpu = {k: round(1e6 * (cpu_s(int(d["pid"])) - cpu0[k]) / len(rows[k]), 1)
                   for k, d in (("http_relay", relay), ("gateway", info))}
            for c in (*clients, direct):
                await c.aclose()
        finally:
            pipe.kill()
            pipe.wait()
            if bare.stdin is not None:
                bare.stdin.close()
            bare.wait(timeout=30)
    p50 = {k: round(1000 * statistics.median(v), 3) for k, v in rows.items()}
    return {"p50_ms": p50, "cpu_us_per_call": cpu,
            "pipe_p50_ms": p50["pipe"], "direct_p50_ms": p50["direct"],
            "c1_p50_pipe_over_direct": round(p50["pipe"] / p50["direct"], 3),
            "c1_p50_http_relay_over_direct": round(p50["http_relay"] / p50["direct"], 3),
            "c1_p50_gateway_over_direct": round(p50["gateway"] / p50["direct"], 3),
            "c1_p50_gateway_over_http_relay": round(p50["gateway"] / p50["http_relay"], 3)}


IN_CONTAINER = """
import json, os, statistics, time
import openai
from sandbox.gateway_client import client
N = %d
def timed(c):
    lat = []
    for _ in range(N + 5):
        t = time.perf_counter()
        c.chat.completions.create(model="fixture-target",
                                  messages=[{"role": "user", "content": "ping"}])
        lat.append(time.perf_counter() - t)
    return sorted(lat[5:])
out = {}
out["socket"] = timed(client())
out["loopback"] = timed(openai.OpenAI())  # no arguments: OPENAI_BASE_URL / OPENAI_API_KEY
print(json.dumps({k: {"p50_ms": round(1000 * statistics.median(v), 3),
                      "p99_ms": round(1000 * v[min(len(v) - 1, int(0.99 * len(v)))], 3)}
                  for k, v in out.items()}))
"""


def sdk_client(info: dict[str, str], port: int, n: int) -> dict[str, object]:
    """c1 p50 of ``openai.OpenAI`` direct vs through the gateway socket, rounds
    interleaved (see the module docstring)."""
    import openai

    from sandbox.gateway_client import client

    sides = {"direct": openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-bench",
                                     max_retries=0),
             "gateway": client(gateway_dir=Path(info["dir"]))}
    msgs = [{"role": "user", "content": "ping"}]
    lat: dict[str, list[float]] = {name: [] for name in sides}
    for c in sides.values():  # warm-up, outside the figures
        for _ in range(50):
            c.chat.completions.create(model="bench", messages=msgs)  # type: ignore[arg-type]
    for _ in range(4):
        for name, c in sides.items():
            for _ in range(n // 4):
                t = time.perf_counter()
                c.chat.completions.create(model="bench", messages=msgs)  # type: ignore[arg-type]
                lat[name].append(time.perf_counter() - t)
    for c in sides.values():
        c.close()
    p50 = {k: round(1000 * statistics.median(v), 3) for k, v in lat.items()}
    return {"client": f"openai {openai.__version__} (sync)", "direct_p50_ms": p50["direct"],
            "gateway_p50_ms": p50["gateway"],
            "added_p50_ms": round(p50["gateway"] - p50["direct"], 3),
            "c1_p50_gateway_over_direct": round(p50["gateway"] / p50["direct"], 3)}


def relay_available() -> str | None:
    """None when the holder relays 127.0.0.1:40080 to the gateway socket, else why not."""
    holder = Path(__file__).resolve().parents[1] / "sandbox" / "holder.py"
    if "40080" not in holder.read_text():
        return "the loopback relay (127.0.0.1:40080 in sandbox/holder.py) has not landed"
    return None


def in_container(n: int) -> dict[str, object]:
    """Per-call p50 of the same unmodified SDK in a hardened analyst container: loopback
    endpoint vs the gateway socket (scripted upstream: both paths do the same gateway work)."""
    why = relay_available()
    if why is not None:
        return {"status": "not_run", "reason": why}
    import tempfile

    from bench.loopback import unthrottled_upstreams
    from runner.errors import PrerequisiteError
    from runner.gateway.server import Gateway
    from runner.isolation.docker.images import resolve_image
    from runner.isolation.launcher import launch
    from runner.isolation.policy import load_policies
    from runner.isolation.registry import get_sandbox
    from runner.isolation.sandbox import StopReason
    from runner.paths import default_policies

    try:
        image = resolve_image("analyst")
    except PrerequisiteError as exc:  # the other figures stand without this one
        return {"status": "not_run", "reason": str(exc)}
    policies = load_policies(default_policies())
    with tempfile.TemporaryDirectory(prefix="cbx-bench-ic-") as tmp, \
            Gateway(Path(tmp), "bench", unthrottled_upstreams(), {"analyst": "target"}) as gw:
        rec = launch(get_sandbox("docker"), policies.roles["analyst"], role="analyst",
                     run_id="bench", image=image,
                     command=["python", "-c", IN_CONTAINER % n], gateway=gw, stage="bench",
                     case="in-container", trial=0)
    if rec.stop_reason is not StopReason.OK:
        return {"status": "failed", "reason": str(rec.stop_reason),
                "stderr_tail": rec.stderr_tail[-2000:]}
    got = json.loads(rec.stdout_tail.strip().splitlines()[-1])
    return {"status": "ok", "calls_per_path": n, **got,
            "added_p50_ms": round(got["loopback"]["p50_ms"] - got["socket"]["p50_ms"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--in-container", action="store_true",
                    help="also measure the in-container loopback path (Docker, role images)")
    ap.add_argument("--container-calls", type=int, default=200)
    ap.add_argument("--floor", action="store_true",
                    help="also a byte pipe and the bare HTTP layer in the gateway's place, "
                         "interleaved (what the hop and the HTTP layer alone cost)")
    a = ap.parse_args()
    load_before = os.getloadavg()
    port = free_port()
    upstream = subprocess.Popen([sys.executable, str(HERE / "_upstream.py"), str(port)])
    gateway = None
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        gateway = subprocess.Popen([sys.executable, str(HERE / "_gateway_proc.py"), str(port)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert gateway.stdout is not None
        info = json.loads(gateway.stdout.readline())
        result = asyncio.run(measure(info, port, a.requests))
        flooded = asyncio.run(victim(info, 200))
        piped = asyncio.run(floor(info, port, a.requests)) if a.floor else None
        sdk = sdk_client(info, port, a.requests)
    finally:
        if gateway is not None and gateway.stdin is not None:
            gateway.stdin.close()
            gateway.wait(timeout=30)
        upstream.terminate()
        upstream.wait(timeout=10)
    # counted once the gateway exited: what it made durable, the SDK client's calls included
    calls = sum(1 for line in (Path(info["run_dir"]) / "gateway" / "calls.jsonl").open()
                if '"stage":"bench"' in line)
    c1, c8 = result["concurrency_1"], result["concurrency_8"]
    p50_ratio = round(c1["gateway"]["p50_ms"] / c1["direct"]["p50_ms"], 3)  # type: ignore[index]
    rps_ratio = round(c8["gateway"]["requests_per_s"]  # type: ignore[index]
                      / c8["direct"]["requests_per_s"], 3)  # type: ignore[index]
    summary = {
        "bench": "gateway", "requests_per_setting": a.requests, **result,
        "calls_recorded": calls,
        "victim_while_other_socket_flooded": {
            **flooded, "p50_over_unflooded_c1_p50": round(
                flooded["p50_ms"] / c1["gateway"]["p50_ms"], 3)},  # type: ignore[index]
        "ratios": {"c1_p50_gateway_over_direct": p50_ratio,
                   "c8_rps_gateway_over_direct": rps_ratio},
        "gateway_cpu_us_per_call": {"c1": c1["gateway_cpu_us_per_call"],  # type: ignore[index]
                                    "c8": c8["gateway_cpu_us_per_call"]},  # type: ignore[index]
        "targets": {"c1_p50_gateway_over_direct_max": 1.3, "c8_rps_gateway_over_direct_min": 0.9},
        "meets_targets": p50_ratio <= 1.3 and rps_ratio >= 0.9,
        "loadavg": {"before": [round(x, 2) for x in load_before],
                    "after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()},
        "note": "every gateway request is recorded (request and response blobs, then its "
                "index line, written to the kernel) in the loop step that answers it: a "
                "small call right after its reply is written, before the connection reads "
                "its next request, a large one before its reply; fsync when the "
                "socket closes: runner/gateway/calllog.py)",
    }
    summary["sdk_client"] = sdk
    if piped is not None:
        p50 = piped["p50_ms"]
        piped["c1_p50_gateway_over_pipe"] = round(
            p50["gateway"] / p50["pipe"], 3)  # type: ignore[index]
        summary["floor"] = piped
    if a.in_container:
        summary["in_container"] = in_container(a.container_calls)
    report(summary, a.out)


if __name__ == "__main__":
    main()
