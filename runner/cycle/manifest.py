"""Scenario manifests (SPEC §3): identity hashes and exact store bytes, checked on load."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from runner.collect import loads_strict
from runner.cycle.models import Manifest, Scenario, Store
from runner.errors import ConfigError, IntegrityError, OutputRejected
from runner.hashing import sha256_file, sha256_json


def reference_hash(scenarios: tuple[Scenario, ...] | list[Scenario]) -> str:
    """sha256 over the canonical list of [id, reference] in manifest order."""
    return sha256_json([[s.id, s.reference.model_dump(mode="json")] for s in scenarios])


def data_hash(stores: dict[str, Store]) -> str:
    """sha256 over the canonical stores mapping (path, sha256, size)."""
    return sha256_json({k: v.model_dump(mode="json") for k, v in sorted(stores.items())})


def store_entry(data_dir: Path, rel: str) -> Store:
    p = data_dir / rel
    return Store(path=rel, sha256=sha256_file(p), size_bytes=p.stat().st_size)


def load_manifest(path: Path, data_dir: Path) -> Manifest:
    """Load and check: schema, identity hashes, unique ids, store bindings and store bytes."""
    try:
        raw = loads_strict(path.read_bytes(), source=str(path))
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", path=str(path),
                          field="scenarios") from None
    except OutputRejected as exc:
        raise ConfigError(str(exc), path=str(path)) from None
    try:
        m = Manifest.model_validate(raw)
    except ValidationError as exc:
        e = exc.errors()[0]
        raise ConfigError(e["msg"], path=str(path),
                          field=".".join(str(x) for x in e["loc"])) from None
    if m.schema_ != 1:
        raise ConfigError(f"schema must be 1, got {m.schema_}", path=str(path), field="schema")
    ids = [s.id for s in m.scenarios]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ConfigError(f"duplicate scenario ids {dup}", path=str(path), field="scenarios")
    for s in m.scenarios:
        if s.store not in m.stores:
            raise ConfigError(f"scenario {s.id} binds unknown store {s.store!r}", path=str(path),
                              field=f"scenarios[{s.id}].store", fix=f"one of {sorted(m.stores)}")
    if reference_hash(m.scenarios) != m.reference_hash:
        raise IntegrityError(f"{path}: reference_hash does not match the scenarios' references "
                             "(edited without re-hashing?)")
    if data_hash(m.stores) != m.data_hash:
        raise IntegrityError(f"{path}: data_hash does not match the stores table")
    verify_stores(m, data_dir)
    return m


def verify_stores(m: Manifest, data_dir: Path) -> None:
    """Exact bytes of every store; IntegrityError naming the store on any difference."""
    for sid, st in sorted(m.stores.items()):
        p = data_dir / st.path
        if not p.is_file() or p.is_symlink():
            raise IntegrityError(f"store {sid}: {p} is missing or not a regular file")
        size = p.stat().st_size
        digest = sha256_file(p)
        if size != st.size_bytes or digest != st.sha256:
            raise IntegrityError(f"store {sid}: {p} changed (sha256 {digest[:12]}…, "
                                 f"{size} bytes; manifest says {st.sha256[:12]}…, "
                                 f"{st.size_bytes} bytes)")


def build_manifest(dataset: str, split: str, scenarios: list[Scenario],
                   stores: dict[str, Store]) -> Manifest:
    return Manifest.model_validate({
        "schema": 1, "dataset": dataset, "split": split,
        "scenarios": [s.model_dump(mode="json") for s in scenarios],
        "stores": {k: v.model_dump(mode="json") for k, v in stores.items()},
        "reference_hash": reference_hash(scenarios), "data_hash": data_hash(stores)})


def write_manifest(m: Manifest, path: Path) -> None:
    path.write_text(json.dumps(m.model_dump(mode="json", by_alias=True), indent=2,
                               sort_keys=True) + "\n")
