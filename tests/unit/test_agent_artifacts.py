"""inputs/agent-artifacts.json from what the derived-image builder returns: wheel names
and versions from PEP 427 file names, the wheel set checked against its digest, the
list kept per image for a reuse, and the canonical, sorted record with package URLs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from runner.cycle.artifacts import Artifact, ArtifactList, artifact_record
from runner.errors import PrerequisiteError
from runner.isolation.docker import agent_image
from runner.isolation.docker.images import WHEEL_SUMS, wheel_set_digest
from runner.isolation.docker.toolchain_stages import wheel_file, wheel_files
from runner.toolchain import ResolvedFile

SHA = "ab" * 32


def test_a_wheel_file_name_gives_the_normalised_project_and_version() -> None:
    assert wheel_file("typing_extensions-4.12.2-py3-none-any.whl", SHA) == ResolvedFile(
        "pypi", "typing-extensions", "4.12.2", "typing_extensions-4.12.2-py3-none-any.whl",
        SHA)
    built = wheel_file("Foo.Bar-1.0-2-cp311-cp311-manylinux_2_17_x86_64.whl", SHA)
    assert (built.name, built.version) == ("foo-bar", "1.0")
    for bad in ("humanize-4.12.3.tar.gz", "x-1-py3.whl"):
        with pytest.raises(PrerequisiteError, match="not a wheel file name"):
            wheel_file(bad, SHA)


def _wheels(d: Path, files: dict[str, bytes], *, sums: bool = True) -> str:
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    table = {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
    if sums:
        (d / WHEEL_SUMS).write_text("".join(f"{h}  {n}\n" for n, h in sorted(table.items())))
    return wheel_set_digest(table)


def test_the_wheels_listed_are_exactly_the_set_the_digest_covers(tmp_path: Path) -> None:
    files = {"b_pkg-2.0-py3-none-any.whl": b"b", "a-1.0-py3-none-any.whl": b"a"}
    digest = _wheels(tmp_path / "w", files)
    got = wheel_files(tmp_path / "w", digest)
    assert [(f.name, f.version, f.sha256) for f in got] == [
        ("a", "1.0", hashlib.sha256(b"a").hexdigest()),
        ("b-pkg", "2.0", hashlib.sha256(b"b").hexdigest())]
    # a directory cached before the sums were kept: hashed once, same answer
    old = _wheels(tmp_path / "old", files, sums=False)
    assert old == digest and wheel_files(tmp_path / "old", old) == got
    assert (tmp_path / "old" / WHEEL_SUMS).read_text() == (tmp_path / "w" / WHEEL_SUMS
                                                            ).read_text()
    (tmp_path / "w" / "c-1-py3-none-any.whl").write_bytes(b"c")  # slipped in later
    with pytest.raises(PrerequisiteError, match=r"not the set their \.digest names"):
        wheel_files(tmp_path / "w", digest)
    with pytest.raises(PrerequisiteError, match="not the set"):
        wheel_files(tmp_path / "old", "0" * 64)


def test_the_list_is_kept_per_image_and_a_damaged_copy_is_recomputed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CYCLEBOX_STATE_DIR", str(tmp_path))
    files = [ResolvedFile("npm", "tsx", "4.0.0", "tsx-4.0.0.tgz", SHA),
             ResolvedFile("deb", "jq", "1.6", "jq_1.6_amd64.deb", "cd" * 32)]
    stored = agent_image._store_artifacts("h" * 64, [*files, files[0]])
    assert stored == tuple(sorted(files))
    assert agent_image._stored_artifacts("h" * 64) == stored
    assert agent_image._stored_artifacts("other") is None
    path = tmp_path / "agent" / "artifacts" / f"{'h' * 64}.json"
    for damaged in ("not json", "{}", json.dumps([{"name": "x"}]),
                    json.dumps([{**vars(files[0]), "sha256": "zz"}]),
                    json.dumps([vars(files[0]), {"name": "x"}])):  # never a partial list
        path.write_text(damaged)
        assert not agent_image._stored_artifacts("h" * 64), damaged


def test_the_record_is_canonical_sorted_and_deduplicated() -> None:
    whl = ResolvedFile("pypi", "humanize", "4.12.3", "humanize-4.12.3-py3-none-any.whl", SHA)
    npm = ResolvedFile("npm", "@types/node", "20.1.0", "node-20.1.0.tgz", SHA)
    data = artifact_record([whl, npm, npm])
    doc = ArtifactList.model_validate_json(data)
    assert [a.name for a in doc.artifacts] == ["@types/node", "humanize"]
    assert data == artifact_record([npm, whl])
    assert b" " not in data and json.loads(data)["schema"] == 1
    with pytest.raises(ValueError, match="sha256"):
        artifact_record([ResolvedFile("pypi", "x", "1", "x-1-py3-none-any.whl", "X")])


def test_package_urls_follow_the_purl_spec() -> None:
    def purl(eco: str, name: str, version: str) -> str:
        return Artifact.model_validate({"ecosystem": eco, "name": name, "version": version,
                                        "filename": "f", "sha256": SHA}).purl()

    assert purl("pypi", "humanize", "4.12.3") == "pkg:pypi/humanize@4.12.3"
    assert purl("npm", "@types/node", "20.1.0") == "pkg:npm/%40types/node@20.1.0"
    assert purl("npm", "tsx", "4.23.15") == "pkg:npm/tsx@4.23.15"
    assert purl("deb", "nodejs", "1:18.20.4+dfsg-1~deb12u1") == (
        "pkg:deb/debian/nodejs@1%3A18.20.4%2Bdfsg-1~deb12u1")
