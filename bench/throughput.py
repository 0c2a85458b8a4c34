"""Throughput with a slow model: how many analyst cases per second a cycle runs when every
model call takes LATENCY seconds (a real model's), at concurrency 1, 2, 4, 8, 16, 32 and
``auto``.

The demo cycle, grown by trials to about CASES cases per side, with its target upstream
replaced by ``provider: openai`` pointing at a tiny asyncio server on loopback that answers
every chat completion after LATENCY seconds (a refusal with usage, so costs are known).
Per setting: the analyst stages' wall time (``timing.baseline`` + ``timing.candidate``)
and cases/s over both (the cycle's other stages are in ``run_s`` only); CPU seconds
per case, four ways (:mod:`bench._hostcpu` defines them): ``cgroups`` (the controller's
own CPU from ``wait4`` plus the analyst containers' cgroup CPU, polled while they live),
``with_engine`` (plus dockerd, containerd and the shims, from ``/proc``), ``attributed``
(every busy CPU second of the host while analyst containers existed, minus this bench
process and the user processes that are not the run's: kernel work and short-lived
``runc`` calls included) and ``host`` (minus this bench process only), each divided by
the analyst containers, with the processes that used the most CPU; the peak memory of
the controller (RSS, ``wait4``) plus the containers (sum of their cgroups' memory usage,
polled); the host's busy CPU share over the run and the load average. Then the CPU bound
(cores / CPU s per case, the median over settings) by each definition, the best fixed
setting against it (target >= 0.8; the headline uses ``attributed``, every CPU second
a case costs this host), and ``auto`` against the best fixed one (target >= 0.9, without
exhausting memory).

Settings run one after another, each a cycle of its own; ``--settings 8`` runs one (so
a caller can hold an exclusive bench lock per setting, not for the whole run) and
``--merge a.json b.json`` builds the summary from such single-setting reports.

The machine may be shared: the figures say what else ran (load average, host busy share).
No figure is asserted.

    python -m bench.throughput --cases 40                 # a quick check
    python -m bench.throughput --out throughput.json      # 200 cases, every setting
    for s in 1 2 4 8 16 32 auto; do                       # one exclusive hold per setting
      flock -x bench.lock python -m bench.throughput --settings $s --out tp-$s.json; done
    python -m bench.throughput --merge tp-*.json --out throughput.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from bench._hostcpu import HostCpu
from bench._report import report
from bench.cycle import scaled_example
from runner.cycle.concurrency import HostProbe, cores
from runner.paths import PROJECT_ROOT

DEMO_CASES = 14
CLI = [sys.executable, "-m", "runner.cli"]
REPLY = json.dumps({"action": "refuse", "reason": "throughput bench"})
POLL_S = 0.2
CGROUP = Path("/sys/fs/cgroup")


# -- the slow upstream -------------------------------------------------------------------
def _body() -> bytes:
    return json.dumps({
        "id": "chatcmpl-throughput", "object": "chat.completion", "created": 1,
        "model": "fixture-target",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": REPLY}}],
        "usage": {"prompt_tokens": 200, "completion_tokens": 20, "total_tokens": 220}}).encode()


class SlowUpstream:
    """An OpenAI-compatible chat endpoint on 127.0.0.1 answering after ``latency`` s."""

    def __init__(self, latency: float) -> None:
        self.latency = latency
        self.calls = 0
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                self.calls += 1
                await asyncio.sleep(self.latency)
                body = _body()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


# -- the containers' cgroups -------------------------------------------------------------
def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def container_usage(cid: str) -> tuple[int | None, float | None]:
    """(memory bytes, CPU seconds) of one container's cgroup (v1 or v2)."""
    v1_mem = CGROUP / "memory" / "docker" / cid / "memory.usage_in_bytes"
    if v1_mem.exists():
        cpu = _read_int(CGROUP / "cpuacct" / "docker" / cid / "cpuacct.usage")
        return _read_int(v1_mem), None if cpu is None else cpu / 1e9
    scope = CGROUP / "system.slice" / f"docker-{cid}.scope"
    mem = _read_int(scope / "memory.current")
    try:
        usec = next(int(x.split()[1]) for x in (scope / "cpu.stat").read_text().splitlines()
                    if x.startswith("usage_usec"))
    except (OSError, StopIteration, ValueError):
        return mem, None
    return mem, usec / 1e6


def container_ids() -> list[str]:
    """Ids of the containers that have a cgroup now (v1 or v2), read from the cgroup fs:
    no engine round trip per poll (the poller must not add to the engine's CPU)."""
    v1 = CGROUP / "memory" / "docker"
    if v1.is_dir():
        return [d.name for d in v1.iterdir() if len(d.name) == 64 and d.is_dir()]
    v2 = CGROUP / "system.slice"
    return [d.name[len("docker-"):-len(".scope")] for d in v2.glob("docker-*.scope")]


class Poller:
    """Polls the run's analyst containers: peak summed memory, last CPU seen per one, and
    the host's CPU (:class:`bench._hostcpu.HostCpu`) while any of them exists. Each new
    container is asked of the engine once (are its labels this run's analyst?)."""

    def __init__(self, run_id: str, controller_pid: int | None = None) -> None:
        import docker

        self.client = docker.from_env()
        self.run_id = run_id
        self.peak_bytes = 0
        self.peak_running = 0
        self.cpu: dict[str, float] = {}
        self.ours: dict[str, bool] = {}
        self.host = HostCpu(controller_pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _is_ours(self, cid: str) -> bool:
        if cid not in self.ours:
            try:
                labels = self.client.api.inspect_container(cid)["Config"]["Labels"] or {}
            except Exception:  # gone already (or the engine is busy): not counted
                return False
            self.ours[cid] = (labels.get("io.cyclebox.run_id") == self.run_id
                              and labels.get("io.cyclebox.role") == "analyst")
        return self.ours[cid]

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            found = [cid for cid in container_ids() if self._is_ours(cid)]
            self.host.poll(bool(found))
            total = 0
            for cid in found:
                mem, cpu = container_usage(cid)
                total += mem or 0
                if cpu is not None:
                    self.cpu[cid] = max(cpu, self.cpu.get(cid, 0.0))
            self.peak_bytes = max(self.peak_bytes, total)
            self.peak_running = max(self.peak_running, len(found))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


# -- one setting ---------------------------------------------------------------------------
def cycle_for(work: Path, cases: int, port: int, setting: str, n: int) -> Path:
    trials = max(1, round(cases / DEMO_CASES))
    cycle = scaled_example(work / f"ex-{n}-{setting}", trials)
    doc = yaml.safe_load(cycle.read_text())
    doc["name"] = f"bench-throughput-{n}-{setting}"
    doc["concurrency"] = setting if setting == "auto" else int(setting)
    doc["upstreams"]["target"] = {
        "provider": "openai", "base_url": f"http://127.0.0.1:{port}/v1",
        "credential": {"env": "CYCLEBOX_BENCH_KEY"}, "models": ["fixture-target"],
        "max_tokens": 1024,
        "prices": {"fixture-target": {"input_per_mtok": 0.15, "output_per_mtok": 0.6}}}
    doc["budget"].update(max_calls=10 * DEMO_CASES * trials + 100, limit_usd=100.0)
    cycle.write_text(yaml.safe_dump(doc))
    return cycle


def one(work: Path, cases: int, up: SlowUpstream, setting: str, n: int) -> dict[str, Any]:
    import subprocess

    cycle = cycle_for(work, cases, up.port, setting, n)
    run = work / f"run-{n}-{setting}"
    env = dict(os.environ, CYCLEBOX_BENCH_KEY="not-a-real-key")
    frozen = subprocess.run([*CLI, "cycle", "run", str(cycle), "--out", str(run),
                             "--prepare-only"], check=False, capture_output=True,
                            text=True, cwd=PROJECT_ROOT, env=env)
    if frozen.returncode != 0:
        raise SystemExit(f"freezing the cycle at {setting} failed (exit "
                         f"{frozen.returncode}): {frozen.stderr[-2000:]}")
    doc = json.loads((run / "plan.json").read_text())
    rid = f"{doc['plan']['name']}-{doc['plan_hash'][:10]}"
    probe = HostProbe()
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen([*CLI, "cycle", "run", "--plan", str(run / "plan.json"), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=PROJECT_ROOT, env=env)
    poller = Poller(rid, proc.pid)  # no analyst container exists before the plan loads
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    host = probe.sample()
    poller.stop()
    try:
        res = json.loads(out)
    except json.JSONDecodeError:
        raise SystemExit(f"cycle at {setting} printed no JSON (exit "
                         f"{os.waitstatus_to_exitcode(status)}): {out[-2000:]}") from None
    timing = res["timing"]
    rows = [json.loads(x) for x in (run / "containers.jsonl").read_text().splitlines()]
    analyst = [r for r in rows if r["role"] == "analyst"]
    # both analyst stages (baseline, candidate) are this bench's cases; the rest of the
    # cycle (evaluate, propose, apply) is in run_s only
    stage_s = sum(timing.get(k, 0.0) for k in ("baseline", "candidate"))
    container_cpu = sum(poller.cpu.values())
    controller_cpu = usage.ru_utime + usage.ru_stime
    n_cases = max(1, len(analyst))
    cpu_per_case = (container_cpu + controller_cpu) / n_cases
    hc = poller.host
    with_engine = cpu_per_case + hc.engine_s() / n_cases
    waits = [v for k, v in timing.items() if k.startswith("baseline.prepared_wait_s.")
             and "__t" in k]
    got: dict[str, Any] = {
        "setting": setting, "verdict": res["verdict"],
        "analyst_containers": len(analyst), "model_calls": up.calls,
        "analyst_stages_s": round(stage_s, 2), "run_s": round(wall, 2),
        "cases_per_s": round(len(analyst) / stage_s, 3) if stage_s else None,
        "cpu_s_per_case": {"cgroups": round(cpu_per_case, 3),
                           "with_engine": round(with_engine, 3),
                           "attributed": round(hc.attributed_s() / n_cases, 3),
                           "host": round(hc.host_s() / n_cases, 3)},
        "while_analysts": {"host_busy_s": round(hc.busy_s, 2),
                           "bench_self_s": round(hc.self_s, 2),
                           "by_kind_s": {k: round(v, 2) for k, v in sorted(hc.by_kind.items())},
                           "by_process_s": hc.top()},
        "controller_cpu_s": round(controller_cpu, 2),
        "containers_cpu_s_polled": round(container_cpu, 2),
        "controller_peak_rss_mib": usage.ru_maxrss // 1024,
        "containers_peak_mib": poller.peak_bytes // (1024 * 1024),
        "peak_mib": usage.ru_maxrss // 1024 + poller.peak_bytes // (1024 * 1024),
        "containers_peak_running": poller.peak_running,
        "host_busy_share": round(host.cpu_busy, 3),
        "host_min_available_mib": host.mem_available // (1024 * 1024),
        "loadavg_before": round(load0, 2), "loadavg_after": round(os.getloadavg()[0], 2),
        "prepared_wait_median_s": statistics.median(waits) if waits else None,
        "concurrency": {k.removeprefix("baseline.concurrency").lstrip(".") or "start": v
                        for k, v in timing.items() if k.startswith("baseline.concurrency")},
        "lookahead_max": timing.get("baseline.lookahead_max")}
    up.calls = 0
    shutil.rmtree(run, ignore_errors=True)
    return got


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    fixed = [r for r in rows if r["setting"] != "auto" and r["cases_per_s"]]
    auto = next((r for r in rows if r["setting"] == "auto"), None)
    out: dict[str, Any] = {"cores": cores()}
    if not fixed:
        return out
    best = max(fixed, key=lambda r: r["cases_per_s"])
    out.update(best_fixed=best["setting"], best_fixed_cases_per_s=best["cases_per_s"],
               target_best_over_cpu_bound=0.8, headline_definition="attributed")
    for name in ("cgroups", "with_engine", "attributed", "host"):
        known = [r["cpu_s_per_case"][name] for r in fixed if name in r["cpu_s_per_case"]]
        if not known:
            continue  # a report from before this definition (--merge)
        cpu = statistics.median(known)
        bound = cores() / cpu if cpu else None
        own = best["cpu_s_per_case"].get(name)
        out[name] = {"cpu_s_per_case_median": round(cpu, 3),
                     "cpu_bound_cases_per_s": round(bound, 3) if bound else None,
                     "best_over_cpu_bound": round(best["cases_per_s"] / bound, 3)
                     if bound else None,
                     # against the bound at the best setting's own CPU per case (which
                     # grows with the concurrency): the share of the cores it kept busy
                     "best_over_own_cpu_bound": round(best["cases_per_s"] * own / cores(), 3)
                     if own else None}
    if auto and auto["cases_per_s"]:
        out.update(auto_cases_per_s=auto["cases_per_s"],
                   auto_over_best_fixed=round(auto["cases_per_s"] / best["cases_per_s"], 3),
                   auto_peak_mib=auto["peak_mib"], target_auto_over_best=0.9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=200,
                    help="cases per side (rounded to 14 x trials); default 200")
    ap.add_argument("--settings", default="1,2,4,8,16,32,auto")
    ap.add_argument("--latency", type=float, default=2.0, help="seconds per model call")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                    help="no run: the summary over these reports' settings")
    a = ap.parse_args()
    if a.merge:
        docs = [json.loads(p.read_text()) for p in a.merge]
        merged = [r for d in docs for r in d["settings"]]
        report({"bench": "throughput", "cases": docs[0]["cases"],
                "latency_s": docs[0]["latency_s"], "machine_cpus": os.cpu_count(),
                "merged_from": [str(p) for p in a.merge], "settings": merged,
                "summary": summary(merged),
                "note": "shared machine: see loadavg and host_busy_share per setting"}, a.out)
        return
    up = SlowUpstream(a.latency)
    work = Path(tempfile.mkdtemp(prefix="cbx-bench-throughput-"))
    rows = []
    try:
        for n, setting in enumerate(a.settings.split(",")):  # a setting may repeat
            rows.append(one(work, a.cases, up, setting, n))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report({"bench": "throughput", "cases": a.cases, "latency_s": a.latency,
            "machine_cpus": os.cpu_count(), "settings": rows, "summary": summary(rows),
            "note": "shared machine: see loadavg and host_busy_share per setting"}, a.out)


if __name__ == "__main__":
    main()
