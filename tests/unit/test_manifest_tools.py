"""Manifests by command: build computes every hash, check names each mismatch, rehash
repairs hashes only. A manifest built here is one the cycle loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from runner.cycle.manifest import load_manifest
from runner.errors import CheckFailed, ConfigError, IntegrityError
from runner.paths import PROJECT_ROOT
from runner.project import manifest_tools as mt

SHOP = PROJECT_ROOT / "examples" / "shop-analyst"


def scenarios(tmp_path: Path, **changes: object) -> Path:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "units.json").write_text('{"m": 1}\n')
    doc: dict[str, object] = {
        "schema": 1, "dataset": "units", "stores": {"units": "units.json"},
        "scenarios": [
            {"id": "d1", "split": "development", "input": {"question": "1 m in m?"},
             "reference": {"kind": "number", "value": 1, "evidence": ["m"]}},
            {"id": "a1", "split": "acceptance", "mandatory": True,
             "input": {"question": "secret?"}, "reference": {"kind": "refuse"}}]}
    doc.update(changes)
    path = tmp_path / "scenarios.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def built(tmp_path: Path) -> Path:
    out = tmp_path / "manifest.json"
    mt.write_atomic(mt.build(scenarios(tmp_path), tmp_path / "data").manifest, out)
    return out


def test_a_built_manifest_loads_in_the_cycle(tmp_path: Path) -> None:
    res = mt.build(scenarios(tmp_path), tmp_path / "data")
    assert res.warnings == []
    m = res.manifest
    assert m.split == "development+acceptance"
    assert [s.store for s in m.scenarios] == ["units", "units"]  # the only store by default
    out = built(tmp_path)
    assert load_manifest(out, tmp_path / "data").reference_hash == m.reference_hash
    assert mt.check(out, tmp_path / "data").data_hash == m.data_hash


@pytest.mark.parametrize("split", ["dev", "Development", "train", ""])
def test_a_split_outside_the_documented_set_is_refused_naming_field_and_fix(
        tmp_path: Path, split: str) -> None:
    path = scenarios(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["scenarios"][1]["split"] = split
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as exc:
        mt.build(path, tmp_path / "data")
    text = str(exc.value)
    assert str(path) in text and "scenarios[1].split" in text
    assert "'development'" in text and "'acceptance'" in text


def test_bad_scenarios_name_the_field(tmp_path: Path) -> None:
    path = scenarios(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["scenarios"][1]["id"] = "d1"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"scenarios\[1\]\.id: duplicate id 'd1'"):
        mt.build(path, tmp_path / "data")
    doc["scenarios"][1]["id"] = "a1"
    doc["scenarios"][1]["store"] = "nope"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"scenarios\[1\]\.store: unknown store nope"):
        mt.build(path, tmp_path / "data")
    doc["scenarios"][1].pop("store")
    doc["stores"]["other"] = "other.json"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"scenarios\[0\]\.store: no store named"):
        mt.build(path, tmp_path / "data")


def test_a_missing_or_escaping_store_is_refused_by_name(tmp_path: Path) -> None:
    path = scenarios(tmp_path, stores={"units": "gone.json"})
    with pytest.raises(ConfigError, match=r"stores\.units: .*gone\.json is missing"):
        mt.build(path, tmp_path / "data")
    path = scenarios(tmp_path, stores={"units": "../scenarios.yaml"})
    with pytest.raises(ConfigError, match=r"stores\.units: .*escapes"):
        mt.build(path, tmp_path / "data")
    (tmp_path / "data" / "link.json").symlink_to(tmp_path / "scenarios.yaml")
    path = scenarios(tmp_path, stores={"units": "link.json"})
    with pytest.raises(ConfigError, match=r"stores\.units: .*not a regular file"):
        mt.build(path, tmp_path / "data")


def test_no_development_or_held_out_case_is_warned(tmp_path: Path) -> None:
    path = scenarios(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["scenarios"] = doc["scenarios"][:1]
    path.write_text(yaml.safe_dump(doc))
    assert any("nothing is held out" in w for w in mt.build(path, tmp_path / "data").warnings)
    doc["scenarios"][0]["split"] = "acceptance"
    path.write_text(yaml.safe_dump(doc))
    assert any("brief would be empty" in w for w in mt.build(path, tmp_path / "data").warnings)


def test_check_names_each_mismatch_and_the_rehash_fix(tmp_path: Path) -> None:
    out = built(tmp_path)
    (tmp_path / "data" / "units.json").write_text('{"m": 1, "km": 1000}\n')
    doc = json.loads(out.read_text())
    doc["scenarios"][0]["reference"]["value"] = 2.0
    out.write_text(json.dumps(doc))
    found = {m.field for m in mt.mismatches(out, tmp_path / "data")}
    assert found == {"stores.units.sha256", "stores.units.size_bytes", "reference_hash"}
    with pytest.raises(CheckFailed) as exc:
        mt.check(out, tmp_path / "data")
    assert "reference_hash" in str(exc.value) and "stores.units.sha256" in str(exc.value)
    assert f"cyclebox manifest rehash {out}" in str(exc.value)
    with pytest.raises(IntegrityError, match="manifest rehash"):  # the cycle says so too
        load_manifest(out, tmp_path / "data")


def test_rehash_repairs_hashes_and_keeps_everything_else(tmp_path: Path) -> None:
    out = built(tmp_path)
    (tmp_path / "data" / "units.json").write_text('{"m": 1, "km": 1000}\n')
    doc = json.loads(out.read_text())
    doc["scenarios"][0]["reference"]["value"] = 2.0
    out.write_text(json.dumps(doc))
    changed = mt.rehash(out, tmp_path / "data")
    assert set(changed) == {"stores.units.sha256", "stores.units.size_bytes", "reference_hash",
                            "data_hash"}
    after = json.loads(out.read_text())
    assert after["scenarios"] == doc["scenarios"]
    assert {k: after[k] for k in ("dataset", "split", "schema")} == \
        {k: doc[k] for k in ("dataset", "split", "schema")}
    load_manifest(out, tmp_path / "data")
    before = out.read_bytes()
    assert mt.rehash(out, tmp_path / "data") == []
    assert out.read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_rehash_keeps_a_broken_binding_an_error(tmp_path: Path) -> None:
    out = built(tmp_path)
    doc = json.loads(out.read_text())
    doc["scenarios"][0]["store"] = "nope"
    out.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=r"scenarios\[0\]\.store"):
        mt.rehash(out, tmp_path / "data")
    assert json.loads(out.read_text()) == doc


def test_the_bundled_manifest_is_current_and_rehash_writes_it_byte_for_byte(
        tmp_path: Path) -> None:
    mt.check(SHOP / "manifest.json", SHOP / "data")
    copy = tmp_path / "manifest.json"
    shutil.copyfile(SHOP / "manifest.json", copy)
    doc = json.loads(copy.read_text())
    doc["reference_hash"] = "0" * 64
    copy.write_text(json.dumps(doc))
    assert mt.rehash(copy, SHOP / "data") == ["reference_hash"]
    assert copy.read_bytes() == (SHOP / "manifest.json").read_bytes()


def test_a_missing_data_directory_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--data: .*does not exist"):
        mt.build(scenarios(tmp_path), tmp_path / "nodata")
