"""Where cyclebox finds its own files and keeps its build state."""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
"""The checkout (or installed tree) holding images/, policies/ and sandbox/."""


def state_dir() -> Path:
    """Build state (wheels, contexts, image lock): ``$CYCLEBOX_STATE_DIR`` or ``<root>/build``."""
    env = os.environ.get("CYCLEBOX_STATE_DIR")
    return Path(env).resolve() if env else PROJECT_ROOT / "build"


def images_dir() -> Path:
    return PROJECT_ROOT / "images"


def default_policies() -> Path:
    return PROJECT_ROOT / "policies" / "roles.yaml"


def default_upstreams() -> Path:
    """Offline scripted upstreams for ``cyclebox sandbox exec`` (a cycle names its own)."""
    return PROJECT_ROOT / "policies" / "upstreams.yaml"


def sandbox_src() -> Path:
    return PROJECT_ROOT / "sandbox"
