"""Image figures: cold build time per role image (no layer cache), unchanged rebuild time
for all images, final sizes.

Targets (issue 2): unchanged rebuild of all images < 5 s; role images <= 500 MB;
trainer <= 1.6 GB. The base image bootstrap (debootstrap + import) is timed separately
only when it is missing (pass --cold-base to force a fresh bootstrap tag check).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench._report import report
from runner.isolation.docker.images import build_roles
from runner.isolation.policy import ROLES

TARGET_ROLE_BYTES = 500 * 1000**2
TARGET_TRAINER_BYTES = 1600 * 1000**2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--skip-cold", action="store_true", help="only measure rebuild and sizes")
    a = ap.parse_args()

    def quiet(_line: str) -> None:
        pass

    cold: dict[str, float] = {}
    if not a.skip_cold:
        for role in ROLES:
            t = time.perf_counter()
            build_roles([role], quiet, force=True, nocache=True)
            cold[role] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    rows = build_roles(list(ROLES), quiet)
    rebuild = round(time.perf_counter() - t, 2)
    sizes = {r.role: r.size_bytes for r in rows}
    result = {
        "bench": "images",
        "cold_build_s": cold,
        "unchanged_rebuild_all_s": rebuild,
        "unchanged_rebuild_built_anything": any(r.built for r in rows),
        "size_mb": {k: round(v / 1000**2) for k, v in sizes.items()},
        "targets": {"unchanged_rebuild_all_s": 5, "role_mb": 500, "trainer_mb": 1600},
    }
    result["meets_targets"] = (
        rebuild < 5 and not result["unchanged_rebuild_built_anything"]
        and all(v <= TARGET_ROLE_BYTES for k, v in sizes.items() if k != "trainer")
        and sizes["trainer"] <= TARGET_TRAINER_BYTES)
    report(result, a.out)


if __name__ == "__main__":
    main()
