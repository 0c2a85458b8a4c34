"""What the command line picks for everything else: the isolation backend and the role
images it runs.

The CLI is where a backend is chosen (``runner.isolation.registry``) and where image ids
are read from the image lock; the cycle and training receive a ``Sandbox`` and image ids
and never import the Docker backend.
"""

from __future__ import annotations

from runner.errors import PrerequisiteError
from runner.isolation.sandbox import Sandbox


def sandbox() -> Sandbox:
    """The isolation backend commands run their containers in."""
    from runner.isolation.registry import get_sandbox

    return get_sandbox()


def role_image(role: str) -> str:
    """Image id of ``role`` from the image lock (PrerequisiteError naming the fix if absent)."""
    from runner.isolation.docker.images import resolve_image

    return resolve_image(role)


def cycle_images(*, check_engine: bool = False) -> dict[str, str]:
    """Image id per cycle role from the image lock; with ``check_engine``, each must also
    exist in the backend (PrerequisiteError naming the fix)."""
    from runner.cycle.plan import CYCLE_ROLES

    ids = {r: role_image(r) for r in CYCLE_ROLES}
    if check_engine:
        backend = sandbox()
        gone = [r for r, i in ids.items() if backend.image_id(i) is None]
        if gone:
            raise PrerequisiteError(f"images for {gone} are in the lock file but not in the "
                                    "engine. Fix: cyclebox images build")
    return ids
