"""The agent's toolchains beyond pip (``project.apt``, ``project.npm``), read and checked at
freeze time from the frozen base tree, as ``project.requirements`` is in :mod:`.plan`.

The lockfile is parsed here, so every refusal (a ``file:`` or git dependency, a missing
integrity, an install script, a non-registry tarball) is exit 3 before anything is
fetched or built. Like the requirements file, neither the lockfile nor package.json may
be under the edit allowlist: baseline and candidate run in one derived image.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from runner.cycle.config import CycleFile
from runner.errors import ConfigError
from runner.loading import relative_inside
from runner.toolchain import AgentToolchains, NpmInput

NPM_FIX = ("a package-lock.json (lockfileVersion 2 or 3) committed in the agent's source "
           "tree with its package.json beside it, relative to project.subdir")


def _read(repo: Path, tree: str, rel: str, max_bytes: int, *, where: str, field: str,
          fix: str) -> bytes:
    from runner import gitops

    try:
        data = gitops.read_blob(repo, tree, rel, max_bytes=max_bytes)
    except ConfigError:  # larger than the cap: refused unread
        raise ConfigError(f"{rel} in the base tree {tree[:12]} has more than {max_bytes} "
                          "bytes", path=where, field=field, fix=fix) from None
    if data is None:
        raise ConfigError(f"{rel} is not a file in the base tree {tree[:12]}", path=where,
                          field=field, fix=fix)
    return data


def agent_toolchains(cycle: CycleFile, repo: Path, tree: str, where: str,
                     requirements: str | None) -> AgentToolchains:
    """The checked toolchains of ``cycle`` (a CycleFile); ConfigError naming the field."""
    from runner.toolchain.apt import check_apt_names
    from runner.toolchain.npm_lock import (
        MAX_LOCKFILE_BYTES,
        MAX_PACKAGE_JSON_BYTES,
        parse_lockfile,
        registry_from_env,
    )

    project = cycle.project
    apt = check_apt_names(project.apt, path=where)
    npm = None
    if project.npm is None and project.npm_ignore_scripts:
        raise ConfigError("is set without project.npm", path=where,
                          field="project.npm_ignore_scripts",
                          fix="name the lockfile in project.npm, or drop the list")
    if project.npm is not None:
        field = "project.npm"
        rel = relative_inside(project.npm, path=where, field=field, fix=NPM_FIX)
        head = rel.rpartition("/")[0]
        pkg_rel = f"{head}/package.json" if head else "package.json"
        for f in (rel, pkg_rel):
            if any(fnmatch.fnmatchcase(f, g) for g in cycle.edit.allowlist):
                raise ConfigError(f"{f} matches edit.allowlist, but the agent's npm packages "
                                  "are installed once, from the base tree, for both arms",
                                  path=where, field=field,
                                  fix="keep package.json and the lockfile outside "
                                  "edit.allowlist")
        lock = _read(repo, tree, rel, MAX_LOCKFILE_BYTES, where=where, field=field,
                     fix=NPM_FIX)
        pkg = _read(repo, tree, pkg_rel, MAX_PACKAGE_JSON_BYTES, where=where, field=field,
                    fix=NPM_FIX)
        npm = NpmInput(lockfile=lock, package_json=pkg, source=rel,
                       ignore_scripts=tuple(sorted(set(project.npm_ignore_scripts))))
        parse_lockfile(lock, pkg, source=rel, pkg_source=npm.pkg_source,
                       registry=registry_from_env(dict(os.environ)),
                       ignore_scripts=npm.ignore_scripts, path=where, field=field)
    return AgentToolchains(requirements=requirements, apt=apt, npm=npm, cycle_file=where)


__all__ = ["agent_toolchains"]
