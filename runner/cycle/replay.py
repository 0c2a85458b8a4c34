"""Replaying a recorded run: every model call answered from its call log, byte-exact.

A replay changes only *how* model calls are answered: each upstream the cycle uses keeps
its name, model and limits and becomes a ``replay`` upstream reading
``RECORDING/gateway/calls.jsonl``. Freezing with this override binds the recording's
bytes into the plan, so a replayed run's receipt can be compared with the recorded one
(``cyclebox receipt compare``).
"""

from __future__ import annotations

from pathlib import Path

from runner.gateway.config import UpstreamPolicy


def replay_upstreams(cycle_path: Path, recording: Path) -> dict[str, UpstreamPolicy]:
    """The cycle's upstreams (role policy file's, then the cycle file's own), each answered
    from ``recording`` (a recorded run directory) instead of its provider."""
    from runner.cycle.config import load_cycle, roles_file
    from runner.isolation.policy import load_policies

    cycle, base = load_cycle(cycle_path)
    ups = {**load_policies(roles_file(cycle, base)).upstreams, **cycle.upstreams}
    return {name: UpstreamPolicy.model_validate(
                {**up.model_dump(mode="json"), "provider": "replay",
                 "replay_from": str(recording.resolve()), "script": None, "base_url": None,
                 "credential": None})
            for name, up in ups.items()}
