"""Output directories are made exclusively: prior evidence is never overwritten.

``refuse_existing`` is checked first, so a rerun into used evidence fails before any
work; ``make_fresh_dir`` decides races; ``remove_created`` takes back what a failed
command made before its run started, so the corrected rerun can use the same path.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from runner.errors import ConfigError

__all__ = ["make_fresh_dir", "refuse_existing", "remove_created"]


def make_fresh_dir(out: Path) -> list[Path]:
    """Create ``out`` exclusively (an existing one is refused, also when a racer made it a
    moment ago); returns the directories created, ``out`` last, for :func:`remove_created`.

    Missing parents are created and, on a refusal, left in place: removing them could pull
    a directory from under a racer that is about to create its own ``out`` there."""
    created: list[Path] = []
    try:
        for parent in reversed(out.parents):
            if not parent.exists():
                with contextlib.suppress(FileExistsError):
                    parent.mkdir()
                    created.append(parent)
        out.mkdir()
    except FileExistsError:
        raise ConfigError(f"{out} already exists; prior evidence is never overwritten",
                          field="--out", fix="choose a new output directory") from None
    except OSError as exc:
        raise ConfigError(f"cannot create {out}: {exc.strerror}", field="--out",
                          fix="choose an output directory you can write") from None
    created.append(out)
    return created


def refuse_existing(out: Path) -> None:
    """ConfigError when ``out`` exists (or cannot even be looked at): checked first, so a
    rerun into used evidence fails before any work; :func:`make_fresh_dir` decides races."""
    try:
        taken = out.exists() or out.is_symlink()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{out} is not a usable output directory ({exc})", field="--out",
                          fix="choose a new output directory") from None
    if taken:
        raise ConfigError(f"{out} already exists; prior evidence is never overwritten",
                          field="--out", fix="choose a new output directory")


def remove_created(created: list[Path]) -> None:
    """Undo :func:`make_fresh_dir` after a failure before the run started: the last
    directory (ours, made exclusively) with its content, then parents we made if empty."""
    if not created:
        return
    *parents, out = created
    shutil.rmtree(out, ignore_errors=True)
    for d in reversed(parents):
        with contextlib.suppress(OSError):
            d.rmdir()
