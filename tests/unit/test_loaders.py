"""runner.loading and the exclusive run directory, one behaviour per test."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import yaml

from runner.cycle.models import Manifest, Scenario, Store
from runner.cycle.plan import freeze, plan_lock
from runner.errors import ConfigError, PrerequisiteError
from runner.isolation.policy import RolePolicy, parse_size
from runner.loading import (
    decode_utf8,
    field_path,
    load_data,
    load_model,
    parse_json,
    parse_model,
    parse_yaml,
    read_capped,
    validate,
)
from runner.outdir import make_fresh_dir, remove_created
from runner.paths import PROJECT_ROOT

EXAMPLE = PROJECT_ROOT / "examples" / "shop-analyst"
BILLION_LAUGHS = ('a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
                  + "".join(f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
                            for p, c in zip("abcdefgh", "bcdefghi", strict=True)))


# -- YAML ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(
    [*EXAMPLE.glob("*.yaml"), *EXAMPLE.glob("scripts/*.yaml"),
     *(PROJECT_ROOT / "policies").rglob("*.yaml")]), ids=lambda p: p.name)
def test_strict_yaml_reads_every_bundled_file_as_safe_load_does(path: Path) -> None:
    text = path.read_text()
    assert parse_yaml(text, path=str(path)) == yaml.safe_load(text)


def test_billion_laughs_stops_at_the_first_anchor() -> None:
    with pytest.raises(ConfigError, match=r"line 1, column 4: YAML anchors"):
        parse_yaml(BILLION_LAUGHS, path="bomb.yaml")


@pytest.mark.parametrize(("text", "message"), [
    ("a: &x 1\nb: *x\n", "anchors"),
    ("a: *x\n", "alias"),
    ("a: 1\na: 2\n", "duplicate key a"),
    ("a:\n  <<: {b: 1}\n", "merge keys"),
    ("a: .inf\n", "non-finite"),
    ("a: -.Inf\n", "non-finite"),
    ("a: .nan\n", "non-finite"),
    ("a: 1.0e+999\n", "non-finite"),
    ("a: !!python/object/apply:os.system [id]\n", "constructor"),
    ("a: !custom 1\n", "constructor"),
    ("a: " + "[" * 65 + "]" * 65 + "\n", "deeper than 64"),
    ("a: " + "9" * 5000 + "\n", "digits"),
    ("? [1, 2]\n: x\n", "plain value"),
    ("a: \x00\n", "special characters"),
    ("a: [\n", "line 2"),
])
def test_strict_yaml_refusals(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=r"f\.yaml") as exc:
        parse_yaml(text, path="f.yaml")
    assert message in str(exc.value)


def test_sixty_four_levels_are_still_fine() -> None:
    assert parse_yaml("a: " + "[" * 63 + "]" * 63 + "\n", path="f.yaml") is not None


def test_hostile_key_is_shown_escaped() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_yaml('"\\e[31mred": 1\n"\\e[31mred": 2\n', path="f.yaml")
    assert "\x1b" not in str(exc.value) and "\\x1b" in str(exc.value)


# -- JSON, bytes, files ----------------------------------------------------------------------
@pytest.mark.parametrize(("text", "message"), [
    ('{"a": 1, "a": 2}', "duplicate key"), ('{"a": NaN}', "NaN"), ("[1e999]", "infinity"),
    ("[" * 65 + "]" * 65, "deeper than 64"), ('"\\ud800"', "surrogate"),
    ("", "invalid JSON"),
])
def test_strict_json_refusals(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=r"f\.json") as exc:
        parse_json(text, path="f.json")
    assert message in str(exc.value)


def test_not_utf8_names_the_byte_offset() -> None:
    with pytest.raises(ConfigError, match=r"f\.yaml: not UTF-8: byte 4 \(0xe9\)"):
        decode_utf8(b"abc\n\xe9t\xe9", path="f.yaml")
    assert decode_utf8(b"\xef\xbb\xbfschema: 1", path="f") == "schema: 1"


def test_read_capped_refuses_size_directories_and_fifos(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 101)
    with pytest.raises(ConfigError, match="101 bytes; the limit is 100"):
        read_capped(big, max_bytes=100)
    with pytest.raises(ConfigError, match="is a directory"):
        read_capped(tmp_path)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_capped(fifo)  # no writer: a blocking open would hang here
    with pytest.raises(ConfigError, match=r"cycle\.yaml: scenarios: scenario manifest .*"
                                          r"nope\.json does not exist"):
        read_capped(tmp_path / "nope.json", what="scenario manifest",
                    ref=("cycle.yaml", "scenarios"))


def test_load_data_picks_the_format_by_suffix(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"a": 1}')
    (tmp_path / "a.yml").write_text("a: 1\n")
    assert load_data(tmp_path / "a.json") == load_data(tmp_path / "a.yml") == {"a": 1}


# -- validation ----------------------------------------------------------------------------------
def test_field_paths_name_indexes_and_keys() -> None:
    assert field_path(("scenarios", 3, "split")) == "scenarios[3].split"
    assert field_path(("roles", "analyst", "memory")) == "roles.analyst.memory"
    assert field_path(()) == "(top level)"


def test_validate_names_file_field_and_fix() -> None:
    doc = {"path": "/etc/passwd", "sha256": "0" * 64, "size_bytes": 1}
    with pytest.raises(ConfigError) as exc:
        validate(Store, doc, path="m.json", fix="relative paths only", prefix="stores.shop")
    text = str(exc.value)
    assert text.startswith("m.json: stores.shop.path: ") and "absolute" in text
    assert text.endswith("Fix: relative paths only")


def test_non_finite_numbers_from_strings_are_refused() -> None:
    base = {"image": "analyst", "memory": "512m", "cpus": 1, "pids": 64, "timeout_s": 10}
    with pytest.raises(ConfigError, match="timeout_s"):
        validate(RolePolicy, {**base, "timeout_s": "inf"}, path="r.yaml", fix="f")
    with pytest.raises(ConfigError, match="cpus"):
        validate(RolePolicy, {**base, "cpus": "nan"}, path="r.yaml", fix="f")


@pytest.mark.parametrize("memory", [0, "0m", "0.0001k", -5, 1.5, True, None, "lots", "9" * 99])
def test_memory_must_be_a_positive_size(memory: object) -> None:
    base = {"image": "analyst", "memory": memory, "cpus": 1, "pids": 64, "timeout_s": 10}
    with pytest.raises(ConfigError, match=r"r\.yaml: memory"):
        validate(RolePolicy, base, path="r.yaml", fix="f")


@pytest.mark.parametrize("tmpfs", [None, [], {"tmp": "64m"}, {"/tmp": 0}, {"/tmp": None}])
def test_tmpfs_must_map_absolute_paths_to_sizes(tmpfs: object) -> None:
    base = {"image": "analyst", "memory": "1g", "cpus": 1, "pids": 64, "timeout_s": 10,
            "tmpfs": tmpfs}
    with pytest.raises(ConfigError, match=r"r\.yaml: tmpfs"):
        validate(RolePolicy, base, path="r.yaml", fix="f")


def test_parse_size_bounds() -> None:
    assert parse_size("1.5k") == 1536
    for bad in (0, "0m", -1, 2**60, "2000t"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)


def test_scenario_splits_come_from_the_documented_set() -> None:
    base = {"id": "c1", "input": {}, "reference": {"kind": "refuse"}, "store": "s"}
    for split in ("development", "acceptance", "reserved", "train"):
        Scenario.model_validate({**base, "split": split})
    with pytest.raises(ValueError, match="unknown split"):
        Scenario.model_validate({**base, "split": "developement"})


def test_example_manifest_round_trips_through_the_loader(tmp_path: Path) -> None:
    m = load_model(EXAMPLE / "manifest.json", Manifest, fix="f", schema=1)
    assert {s.split for s in m.scenarios} == {"development", "acceptance"}


# -- exclusive run directories -------------------------------------------------------------------
def test_racing_mkdirs_give_one_directory_and_clear_refusals(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "run"
    results: list[str] = []
    barrier = threading.Barrier(8)

    def racer() -> None:
        barrier.wait()
        try:
            make_fresh_dir(out)
            results.append("won")
        except ConfigError as exc:
            assert "already exists" in str(exc)
            results.append("refused")

    threads = [threading.Thread(target=racer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["refused"] * 7 + ["won"]
    assert out.is_dir()


def test_remove_created_takes_back_only_what_it_made(tmp_path: Path) -> None:
    (tmp_path / "kept").mkdir()
    created = make_fresh_dir(tmp_path / "kept" / "new" / "run")
    (tmp_path / "kept" / "new" / "run" / "partial.json").write_text("{")
    remove_created(created)
    assert not (tmp_path / "kept" / "new").exists()
    assert (tmp_path / "kept").is_dir()


def test_plan_lock_refuses_a_second_runner(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    with (plan_lock(plan), pytest.raises(ConfigError, match="being run by another process"),
          plan_lock(plan)):
        pass
    with plan_lock(plan):  # released when the first run ends
        pass


def _cycle(tmp_path: Path) -> Path:
    doc = yaml.safe_load((EXAMPLE / "cycle.yaml").read_text())
    doc["project"]["repo"] = str(PROJECT_ROOT)
    doc["roles"] = str(PROJECT_ROOT / "policies" / "roles.yaml")
    for key in ("scenarios", "policy", "data_dir"):
        doc[key] = str(EXAMPLE / doc[key])
    for up in doc["upstreams"].values():
        up["script"] = str((EXAMPLE / up["script"]).resolve())
    (tmp_path / "cycle.yaml").write_text(yaml.safe_dump(doc))
    return tmp_path / "cycle.yaml"


FAKE = {r: "sha256:" + "0" * 64 for r in ("analyst", "worker", "evaluator", "apply")}


def test_freeze_checks_images_last_and_leaves_no_directory(tmp_path: Path) -> None:
    def no_images() -> dict[str, str]:
        raise PrerequisiteError("no image built. Fix: cyclebox images build")

    out = tmp_path / "deep" / "run"
    with pytest.raises(PrerequisiteError):
        freeze(_cycle(tmp_path), out, images=no_images)
    assert not (tmp_path / "deep").exists()


def test_freeze_failing_while_writing_removes_its_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import runner.cycle.plan as plan_mod

    def disk_full(*_a: object, **_k: object) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plan_mod, "write_plan", disk_full)
    out = tmp_path / "run"
    with pytest.raises(OSError, match="No space"):
        freeze(_cycle(tmp_path), out, images=FAKE)
    assert not out.exists()
    monkeypatch.undo()
    plan, _ = freeze(_cycle(tmp_path), out, images=FAKE)  # the corrected rerun works
    assert json.loads((out / "plan.json").read_text())["plan"]["name"] == plan.name


@pytest.mark.parametrize(("raw", "detail"), [
    (b"\xff\xfe", "not UTF-8: byte 0"),
    (b'{"a": ' + b"9" * 5001 + b"}", "a number longer than 4300 digits"),
    (b'{"a": NaN}', "invalid JSON"),
])
def test_a_file_cyclebox_wrote_keeps_its_callers_fix(raw: bytes, detail: str) -> None:
    """helper-45: a damaged file cyclebox writes (a lock, a receipt, a call log) was told
    "save the file as UTF-8" or to write plain JSON by hand; the caller's fix is kept and
    the generic advice moves into the message."""
    from pydantic import BaseModel

    class M(BaseModel):
        a: int = 0

    with pytest.raises(ConfigError) as exc:
        parse_model(raw, M, path="x.json", fix="rebuild it: cyclebox images build")
    assert exc.value.fix == "rebuild it: cyclebox images build"
    assert detail in str(exc.value) and "int_max_str_digits" not in str(exc.value)
