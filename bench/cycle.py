"""Cycle overhead: the demo plan scaled to 2 trials (26 case x trial runs per side, 52
analyst containers, plus evaluator x2, worker and apply) on the scripted provider at
``--concurrency`` (default 2), against the same number of raw `docker run --rm`
invocations of the analyst image (same hardening flags, same concurrency) running the
agent's imports, `python -c 'import json, sqlite3, openai'` (the model call itself is what
the cycle adds on top, through the gateway). Both in one run; ``--rounds N`` alternates
cycle and raw N times and reports the median ratio (the machine may be shared).

Targets: issue 4, cycle / raw <= 1.3; issue 23, at concurrency 1 (where the next cases'
containers are prepared while one runs) <= 0.8 and at concurrency 2 <= 0.93.

The example warms ``openai`` (``project.warm``): each prepared container's interpreter
imports it while the case before runs. ``--cold`` runs the example without it (the
agent imports ``openai`` when its case starts), for a side-by-side figure.

``cpu_per_container``: each side's host CPU seconds per container, polled from ``/proc``
(:class:`bench._hostcpu.HostCpu`): ``attributed`` (every busy CPU second of the host but
this bench's poller and unrelated processes) and split by kind: ``container`` (what runs
inside: the holder and the agent, or raw's ``python -c``), ``engine`` (dockerd,
containerd, shims), ``controller`` (cyclebox's own process and its children; on the raw
side the ``docker`` CLIs) and ``kernel``. A process that lives less than a poll (50 ms)
is missed from its kind but stays in ``attributed``. When a side is CPU-bound (two cores
at concurrency 2), its wall time follows this figure: the ratio cannot go below the two
sides' CPU ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from bench._hostcpu import HostCpu
from bench._report import report
from bench.overhead import NO_HOLDER, docker_cli_args
from runner.isolation.docker.hardening import create_kwargs
from runner.isolation.docker.images import resolve_image
from runner.isolation.policy import load_policies
from runner.isolation.registry import get_sandbox
from runner.isolation.roles import role_spec
from runner.paths import PROJECT_ROOT, default_policies

EXAMPLE = PROJECT_ROOT / "examples" / "shop-analyst"
RAW_COMMAND = ["python", "-c", "import json, sqlite3, openai"]


def scaled_example(dest: Path, trials: int) -> Path:
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("project"))
    cyc = yaml.safe_load((EXAMPLE / "cycle.yaml").read_text())
    cyc["project"]["repo"] = str(PROJECT_ROOT)
    cyc["roles"] = str(default_policies())
    cyc["upstreams"]["judge"]["script"] = str(PROJECT_ROOT / "policies/scripts/default.yaml")
    cyc["trials"] = trials
    cyc["name"] = "bench-cycle"
    (dest / "cycle.yaml").write_text(yaml.safe_dump(cyc))
    pol = yaml.safe_load((EXAMPLE / "policy.yaml").read_text())
    pol["trials"] = trials
    (dest / "policy.yaml").write_text(yaml.safe_dump(pol))
    return dest / "cycle.yaml"


TARGETS = {1: 0.8, 2: 0.93}
POLL_S = 0.05


@contextmanager
def host_cpu(controller_pid: Callable[[], int | None]) -> Iterator[dict[str, Any]]:
    """Poll the host's CPU by kind while the block runs; fills the yielded dict at exit
    with CPU seconds (totals: the caller divides by its containers)."""
    out: dict[str, Any] = {}
    stop = threading.Event()
    box: list[HostCpu] = []

    def poller() -> None:
        while (pid := controller_pid()) is None and not stop.is_set():
            time.sleep(0.001)
        host = HostCpu(pid)
        box.append(host)
        while not stop.is_set():
            host.poll(True)
            stop.wait(POLL_S)
        host.poll(True)

    t = threading.Thread(target=poller, daemon=True)
    t.start()
    try:
        yield out
    finally:
        stop.set()
        t.join()
        if box:
            h = box[0]
            out["attributed"] = h.attributed_s()
            out.update({k: v for k, v in h.by_kind.items() if k not in ("bench", "other")})


def per_container(cpu: dict[str, Any], n: int) -> dict[str, float]:
    return {k: round(v / n, 3) for k, v in sorted(cpu.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cold", action="store_true",
                    help="the example without project.warm: the agent imports openai when "
                    "its case starts (the default warms it while the container waits)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rounds = [one_round(a.trials, a.concurrency, i, warm=not a.cold)
              for i in range(a.rounds)]
    ratios = sorted(r["ratio_cycle_over_raw"] for r in rounds)
    target = TARGETS.get(a.concurrency, 1.3)
    result = {**rounds[-1], "rounds": len(rounds), "ratios": ratios,
              "ratio_median": ratios[len(ratios) // 2], "target_ratio": target,
              "loadavg": [round(x, 2) for x in os.getloadavg()]}
    result["meets_target"] = result["ratio_median"] <= target
    report(result, a.out)


def one_round(trials: int, concurrency: int, i: int, *, warm: bool = True) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="cbx-bench-cycle-"))
    cycle = scaled_example(work / "example", trials)
    cyc = yaml.safe_load(cycle.read_text())
    cyc["concurrency"] = concurrency
    if not warm:
        cyc["project"].pop("warm", None)
    cyc["name"] = f"bench-cycle-{i}"
    cycle.write_text(yaml.safe_dump(cyc))
    cli = str(PROJECT_ROOT / ".venv" / "bin" / "cyclebox")
    proc: list[subprocess.Popen[str]] = []
    with host_cpu(lambda: proc[0].pid if proc else None) as cycle_cpu:
        t0 = time.perf_counter()
        p = subprocess.Popen([cli, "cycle", "run", str(cycle), "--out", str(work / "run"),
                              "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        proc.append(p)
        stdout, stderr = p.communicate()
        cycle_wall = time.perf_counter() - t0
    res = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    if res.returncode != 0:
        raise SystemExit(f"cycle failed ({res.returncode}): {res.stdout} {res.stderr}")
    out = json.loads(res.stdout)
    containers = [json.loads(x) for x in (work / "run/containers.jsonl").read_text().splitlines()]
    analyst_runs = sum(c["role"] == "analyst" for c in containers)

    policy = load_policies(default_policies()).roles["analyst"]
    backend: Any = get_sandbox("docker")
    spec = role_spec(policy, role="analyst", run_id="bench-raw", image=resolve_image("analyst"),
                     command=RAW_COMMAND)
    raw_args = docker_cli_args(create_kwargs(spec, backend.owner, "raw",
                                                holder_dir=NO_HOLDER))[:-1]
    raw_args = [*raw_args[: raw_args.index(str(spec.image)) + 1], *RAW_COMMAND]

    def raw_one(_: int) -> None:
        subprocess.run(raw_args, check=True, capture_output=True)

    with host_cpu(os.getpid) as raw_cpu:  # the docker CLIs count as raw's controller
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            list(pool.map(raw_one, range(len(containers))))
        raw_wall = time.perf_counter() - t0
    result = {
        "bench": "cycle", "trials": trials, "verdict": out["verdict"],
        "containers": len(containers), "analyst_case_trial_runs": analyst_runs,
        "concurrency": concurrency, "warm": list(cyc["project"].get("warm", [])),
        "cycle_wall_s": round(cycle_wall, 2),
        "raw_docker_wall_s": round(raw_wall, 2),
        "ratio_cycle_over_raw": round(cycle_wall / raw_wall, 3),
        "per_stage_s": {k: v for k, v in out["timing"].items() if "prepared_wait_s." not in k
                        or not k.split("prepared_wait_s.")[1].count("__t")},
        "raw_command": RAW_COMMAND,
        "cpu_per_container": {"cycle": per_container(cycle_cpu, len(containers)),
                              "raw": per_container(raw_cpu, len(containers))},
    }
    print(json.dumps(result), file=sys.stderr, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
