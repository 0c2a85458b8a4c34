"""Scenario manifests (SPEC §3): identity hashes and exact store bytes, checked on load."""

from __future__ import annotations

import json
from pathlib import Path

from runner.cycle.models import Manifest, Scenario, Store
from runner.cycle.scorer_specs import Scoring
from runner.cycle.scoring import project_scorer_file
from runner.errors import ConfigError, IntegrityError
from runner.hashing import sha256_file, sha256_json
from runner.loading import is_inside, load_model, read_capped, show


def reference_hash(scenarios: tuple[Scenario, ...] | list[Scenario]) -> str:
    """sha256 over the canonical list of [id, reference] in manifest order."""
    return sha256_json([[s.id, s.reference.model_dump(mode="json")] for s in scenarios])


def data_hash(stores: dict[str, Store]) -> str:
    """sha256 over the canonical stores mapping (path, sha256, size)."""
    return sha256_json({k: v.model_dump(mode="json") for k, v in sorted(stores.items())})


def store_entry(data_dir: Path, rel: str) -> Store:
    p = data_dir / rel
    return Store(path=rel, sha256=sha256_file(p), size_bytes=p.stat().st_size)


MANIFEST_FIX = ("`cyclebox schema manifest` shows the format; build it from a scenarios "
                "file with `cyclebox manifest build`")
REHASH_FIX = "if the change was intended: cyclebox manifest rehash MANIFEST --data DATA_DIR"


def load_manifest(path: Path, data_dir: Path, *, ref: tuple[str, str] | None = None
                  ) -> Manifest:
    """Load and check: schema, identity hashes, unique ids, splits, store bindings, store
    paths (relative, inside ``data_dir``), store bytes and the project scorer file."""
    try:
        m = load_model(path, Manifest, fmt="json", what="scenario manifest", ref=ref,
                       schema=1, fix=MANIFEST_FIX)
    except ConfigError as exc:
        if "invalid JSON" not in str(exc) or _looks_json(path):
            raise
        # the common mistake: the scenarios file (YAML) named where the manifest goes
        rpath, rfield = ref if ref else (show(str(path)), None)
        raise ConfigError(f"{show(str(path))} is not a scenario manifest (not JSON: "
                          f"{str(exc).split('invalid JSON: ', 1)[1].split(' Fix:')[0]}); "
                          "scenarios names the manifest that `cyclebox manifest build` "
                          "writes, not the scenarios file it reads", path=rpath, field=rfield,
                          fix="cyclebox manifest build --scenarios SCENARIOS.yaml --data "
                          "DATA_DIR --out manifest.json, then scenarios: manifest.json"
                          ) from None
    where = show(str(path))
    check_bindings(m, where, data_dir)
    if reference_hash(m.scenarios) != m.reference_hash:
        raise IntegrityError(f"{where}: reference_hash does not match the scenarios' references "
                             f"(edited without re-hashing?). Fix: {REHASH_FIX}")
    if data_hash(m.stores) != m.data_hash:
        raise IntegrityError(f"{where}: data_hash does not match the stores table. "
                             f"Fix: {REHASH_FIX}")
    try:
        verify_stores(m, data_dir)
    except IntegrityError as exc:
        raise IntegrityError(f"{exc}. Fix: {REHASH_FIX}") from None
    project_scorer_file(m, path)
    return m


def _looks_json(path: Path) -> bool:
    """The file starts (after blanks and a BOM) with ``{``: a manifest, however broken."""
    try:  # non-blocking, a regular file only (load_model read it already)
        head = read_capped(path)[:256]
    except ConfigError:
        return True
    return head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{")


def check_bindings(m: Manifest, where: str, data_dir: Path) -> None:
    """Unique ids, known stores, splits covered, store paths inside ``data_dir``;
    ConfigError naming the field (no hash is checked here)."""
    ids = [s.id for s in m.scenarios]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ConfigError(f"duplicate scenario ids {dup}", path=where, field="scenarios",
                          fix="give every scenario its own id")
    covered = set(m.split.split("+"))
    for i, s in enumerate(m.scenarios):
        if s.store not in m.stores:
            raise ConfigError(f"scenario {s.id} binds unknown store {show(s.store)}",
                              path=where, field=f"scenarios[{i}].store",
                              fix=f"one of {sorted(m.stores)}")
        if s.split not in covered:
            raise ConfigError(f"scenario {s.id} has split {s.split!r}, which the manifest's "
                              f"split {m.split!r} does not cover", path=where,
                              field=f"scenarios[{i}].split",
                              fix="list every split used in the top-level split, joined by +")
    for sid, st in sorted(m.stores.items()):
        if not is_inside(data_dir / st.path, data_dir):
            raise ConfigError(f"store {show(sid)} path {show(st.path)} resolves outside "
                              f"the data directory {data_dir} (through a symlink?)",
                              path=where, field=f"stores.{show(sid)}.path",
                              fix="keep every store inside data_dir, without symlinks out")


def verify_stores(m: Manifest, data_dir: Path) -> None:
    """Exact bytes of every store; IntegrityError naming the store on any difference."""
    for sid, st in sorted(m.stores.items()):
        p = data_dir / st.path
        try:
            regular = p.is_file() and not p.is_symlink()
            size = p.stat().st_size if regular else -1
            digest = sha256_file(p) if regular else ""
        except (OSError, ValueError):
            regular = False
        if not regular:
            raise IntegrityError(f"store {sid}: {p} is missing or not a regular file")
        if size != st.size_bytes or digest != st.sha256:
            raise IntegrityError(f"store {sid}: {p} changed (sha256 {digest[:12]}…, "
                                 f"{size} bytes; manifest says {st.sha256[:12]}…, "
                                 f"{st.size_bytes} bytes)")


def build_manifest(dataset: str, split: str, scenarios: list[Scenario],
                   stores: dict[str, Store], scoring: Scoring | None = None) -> Manifest:
    doc: dict[str, object] = {
        "schema": 1, "dataset": dataset, "split": split,
        "scenarios": [s.model_dump(mode="json") for s in scenarios],
        "stores": {k: v.model_dump(mode="json") for k, v in stores.items()},
        "reference_hash": reference_hash(scenarios), "data_hash": data_hash(stores)}
    if scoring is not None:
        doc["scoring"] = scoring.model_dump(mode="json")
    return Manifest.model_validate(doc)


def write_manifest(m: Manifest, path: Path) -> None:
    path.write_text(json.dumps(m.model_dump(mode="json", by_alias=True), indent=2,
                               sort_keys=True) + "\n")
