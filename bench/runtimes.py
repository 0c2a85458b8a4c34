"""Start cost of gVisor: ``python3 -c pass`` in a hardened analyst container under the
engine's default runtime (runc) and under runsc, interleaved, through cyclebox's
backend (create, start, wait, remove); medians, p90 and the runsc/runc ratio.

Needs the runsc runtime registered (``make gvisor``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench._report import report
from runner.isolation.docker.images import resolve_image
from runner.isolation.policy import load_policies
from runner.isolation.registry import get_sandbox
from runner.isolation.roles import role_spec
from runner.paths import default_policies

COMMAND = ["python3", "-c", "pass"]
RUNTIMES = {"runc": None, "runsc": "runsc"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    policy = load_policies(default_policies()).roles["analyst"]
    backend = get_sandbox("docker")
    specs = {name: role_spec(policy.model_copy(update={"runtime": rt}), role="analyst",
                             run_id="bench-runtimes", image=resolve_image("analyst"),
                             command=COMMAND) for name, rt in RUNTIMES.items()}
    for spec in specs.values():  # warm-up, not counted
        backend.run(spec)
    times: dict[str, list[float]] = {name: [] for name in specs}
    for _ in range(a.rounds):
        for name, spec in specs.items():
            t = time.perf_counter()
            rec = backend.run(spec)
            times[name].append(time.perf_counter() - t)
            if rec.stop_reason.value != "ok" or not rec.cleanup_confirmed:
                raise SystemExit(f"{name}: {rec.stop_reason.value} {rec.detail} "
                                 f"{rec.stderr_tail[-300:]}")
    med = {k: statistics.median(v) for k, v in times.items()}
    report({
        "bench": "runtimes", "rounds": a.rounds, "command": COMMAND,
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "p90_s": {k: round(sorted(v)[int(0.9 * (len(v) - 1))], 4) for k, v in times.items()},
        "ratio_runsc_over_runc": round(med["runsc"] / med["runc"], 2),
        "extra_s_per_container": round(med["runsc"] - med["runc"], 4),
        "includes": "create, attach, start, holder READY, hand-over (the holder starts the "
                    "command as its child: under runsc too it inherits the seccomp "
                    "filter), exit frame, inspect, remove, confirm removal",
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }, a.out)


if __name__ == "__main__":
    main()
