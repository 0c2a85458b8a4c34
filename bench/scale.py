"""Scale: the demo cycle grown to about 100 and 400 cases per side, on the local Docker
backend and on the ray backend (a local Ray cluster: a head without the cyclebox
resource and two worker nodes), at the same concurrency (the cycle's, 2).

The demo manifest has 14 scenarios; it is grown by trials (14 x trials case runs per
side, the comparison policy's trials set to match), which gives the same number of
analyst containers as a manifest of that many cases. Per size and backend: freeze time
(``cycle run --prepare-only``), the run's wall time and wall time per analyst case, the
controller's peak RSS (``wait4`` of the CLI process; on ray, Ray's own daemons are not
counted), the time to build the receipt (``timing.receipt`` of the run's JSON) and the
``receipt verify`` time; per size the ratio ray/local of the run's wall time (issue 15
target: <= 1.2); and ``growth``, how each figure grows from the smallest size to the largest.

Both backends share this machine's cores: on ray, the Ray daemons (GCS, raylets, object
stores, workers) compete with the role containers, which a real cluster would not do.

    python -m bench.scale --cases 100,400 --out scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from bench._report import report
from bench.cycle import scaled_example
from runner.paths import PROJECT_ROOT

DEMO_CASES = 14
CLI = [sys.executable, "-m", "runner.cli"]


def timed(*args: str) -> tuple[float, int, str]:
    """(seconds, peak RSS in MiB of this one process, stdout) of a CLI command."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, cwd=PROJECT_ROOT)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(args[:3])} failed ({proc.returncode}): {out[-2000:]}")
    return wall, usage.ru_maxrss // 1024, out


def one(cycle: Path, run: Path, backend: str, address: str | None) -> dict[str, Any]:
    freeze_s, _, _ = timed("cycle", "run", str(cycle), "--out", str(run), "--prepare-only")
    extra = ["--backend", "ray", "--ray-address", address] if backend == "ray" and address \
        else []
    wall, rss, out = timed("cycle", "run", "--plan", str(run / "plan.json"), "--json", *extra)
    verify_s, _, _ = timed("receipt", "verify", str(run))
    rows = [json.loads(x) for x in (run / "containers.jsonl").read_text().splitlines()]
    analyst = [r for r in rows if r["role"] == "analyst"]
    res = json.loads(out)
    got: dict[str, Any] = {
        "verdict": res["verdict"], "freeze_s": round(freeze_s, 2), "run_s": round(wall, 2),
        "per_case_s": round(wall / max(1, len(analyst)), 3), "controller_peak_rss_mib": rss,
        "receipt_s": res["timing"].get("receipt"),
        "verify_s": round(verify_s, 2), "analyst_containers": len(analyst),
        "receipt_files": len(json.loads((run / "receipt.json").read_text())["files"]),
        "stages_s": res["timing"]}
    if backend == "ray":
        got["runs_per_node"] = dict(Counter(r["labels"].get("io.cyclebox.node", "?")[:12]
                                            for r in rows))
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cases", default="100,400",
                    help="comma-separated case counts per side (rounded to 14 x trials)")
    ap.add_argument("--backends", default="local,ray")
    ap.add_argument("--cold", action="store_true",
                    help="the example without project.warm (as bench/cycle.py --cold)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    backends = a.backends.split(",")
    cluster = None
    address = None
    if "ray" in backends:
        from ray.cluster_utils import Cluster

        store = 100 * 1024 * 1024
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "object_store_memory": store, "include_dashboard": False})
        for _ in range(2):
            cluster.add_node(num_cpus=1, resources={"cyclebox": 2}, object_store_memory=store)
        cluster.wait_for_nodes()
        address = cluster.address
    work = Path(tempfile.mkdtemp(prefix="cbx-bench-scale-"))
    sizes = []
    try:
        for n in (int(x) for x in a.cases.split(",")):
            trials = max(1, round(n / DEMO_CASES))
            cycle = scaled_example(work / f"ex{n}", trials)
            # the demo's budget (200 calls) is sized for 14 cases: scale it with them
            cyc = yaml.safe_load(cycle.read_text())
            cyc["budget"].update(max_calls=10 * DEMO_CASES * trials + 100, limit_usd=100.0)
            if a.cold:
                cyc["project"].pop("warm", None)
            cycle.write_text(yaml.safe_dump(cyc))
            row: dict[str, Any] = {"cases_per_side": DEMO_CASES * trials, "trials": trials}
            for b in backends:
                row[b] = one(cycle, work / f"run-{n}-{b}", b, address)
                print(json.dumps({n: {b: row[b]}}), file=sys.stderr, flush=True)
            if "local" in row and "ray" in row:
                row["ratio_ray_local"] = round(row["ray"]["run_s"] / row["local"]["run_s"], 3)
            sizes.append(row)
    finally:
        if cluster is not None:
            cluster.shutdown()
    report({"machine_cpus": os.cpu_count(), "concurrency": 2, "sizes": sizes,
            "warm": not a.cold,
            "growth": growth(sizes, backends), "work": str(work)}, a.out)


def growth(sizes: list[dict[str, Any]], backends: list[str]) -> dict[str, Any]:
    """From the smallest to the largest size: the case ratio, and per backend the ratio
    of freeze, run, receipt-building and verify times and of the controller's peak RSS
    (1.0 per unit of case ratio would be linear growth)."""
    if len(sizes) < 2:
        return {}
    lo, hi = sizes[0], sizes[-1]
    out: dict[str, Any] = {"cases": f"{lo['cases_per_side']} -> {hi['cases_per_side']}",
                           "case_ratio": round(hi["cases_per_side"] / lo["cases_per_side"], 2)}
    for b in backends:
        out[b] = {k: round(hi[b][k] / lo[b][k], 2) if lo[b].get(k) else None
                  for k in ("freeze_s", "run_s", "receipt_s", "verify_s",
                            "controller_peak_rss_mib")}
    return out


if __name__ == "__main__":
    main()
