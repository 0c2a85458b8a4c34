"""`images gc` / `images list` over a fake engine (helper-43 #1, #2): only an image tagged
``cyclebox/analyst-deps:<h>`` with its own input hash ``<h>`` is cyclebox's (labels are
inherited by images built FROM it), only that tag is ever removed, and a hold from ANY
state directory of the user keeps the image."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runner.isolation.docker.agent_image import (
    REQUIREMENTS_LABEL,
    STATE_LABEL,
    TAG_REPO,
    derived_images,
    gc_derived,
)

ROOT = Path(__file__).resolve().parents[2]


class FakeApi:
    def __init__(self, images: list[dict[str, Any]]) -> None:
        self._images = images
        self.removed: list[str] = []

    def containers(self, all: bool = False) -> list[dict[str, Any]]:
        return []

    def images(self, filters: dict[str, str]) -> list[dict[str, Any]]:
        assert filters == {"label": REQUIREMENTS_LABEL}
        return self._images

    def remove_image(self, ref: str, force: bool = False, noprune: bool = False) -> None:
        assert not force
        self.removed.append(ref)


def _image(n: int, tags: list[str], ih: str, state: Path) -> dict[str, Any]:
    return {"Id": f"sha256:{n:064x}", "RepoTags": tags, "Size": 1000, "Labels": {
        REQUIREMENTS_LABEL: "0" * 64, "io.cyclebox.input_hash": ih,
        "io.cyclebox.base": "sha256:" + "1" * 64, STATE_LABEL: str(state)}}


@pytest.fixture()
def engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    def install(images: list[dict[str, Any]]) -> FakeApi:
        api = FakeApi(images)

        class Fake:
            def __init__(self) -> None:
                self.client = type("C", (), {"api": api})()

        from runner.isolation.docker import backend

        monkeypatch.setattr(backend, "DockerSandbox", Fake)
        return api

    monkeypatch.setenv("CYCLEBOX_HOLDS_DIR", str(tmp_path / "cache" / "image-use"))
    return install


def test_only_our_own_tag_makes_an_image_cyclebox_s_and_only_that_tag_is_removed(
        engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    monkeypatch.setenv("CYCLEBOX_STATE_DIR", str(state))
    ih = [f"{i}" * 64 for i in "abcd"]
    api = engine([
        _image(1, [f"{TAG_REPO}:{ih[0][:16]}"], ih[0], state.resolve()),  # ours
        _image(2, ["myorg/app:1"], ih[0], state.resolve()),  # FROM ours: inherited labels
        _image(3, [f"{TAG_REPO}:{ih[2][:16]}", "mine:keep"], ih[2], state.resolve()),
        _image(4, [f"{TAG_REPO}:{'e' * 16}"], ih[3], state.resolve()),  # hash mismatch
        _image(5, [], ih[1], state.resolve()),  # untagged
    ])
    rows = {r.id[-1]: r for r in gc_derived()}
    assert api.removed == [f"{TAG_REPO}:{ih[0][:16]}", f"{TAG_REPO}:{ih[2][:16]}"]
    assert not any(rows[k].removed for k in "245")
    assert "not cyclebox's" in rows["2"].reason and "mine:keep" in rows["3"].reason
    listed = {d.id[-1]: d for d in derived_images()}
    assert [k for k, d in sorted(listed.items()) if d.cyclebox] == ["1", "3"]
    assert listed["2"].tag == "myorg/app:1" and listed["3"].other_tags == ("mine:keep",)


def test_a_hold_from_another_state_directory_keeps_the_image(
        engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """State A built the image; state B reused its tag (the label still names A) and a
    live B process holds it: gc in A must keep it."""
    a, b = tmp_path / "stateA", tmp_path / "stateB"
    ih = "f" * 64
    img = _image(7, [f"{TAG_REPO}:{ih[:16]}"], ih, a.resolve())
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom runner.isolation import image_use\n"
         f"image_use.hold([{img['Id']!r}])\nprint('held', flush=True)\ntime.sleep(60)"],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "CYCLEBOX_STATE_DIR": str(b),
             "CYCLEBOX_HOLDS_DIR": str(tmp_path / "cache" / "image-use"), "HOME": str(tmp_path)},
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        monkeypatch.setenv("CYCLEBOX_STATE_DIR", str(a))
        api = engine([img])
        row, = gc_derived()
        assert not row.removed and "live cyclebox process" in row.reason, row
        assert api.removed == []
    finally:
        holder.kill()
        holder.wait()
    row, = gc_derived()  # the holder is gone: removed
    assert row.removed and api.removed == [f"{TAG_REPO}:{ih[:16]}"]



def test_holds_do_not_depend_on_the_environment_and_follow_no_link(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """helper-48 #4, #5: a run started with another XDG_CACHE_HOME (sudo, systemd, an
    IDE) held its image in another directory, so gc saw it unused; and a planted
    <id>.lock link made the hold create a file where it pointed."""
    from runner.isolation import image_use

    monkeypatch.delenv("CYCLEBOX_HOLDS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-a"))
    monkeypatch.setenv("HOME", str(tmp_path / "home-a"))
    first = image_use.holds_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-b"))
    monkeypatch.setenv("HOME", str(tmp_path / "home-b"))
    assert image_use.holds_dir() == first and str(tmp_path) not in str(first)
    monkeypatch.setenv("CYCLEBOX_HOLDS_DIR", str(tmp_path / "holds"))
    (tmp_path / "holds").mkdir()
    target = tmp_path / "created-elsewhere"
    (tmp_path / "holds" / ("e" * 64 + ".lock")).symlink_to(target)
    with pytest.raises(OSError):
        image_use._open(tmp_path / "holds" / ("e" * 64 + ".lock"))
    assert not target.exists()
