"""What a Ray node process trusts on its own host (no Ray started): its node directory
must be its own before a cached input in it is mounted into a role container.

The node's Docker backend is replaced at its seam (``node._docker``) by a recorder.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runner.errors import SandboxError
from runner.isolation.ray import node as node_side
from runner.isolation.ray.archive import ENTRY, digest, pack_input
from runner.isolation.sandbox import Mount, Resources, RunRecord, RunSpec, StopReason

NODE = "f" * 40
OTHER_UID = 54321


class Recorder:
    """Stands in for the node's DockerSandbox: keeps each spec it was asked to run."""

    def __init__(self) -> None:
        self.specs: list[RunSpec] = []

    def run(self, spec: RunSpec) -> RunRecord:
        self.specs.append(spec)
        return RunRecord(run_id=spec.run_id, role=spec.role, image_id=spec.image,
                         container_name="c", exit_code=0, stop_reason=StopReason.OK,
                         wall_s=0.1, stdout_bytes=0, stderr_bytes=0, stdout_tail="",
                         stderr_tail="", cleanup_confirmed=True)


@pytest.fixture()
def docker(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    rec = Recorder()
    monkeypatch.setattr(node_side, "_docker", rec)
    monkeypatch.setattr(node_side, "node_id", lambda: NODE)
    yield rec


def run_with_input(tmp_path: Path) -> tuple[RunSpec, list[tuple[int, str, list[Any]]]]:
    src = tmp_path / "project"
    src.mkdir()
    (src / "task.txt").write_text("the operator's input")
    data = pack_input(src)
    spec = RunSpec(run_id="r1", role="analyst", image="sha256:" + "0" * 64,
                   command=("true",), user="1000:1000",
                   mounts=(Mount(source=src, target="/in"),),
                   resources=Resources(memory_bytes=1 << 28, cpus=1, pids=64), timeout_s=10)
    return spec, [(0, digest(data), [None])]  # a cache hit never fetches the ref


def plant(base: Path, sha: str) -> Path:
    """What another local user leaves in the cache: an input of their own under the
    digest the head will ask for."""
    fake = base / "inputs" / sha / ENTRY
    fake.mkdir(parents=True)
    (fake / "task.txt").write_text("an attacker's input")
    return fake


@pytest.mark.skipif(os.getuid() != 0, reason="makes a directory of another uid")
def test_a_node_dir_made_first_by_another_user_is_refused_before_its_cache_is_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker: Recorder) -> None:
    root = tmp_path / "cyclebox-ray-0"
    monkeypatch.setenv(node_side.NODE_DIR_ENV, str(root))
    spec, inputs = run_with_input(tmp_path)
    # another user of the node squats the predictable /tmp name and plants the input
    root.mkdir(mode=0o755)
    fake = plant(root / NODE[:16], inputs[0][1])
    for p in (root, *root.rglob("*")):
        os.chown(p, OTHER_UID, OTHER_UID)
    with pytest.raises(SandboxError, match=f"owned by uid {OTHER_UID}.*CYCLEBOX_RAY_NODE_DIR"):
        node_side.run(spec, inputs, None, None)
    assert docker.specs == [], f"a container was started with {fake}"


def test_a_symlinked_or_world_writable_node_dir_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker: Recorder) -> None:
    spec, inputs = run_with_input(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    plant(elsewhere / NODE[:16], inputs[0][1])
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    monkeypatch.setenv(node_side.NODE_DIR_ENV, str(link))
    with pytest.raises(SandboxError, match="is a symlink"):
        node_side.run(spec, inputs, None, None)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    plant(shared / NODE[:16], inputs[0][1])
    monkeypatch.setenv(node_side.NODE_DIR_ENV, str(shared))
    with pytest.raises(SandboxError, match="writable by other users"):
        node_side.run(spec, inputs, None, None)
    assert docker.specs == []


def test_the_node_dir_is_made_private_and_its_cache_then_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker: Recorder) -> None:
    root = tmp_path / "made" / "here"
    monkeypatch.setenv(node_side.NODE_DIR_ENV, str(root))
    spec, inputs = run_with_input(tmp_path)
    base = node_side.own_base(NODE)
    cached = plant(base, inputs[0][1])  # the node's own earlier fetch
    answer = node_side.run(spec, inputs, None, None)
    assert answer["record"].stop_reason is StopReason.OK
    assert docker.specs[0].mounts[0].source == cached
    for d in (root, base, base / "inputs", base / "runs"):
        assert d.stat().st_mode & 0o777 == 0o711, d  # other users may not list
