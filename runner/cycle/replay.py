"""Replaying a recorded run: every model call answered from its call log, byte-exact.

A replay changes only *how* model calls are answered: each upstream the cycle uses keeps
its name, model and limits and becomes a ``replay`` upstream reading
``RECORDING/gateway/calls.jsonl``. Freezing with this override binds the recording's
bytes into the plan, so a replayed run's receipt can be compared with the recorded one
(``cyclebox receipt compare``).
"""

from __future__ import annotations

from pathlib import Path

from runner.gateway.config import PROVIDER_FIELDS, UpstreamPolicy, parse_upstream


def replay_upstreams(cycle_path: Path, recording: Path) -> dict[str, UpstreamPolicy]:
    """The cycle file's upstreams, each answered from ``recording`` (a recorded run
    directory) instead of its provider. A recording with a receipt must verify against it
    (IntegrityError ``run_altered``, exit 8)."""
    from runner.cycle.config import load_cycle
    from runner.cycle.receipt import RECEIPT, require_unaltered

    cycle, _ = load_cycle(cycle_path)
    if (recording / RECEIPT).exists() or (recording / RECEIPT).is_symlink():
        # answers from a run changed since its receipt would be replayed as if recorded
        require_unaltered(recording, what="a replay answers only from a run that verifies")
    ups = cycle.upstreams
    # Every provider's own field goes (base_url, credential, anthropic_version, script):
    # a replayed upstream keeps only what all providers share.
    return {name: parse_upstream({**up.model_dump(mode="json"),
                                  **dict.fromkeys(PROVIDER_FIELDS), "provider": "replay",
                                  "replay_from": str(recording.resolve())})
            for name, up in ups.items()}
