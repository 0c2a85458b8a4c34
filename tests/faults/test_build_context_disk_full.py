"""A full disk while `images build` assembles a role's build context.

The context (Dockerfile, requirements, wheels, sandbox files) is written under the state
directory; a small tmpfs stands in for it. Expect an environment failure (exit 9) and no
partial context left behind; the same for a failure of the build itself.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.errors import EXIT_ENVIRONMENT, SandboxError
from runner.failures import classify
from runner.isolation.docker import images


@pytest.fixture
def small_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root")
    mnt = tmp_path / "state"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mnt)],
                   check=True)
    monkeypatch.setenv("CYCLEBOX_STATE_DIR", str(mnt))
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _wheels(root: Path, megabytes: int) -> Path:
    w = root / "wheels"
    w.mkdir()
    (w / "big-1.0-py3-none-any.whl").write_bytes(os.urandom(megabytes << 20))
    return w


def test_full_disk_while_assembling_leaves_no_partial_context(tmp_path: Path,
                                                              small_state: Path) -> None:
    wheels = _wheels(tmp_path, 2)  # another file system: copied, and larger than the disk
    with pytest.raises(OSError) as info:
        images._assemble_context("analyst", wheels, images.load_inputs())
    assert classify(info.value).exit_code == EXIT_ENVIRONMENT
    assert not (small_state / "context" / "analyst").exists()


def test_failed_build_leaves_no_context(tmp_path: Path, small_state: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine fails mid-build (its own disk full, say): the context goes too."""
    wheels = _wheels(tmp_path, 0)
    (wheels / ".digest").write_text("0" * 64)

    from runner.isolation.docker import backend as docker_backend

    class FailingBuild(docker_backend.DockerSandbox):
        def __init__(self) -> None:
            pass

        def image_id(self, ref: str) -> str | None:
            return "sha256:" + "1" * 64 if ref.startswith("cyclebox/base") else None

        def build(self, *_a: object, **_k: object) -> Iterator[str]:
            yield "step 1"
            raise SandboxError("no space left on device (engine)")

    monkeypatch.setattr("runner.isolation.registry.get_sandbox", lambda _name: FailingBuild())
    monkeypatch.setattr(images, "ensure_base", lambda _log: "cyclebox/base:fake")
    monkeypatch.setattr(images, "ensure_wheels", lambda *_a, **_k: wheels)
    with pytest.raises(SandboxError):
        images.build_roles(["analyst"], lambda _line: None)
    assert not (small_state / "context" / "analyst").exists()
