"""Scenario manifests by command: build from a scenarios file, check, rehash (SPEC §3).

The scenarios file is what a person writes (YAML or JSON, :class:`ScenariosFile`): cases,
their splits and references, and the data stores they read. ``manifest.json`` is derived
from it and the data directory: every hash is computed here, never by hand.

Invariants: building and checking only read; :func:`rehash` rewrites the one manifest file
atomically (a temporary file renamed over it) and changes nothing but its hashes and store
sizes. Every error names the file, the field and the fix.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field

from runner.cycle.manifest import (
    MANIFEST_FIX,
    build_manifest,
    check_bindings,
    data_hash,
    reference_hash,
)
from runner.cycle.models import SPLITS, Manifest, Reference, Scenario, Store, scorer_problem
from runner.cycle.scorer_specs import Scoring
from runner.cycle.scoring import project_scorer_file
from runner.errors import CheckFailed, ConfigError
from runner.failures import is_environment_error
from runner.hashing import sha256_file
from runner.isolation.sandbox import Frozen
from runner.loading import is_inside, load_model, relative_inside, show

SCENARIOS_FIX = "`cyclebox schema scenarios` shows the format"


class ScenarioSpec(Frozen):
    """One case as written by hand."""

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """Unique case id (letters, digits, ``_ . -``; at most 64 characters)."""
    split: Literal["development", "acceptance", "reserved"]
    """development: its failures are briefed to the worker; acceptance and reserved: held
    out, never shown to the worker (train is for generated dream variants only)."""
    input: dict[str, object]
    """The object the agent reads as /case/input.json (by convention with a ``question``)."""
    reference: Reference
    """The expected answer; never shown to the agent or the worker."""
    mandatory: bool = False
    """The candidate must pass this case, or it is rejected."""
    store: str | None = None
    """Store id the case reads; may be omitted when the file declares exactly one store."""


class ScenariosFile(Frozen):
    """The hand-written source of a manifest: ``cyclebox manifest build`` turns it into
    manifest.json, computing every hash."""

    schema_: int = Field(alias="schema")
    """File format version; this code reads version 1."""
    dataset: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """Dataset name, recorded in the manifest, the plan and the receipt."""
    stores: dict[str, str] = Field(min_length=1)
    """Store id -> file path relative to the data directory (mounted at /data)."""
    scenarios: tuple[ScenarioSpec, ...] = Field(min_length=1)
    """Every case; the manifest keeps this order."""
    scoring: Scoring | None = None
    """Copied into the manifest: default scorer, project scorer file (relative to the
    directory the manifest is written to) and evidence vocabulary (docs/scorers.md)."""


@dataclass(frozen=True)
class Built:
    """A built manifest and what the person should know about it."""

    manifest: Manifest
    warnings: list[str] = field(default_factory=list)
    """Legal but probably unintended (no development case, nothing held out)."""


def load_scenarios(path: Path) -> ScenariosFile:
    """The scenarios file (YAML, or JSON by suffix); ConfigError naming file and field."""
    return load_model(path, ScenariosFile, what="scenarios file", schema=1, fix=SCENARIOS_FIX)


def stores_of(spec: dict[str, str], data_dir: Path, *, path: str,
              prefix: str = "stores") -> dict[str, Store]:
    """Size and sha256 of each store file; ConfigError naming the store otherwise."""
    out: dict[str, Store] = {}
    for sid, given in sorted(spec.items()):
        f = f"{prefix}.{show(sid, 60)}"
        fix = f"put the store's file under {data_dir}, or correct the path"
        rel = relative_inside(given, path=path, field=f, fix="a path relative to the data "
                              "directory")
        p = data_dir / rel
        try:
            regular = p.is_file() and not p.is_symlink()
        except OSError:
            regular = False
        if not regular:
            raise ConfigError(f"{show(str(p))} is missing or not a regular file", path=path,
                              field=f, fix=fix)
        if not is_inside(p, data_dir):
            raise ConfigError(f"{show(str(p))} resolves outside {data_dir}", path=path,
                              field=f, fix="keep every store inside the data directory")
        size, digest = _size_and_hash(p, path=path, field=f)
        out[sid] = Store(path=rel, sha256=digest, size_bytes=size)
    return out


def _size_and_hash(p: Path, *, path: str, field: str) -> tuple[int, str]:
    """Size and sha256 of a store file; ConfigError naming it when it cannot be read (a full
    disk or descriptor table stays an environment failure)."""
    try:
        return p.stat().st_size, sha256_file(p)
    except OSError as exc:
        if is_environment_error(exc):
            raise
        raise ConfigError(f"{show(str(p))} cannot be read: {exc.strerror or exc}", path=path,
                          field=field, fix="make the store file readable") from None


def build(scenarios_path: Path, data_dir: Path) -> Built:
    """The manifest for a scenarios file and a data directory, every hash computed."""
    where = show(str(scenarios_path))
    doc = load_scenarios(scenarios_path)
    _data_dir_usable(data_dir, path=where)
    seen: dict[str, int] = {}
    scenarios: list[Scenario] = []
    for i, s in enumerate(doc.scenarios):
        if s.id in seen:
            raise ConfigError(f"duplicate id {s.id!r} (also scenarios[{seen[s.id]}])",
                              path=where, field=f"scenarios[{i}].id",
                              fix="give every scenario its own id")
        seen[s.id] = i
        store = s.store
        if store is None:
            if len(doc.stores) != 1:
                raise ConfigError("no store named and the file declares several",
                                  path=where, field=f"scenarios[{i}].store",
                                  fix=f"set store to one of {sorted(doc.stores)}")
            store = next(iter(doc.stores))
        if store not in doc.stores:
            raise ConfigError(f"unknown store {show(store)}", path=where,
                              field=f"scenarios[{i}].store",
                              fix=f"one of {sorted(doc.stores)}, or declare it under stores")
        problem = scorer_problem(s.reference, doc.scoring)
        if problem:
            raise ConfigError(problem, path=where, field=f"scenarios[{i}].reference",
                              fix="see docs/scorers.md")
        scenarios.append(Scenario(id=s.id, split=s.split, input=s.input,
                                  reference=s.reference, mandatory=s.mandatory, store=store))
    stores = stores_of(doc.stores, data_dir, path=where)
    used = {s.split for s in scenarios}
    split = "+".join(x for x in SPLITS if x in used)
    manifest = build_manifest(doc.dataset, split, scenarios, stores, doc.scoring)
    check_bindings(manifest, where, data_dir)
    warnings = []
    if "development" not in used:
        warnings.append("no development scenario: the worker's brief would be empty")
    if not used & {"acceptance", "reserved"}:
        warnings.append("no acceptance or reserved scenario: nothing is held out from the "
                        "worker, so an accepted candidate proves little")
    return Built(manifest, warnings)


@dataclass(frozen=True)
class Mismatch:
    """One hash (or size) in a manifest that does not match what it describes."""

    field: str
    """The manifest field, e.g. ``reference_hash`` or ``stores.units.sha256``."""
    message: str


def load_shape(path: Path, data_dir: Path) -> Manifest:
    """A manifest's shape and bindings, without checking any hash."""
    m = load_model(path, Manifest, fmt="json", what="scenario manifest", schema=1,
                   fix=MANIFEST_FIX)
    _data_dir_usable(data_dir, path=show(str(path)))
    check_bindings(m, show(str(path)), data_dir)
    project_scorer_file(m, path)
    return m


def mismatches(path: Path, data_dir: Path) -> list[Mismatch]:
    """Every hash of the manifest at ``path`` that does not match the scenarios or the data."""
    m = load_shape(path, data_dir)
    out: list[Mismatch] = []
    for sid, st in sorted(m.stores.items()):
        p = data_dir / st.path
        try:
            regular = p.is_file() and not p.is_symlink()
        except OSError:
            regular = False
        if not regular:
            out.append(Mismatch(f"stores.{sid}.path", f"{p} is missing or not a regular file"))
            continue
        size, digest = _size_and_hash(p, path=show(str(path)), field=f"stores.{sid}.path")
        if digest != st.sha256:
            out.append(Mismatch(f"stores.{sid}.sha256", f"{p} has sha256 {digest[:12]}…; the "
                                f"manifest says {st.sha256[:12]}…"))
        if size != st.size_bytes:
            out.append(Mismatch(f"stores.{sid}.size_bytes", f"{p} has {size} bytes; the "
                                f"manifest says {st.size_bytes}"))
    if reference_hash(m.scenarios) != m.reference_hash:
        out.append(Mismatch("reference_hash", "does not match the scenarios' references "
                            "(a reference edited by hand?)"))
    if data_hash(m.stores) != m.data_hash:
        out.append(Mismatch("data_hash", "does not match the stores table"))
    return out


def check(path: Path, data_dir: Path) -> Manifest:
    """The manifest when every hash matches; CheckFailed naming each mismatch otherwise."""
    found = mismatches(path, data_dir)
    if found:
        lines = "; ".join(f"{m.field}: {m.message}" for m in found)
        raise CheckFailed(f"{show(str(path))}: {len(found)} hash mismatch(es): {lines}. Fix: "
                          f"if the data or references changed on purpose, run `cyclebox "
                          f"manifest rehash {show(str(path))} --data {show(str(data_dir))}`; "
                          "otherwise restore them")
    return load_shape(path, data_dir)


def rehash(path: Path, data_dir: Path) -> list[str]:
    """Recompute every hash (and store size) of the manifest in place; everything else is
    kept. Returns the fields that changed (empty: the file is left untouched)."""
    m = load_shape(path, data_dir)
    where = show(str(path))
    stores = stores_of({k: v.path for k, v in m.stores.items()}, data_dir, path=where)
    fixed = m.model_copy(update={"stores": stores, "reference_hash": reference_hash(m.scenarios),
                                 "data_hash": data_hash(stores)})
    changed = [f"stores.{k}.{attr}" for k in sorted(stores) for attr in ("sha256", "size_bytes")
               if getattr(stores[k], attr) != getattr(m.stores[k], attr)]
    changed += [k for k in ("reference_hash", "data_hash") if getattr(fixed, k) != getattr(m, k)]
    if changed:
        write_atomic(fixed, path, field=None)  # the manifest itself, named by its path
    return changed


def write_atomic(m: Manifest, path: Path, *, field: str | None = "--out") -> None:
    """Write the manifest next to ``path`` and rename it over ``path`` (no torn file); an
    existing file keeps its mode, a new one gets the umask's.

    A directory or file that refuses the write (read-only, not permitted) is bad input
    naming ``path`` (and ``field``, the option that named it, if any); a full disk stays an
    environment failure."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")

    def refused(exc: OSError) -> ConfigError:
        return ConfigError(f"cannot write {show(str(path))}: {exc.strerror or exc}",
                           path=None if field else show(str(path)), field=field,
                           fix=f"make {show(str(path.parent))} writable, or write elsewhere")

    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     0o666)
    except OSError as exc:
        if is_environment_error(exc):
            raise
        raise refused(exc) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(manifest_bytes(m))
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and not is_environment_error(exc):
            raise refused(exc) from None
        raise


def manifest_bytes(m: Manifest) -> bytes:
    """The manifest as stored: canonical JSON (sorted keys, two-space indent), one newline."""
    return (json.dumps(m.model_dump(mode="json", by_alias=True), indent=2, sort_keys=True)
            + "\n").encode()


def summary(m: Manifest) -> dict[str, object]:
    """Counts per split and the hashes, for printing."""
    per: dict[str, int] = {}
    for s in m.scenarios:
        per[s.split] = per.get(s.split, 0) + 1
    return {"dataset": m.dataset, "split": m.split, "scenarios": per,
            "stores": sorted(m.stores), "reference_hash": m.reference_hash,
            "data_hash": m.data_hash}


def _data_dir_usable(data_dir: Path, *, path: str) -> None:
    try:
        ok = data_dir.is_dir()
    except OSError:
        ok = False
    if not ok:
        raise ConfigError(f"data directory {show(str(data_dir))} does not exist or is not a "
                          "directory", path=path, field="--data",
                          fix="pass the directory holding the data stores")

