"""The role images a cycle freezes: ids from the image lock, optionally checked in the engine."""

from __future__ import annotations

from runner.errors import PrerequisiteError
from runner.isolation.sandbox import Sandbox


def cycle_images(*, sandbox: Sandbox | None = None) -> dict[str, str]:
    """Image id per cycle role from the lock file (PrerequisiteError naming the fix when a
    role has none); with ``sandbox``, each id must also exist in that backend."""
    from runner.cycle.plan import CYCLE_ROLES
    from runner.isolation.docker.images import resolve_image

    ids = {r: resolve_image(r) for r in CYCLE_ROLES}
    if sandbox is not None:
        gone = [r for r, i in ids.items() if sandbox.image_id(i) is None]
        if gone:
            raise PrerequisiteError(f"images for {gone} are in the lock file but not in the "
                                    "engine. Fix: cyclebox images build")
    return ids
