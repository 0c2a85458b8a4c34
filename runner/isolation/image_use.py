"""Which images a live cyclebox process uses, for ``cyclebox images gc``.

A process that will start containers from an image (freeze deriving the analyst image,
a run executing its plan) holds a shared ``flock`` on ``<state>/image-use/<id>.lock``
for the rest of its life; the kernel drops it when the process ends, however it ends.
``images gc`` removes an image only while it holds the exclusive lock, so an image is
never removed under a live run, and a run that starts during a removal waits for it and
then finds the image gone (a named error), never half of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from runner.paths import state_dir

_held: dict[str, int] = {}
"""Image id -> the open lock file this process holds shared (never closed: held to exit)."""


def _lock_path(image_id: str) -> Path:
    hexid = image_id.removeprefix("sha256:")
    if not re.fullmatch(r"[0-9a-f]{12,64}", hexid):
        raise ValueError(f"{image_id[:80]!r} is not an image id")
    return state_dir() / "image-use" / f"{hexid}.lock"


def hold(image_ids: Iterable[str]) -> None:
    """Mark ``image_ids`` as used by this process until it exits (blocks while a gc is
    removing one of them). Ids that are not image ids (a tag) are skipped."""
    for image_id in image_ids:
        if image_id in _held:
            continue
        try:
            path = _lock_path(image_id)
        except ValueError:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _held[image_id] = fd


@contextlib.contextmanager
def unused(image_id: str) -> Iterator[bool]:
    """True (holding the exclusive lock for the block) when no live process holds
    ``image_id``; False when one does."""
    path = _lock_path(image_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def forget(image_id: str) -> None:
    """Remove the lock file of an image that is gone (under the exclusive lock)."""
    with contextlib.suppress(OSError, ValueError):
        _lock_path(image_id).unlink()
