"""Find and remove what crashed or killed controllers left behind.

Only containers carrying the cyclebox label are considered, and only those whose
owner process (pid + start time + boot id, on this host) is gone are removed;
never a global prune. The decision is a pure function over labels.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Protocol

from pydantic import RootModel

from runner.errors import ConfigError
from runner.isolation.owner import Owner, current_owner, owner_alive
from runner.isolation.sandbox import LABEL_PREFIX, SweepResult
from runner.loading import load_model


def owner_from_labels(labels: dict[str, str]) -> Owner | None:
    try:
        return Owner(pid=int(labels[f"{LABEL_PREFIX}.owner_pid"]),
                     start=int(labels[f"{LABEL_PREFIX}.owner_start"]),
                     boot_id=labels[f"{LABEL_PREFIX}.owner_boot"],
                     host=labels[f"{LABEL_PREFIX}.owner_host"])
    except (KeyError, ValueError):
        return None


def judge(labels: dict[str, str], here: Owner, *, only_orphans: bool,
          alive: bool | None = None) -> tuple[bool, str]:
    """(remove?, why) for one labelled container. ``alive`` is injectable for tests."""
    if not only_orphans:
        return True, "forced (--all)"
    owner = owner_from_labels(labels)
    if owner is None:
        return True, "owner labels missing or malformed"
    state = owner_alive(owner, here=here) if alive is None else alive
    if state is None:
        return False, f"owned by host {owner.host}; not judged from here"
    if state:
        return False, f"owner pid {owner.pid} still running"
    return True, f"owner pid {owner.pid} is gone"


class _Engine(Protocol):
    def managed_containers(self) -> list[tuple[str, str, dict[str, str]]]: ...
    def remove(self, cid: str) -> bool: ...


def sweep_containers(engine: _Engine, *, only_orphans: bool = True,
                     dry_run: bool = False) -> list[SweepResult]:
    here = current_owner()
    results = []
    for cid, name, labels in engine.managed_containers():
        remove, why = judge(labels, here, only_orphans=only_orphans)
        removed = engine.remove(cid) if remove and not dry_run else False
        if remove and not removed and not dry_run:
            why += "; removal could not be confirmed"
        results.append(SweepResult(name=name, run_id=labels.get(f"{LABEL_PREFIX}.run_id", "?"),
                                   role=labels.get(f"{LABEL_PREFIX}.role", "?"),
                                   removed=removed, reason=why, would_remove=remove))
    return results


class _OwnerRecord(RootModel[Owner]):
    """``owner.json`` beside a socket or staging directory."""


def _recorded_owner_alive(record: Path, here: Owner) -> bool | None:
    """Liveness of the controller named by an owner record; an unreadable one is gone."""
    try:
        owner = load_model(record, _OwnerRecord, fmt="json", what="owner record",
                           fix="none needed: the directory is swept as orphaned").root
        return owner_alive(owner, here=here)
    except (ConfigError, OSError, ValueError):
        return False


def _sweep_owned(dirs: list[tuple[Path, bool | None]], *, role: str, kind: str,
                 dry_run: bool) -> list[SweepResult]:
    """Remove the directories whose owner is gone (``False``); report every one."""
    import shutil

    results = []
    for d, alive in dirs:
        if alive is False and not dry_run:
            shutil.rmtree(d, ignore_errors=True)
        results.append(SweepResult(name=str(d), run_id="?", role=role,
                                   removed=alive is False and not dry_run,
                                   reason="owner gone" if alive is False else "owner running",
                                   kind=kind, would_remove=alive is False))
    return results


def sweep_owner_dirs(root: Path, pattern: str, owner_name: str, *, role: str, kind: str,
                     dry_run: bool = False) -> list[SweepResult]:
    """Remove the directories ``root/pattern`` whose recorded owner (``owner_name`` inside
    each) is gone; report every one. Links are never followed."""
    here = current_owner()
    dirs = [(d, _recorded_owner_alive(d / owner_name, here))
            for d in sorted(root.glob(pattern)) if not d.is_symlink() and d.is_dir()]
    return _sweep_owned(dirs, role=role, kind=kind, dry_run=dry_run)


def sweep_staging_dirs(base: Path, *, owner_name: str = "owner.json", prefix: str = "",
                       dry_run: bool = False, remove_base: bool = True) -> list[SweepResult]:
    """Remove per-run input staging copies whose owning controller is gone (a SIGKILLed
    controller cannot remove its own); only directories named ``<prefix>...`` holding
    our owner record, or named ``<prefix>[new-]<pid>-<start>-...`` by us. The base itself
    goes too once empty, with ``remove_base`` (a dedicated base, never the temp dir)."""
    root = base
    if root.is_symlink() or not root.is_dir():
        return []
    here = current_owner()
    dirs: list[tuple[Path, bool | None]] = []
    try:
        entries = sorted(root.iterdir())
    except FileNotFoundError:
        # Another sweeper on this host (a Ray node beside this one) removed the base
        # once it was empty, after the check above: nothing is left to sweep here.
        return []
    for d in entries:
        if not d.name.startswith(prefix) or d.is_symlink() or not d.is_dir():
            continue
        if (d / owner_name).is_file():
            dirs.append((d, _recorded_owner_alive(d / owner_name, here)))
            continue
        # killed between creating the copy and writing its record: "<pid>-<start>-"
        pid, _, rest = d.name[len(prefix):].removeprefix("new-").partition("-")
        start, _, _ = rest.partition("-")
        if pid.isdigit() and start.isdigit():
            dirs.append((d, owner_alive(Owner(pid=int(pid), start=int(start),
                                              boot_id=here.boot_id, host=here.host),
                                        here=here)))
    results = _sweep_owned(dirs, role="input-staging", kind="staging_dir", dry_run=dry_run)
    if not dry_run and remove_base:
        with contextlib.suppress(OSError):  # the shared base, only when empty
            root.rmdir()
    return results


def sweep_pid_named_dirs(root: Path, prefix: str, *, role: str, kind: str,
                         dry_run: bool = False) -> list[SweepResult]:
    """Remove ``root/<prefix><pid>-<start>-*`` directories whose named controller is
    gone (a SIGKILLed controller cannot remove its own temporary directories)."""
    here = current_owner()
    dirs: list[tuple[Path, bool | None]] = []
    for d in sorted(root.glob(prefix + "*")):
        if d.is_symlink() or not d.is_dir():
            continue
        pid, _, rest = d.name[len(prefix):].partition("-")
        start, _, _ = rest.partition("-")
        if pid.isdigit() and start.isdigit():
            dirs.append((d, owner_alive(Owner(pid=int(pid), start=int(start),
                                              boot_id=here.boot_id, host=here.host),
                                        here=here)))
    return _sweep_owned(dirs, role=role, kind=kind, dry_run=dry_run)
