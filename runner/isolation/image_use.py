"""Which images a live cyclebox process uses, for ``cyclebox images gc``.

A process that will start containers from an image (freeze deriving the analyst image,
a run executing its plan) holds a shared ``flock`` on ``<holds>/<id>.lock`` for the rest
of its life; the kernel drops it when the process ends, however it ends. ``images gc``
removes an image only while it holds the exclusive lock, so an image is never removed
under a live run, and a run that starts during a removal waits for it and then finds the
image gone (a named error), never half of it.

``<holds>`` is ONE directory per user, shared by every state directory
(``~/.cache/cyclebox/image-use`` of the account's home, :func:`holds_dir`): a derived
image's tag names its content, so a freeze in one state directory reuses the image another
one built, and a gc in either must see both holds. Only when that directory cannot be
created does a hold fall back to ``<state>/image-use``; ``unused`` takes both locks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from runner.paths import state_dir

_held: dict[str, int] = {}
"""Image id -> the open lock file this process holds shared (never closed: held to exit)."""


HOLDS_ENV = "CYCLEBOX_HOLDS_DIR"
"""Overrides :func:`holds_dir` (tests): every process of the user must agree on it."""


def holds_dir() -> Path:
    """The per-user directory every state directory's holds live in: under the account's
    home as the password database names it (not ``$HOME`` or ``$XDG_CACHE_HOME``, which
    a run started by sudo, systemd or an IDE may see otherwise than the gc does)."""
    override = os.environ.get(HOLDS_ENV, "")
    if os.path.isabs(override):
        return Path(override)
    return Path(pwd.getpwuid(os.getuid()).pw_dir) / ".cache" / "cyclebox" / "image-use"


def _name(image_id: str) -> str:
    hexid = image_id.removeprefix("sha256:")
    if not re.fullmatch(r"[0-9a-f]{12,64}", hexid):
        raise ValueError(f"{image_id[:80]!r} is not an image id")
    return f"{hexid}.lock"


def _lock_paths(image_id: str) -> list[Path]:
    """The shared lock, then this state directory's fallback lock."""
    name = _name(image_id)
    return [holds_dir() / name, state_dir() / "image-use" / name]


def _open(path: Path) -> int:
    """The lock file, never through a link (a planted one would create a file wherever
    it points)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)


def hold(image_ids: Iterable[str]) -> None:
    """Mark ``image_ids`` as used by this process until it exits (blocks while a gc is
    removing one of them). Ids that are not image ids (a tag) are skipped."""
    for image_id in image_ids:
        if image_id in _held:
            continue
        try:
            shared, local = _lock_paths(image_id)
        except ValueError:
            continue
        try:
            fd = _open(shared)
        except OSError:  # no writable per-user cache: this state directory's gc sees it
            fd = _open(local)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _held[image_id] = fd


@contextlib.contextmanager
def unused(image_id: str) -> Iterator[bool]:
    """True (holding the exclusive locks for the block) when no live process holds
    ``image_id`` (in any state directory of this user); False when one does."""
    fds: list[int] = []
    try:
        shared, local = _lock_paths(image_id)
        for path in (shared, local):
            try:
                fd = _open(path)
            except OSError:
                if path is shared:
                    continue  # no per-user cache, hence no hold there either
                raise
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
        yield True
    finally:
        for fd in fds:
            os.close(fd)


def forget(image_id: str) -> None:
    """Remove the lock file of an image that is gone (under the exclusive lock)."""
    with contextlib.suppress(ValueError):
        for path in _lock_paths(image_id):
            with contextlib.suppress(OSError):
                path.unlink()
