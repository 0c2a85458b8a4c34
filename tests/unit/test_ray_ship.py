"""Shipping an image to Ray nodes, without Ray or Docker: chunking and caps, the window
of chunks in flight, the node's loader against a fake engine (our own seam), the head's
decision (ship, refuse, or nothing to do), and gc of a killed loader's file.

The real transfer (a second Docker engine behind one node) is in
tests/integration/test_ray_ship.py.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from dataclasses import asdict
from pathlib import Path

import pytest

from runner.errors import PrerequisiteError
from runner.isolation.owner import current_owner
from runner.isolation.ray import node as node_side
from runner.isolation.ray.backend import RaySandbox
from runner.isolation.ray.ship import Received, pump, rechunk

NODE = "a" * 56
HEAD_ID = "sha256:" + "1" * 64
OTHER_ID = "sha256:" + "2" * 64


# -- chunking and caps -------------------------------------------------------------------

def test_rechunk_gives_exact_chunks_and_the_same_bytes() -> None:
    pieces = [bytes([i]) * n for i, n in enumerate([3, 7, 1, 0, 12, 5])]
    out = list(rechunk(iter(pieces), size=8, cap=1000))
    assert b"".join(out) == b"".join(pieces)
    assert [len(c) for c in out] == [8, 8, 8, 4]
    assert list(rechunk(iter([]), size=8, cap=10)) == []


def test_rechunk_stops_past_the_cap_before_yielding_the_excess() -> None:
    got: list[bytes] = []
    with pytest.raises(PrerequisiteError, match="larger than 20 bytes"):
        for c in rechunk(iter([b"x" * 8] * 10), size=8, cap=20, what="image t"):
            got.append(c)
    assert sum(map(len, got)) <= 20
    assert b"".join(rechunk(iter([b"x" * 20]), size=8, cap=20)) == b"x" * 20


class Ref:
    def __init__(self, data: bytes) -> None:
        self.data = data


def test_pump_keeps_at_most_two_chunks_in_flight_and_no_reference_to_them() -> None:
    live: list[int] = []
    events: list[str] = []
    sent: list[tuple[int, weakref.ref[Ref]]] = []

    def put(data: bytes) -> Ref:
        live.append(len(data))
        events.append(f"put{len(live)}")
        return Ref(data)

    def send(ref: Ref) -> tuple[int, weakref.ref[Ref]]:
        h = (len(sent) + 1, weakref.ref(ref))
        sent.append(h)
        return h

    def settle(h: tuple[int, weakref.ref[Ref]]) -> None:
        n, ref = h
        # the pump itself holds nothing: only the loaders' calls keep a chunk alive
        assert ref() is None
        unsettled = len(live) - sum(1 for e in events if e.startswith("settle"))
        assert unsettled <= 2
        events.append(f"settle{n}")

    count, total = pump(iter([b"a" * 5, b"b" * 5, b"c" * 5, b"d" * 2]), put, send, settle)
    assert (count, total) == (4, 17)
    assert events == ["put1", "put2", "settle1", "put3", "settle2", "put4", "settle3",
                      "settle4"]


def test_a_failed_chunk_stops_the_pump() -> None:
    def settle(h: int) -> None:
        if h == 2:
            raise PrerequisiteError("node n did not answer")

    puts: list[bytes] = []
    with pytest.raises(PrerequisiteError, match="did not answer"):
        pump(iter([b"x"] * 10), lambda d: puts.append(d) or len(puts), lambda r: r, settle)
    assert len(puts) == 3  # chunk 2 settles when chunk 3 is in flight, never later


def test_received_caps_bytes_and_chunks() -> None:
    r = Received(max_bytes=10, max_chunks=3)
    r.take(4)
    r.take(6)
    with pytest.raises(PrerequisiteError, match="more than 10 bytes"):
        r.take(1)
    r = Received(max_bytes=100, max_chunks=2)
    r.take(0)
    r.take(1)
    with pytest.raises(PrerequisiteError, match="more than 2 chunks"):
        r.take(1)


# -- the node's loader -------------------------------------------------------------------

class Engine:
    """A node engine at our seam (:class:`node_side.ImageEngine`)."""

    def __init__(self, names: dict[str, str] | None = None, loads_as: str = HEAD_ID) -> None:
        self.names = dict(names or {})
        self.loads_as = loads_as
        self.loaded: list[bytes] = []

    def load_image(self, archive: Path) -> None:
        self.loaded.append(archive.read_bytes())
        self.names[self.loads_as] = self.loads_as

    def image_id(self, ref: str) -> str | None:
        return self.names.get(ref)

    def tag_image(self, image_id: str, ref: str) -> None:
        self.names[ref] = image_id


@pytest.fixture
def node_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(node_side.NODE_DIR_ENV, str(tmp_path / "nodes"))
    return tmp_path / "nodes" / NODE[:16] / node_side.LOADS


def test_a_loader_writes_loads_checks_the_id_and_removes_its_file(node_dir: Path) -> None:
    ld = node_side.ImageLoader(NODE, HEAD_ID, "cbx/x:1")
    assert ld.work.parent == node_dir and (ld.work / node_side.OWNER_NAME).is_file()
    assert ld.work.name.startswith(f"{os.getpid()}-")
    assert ld.write(b"abc") == 3 and ld.write(b"de") == 5
    engine = Engine()
    assert ld.finish(engine) == HEAD_ID
    assert engine.loaded == [b"abcde"]
    assert engine.names["cbx/x:1"] == HEAD_ID  # the name given only where it named nothing
    assert not ld.work.exists()
    with pytest.raises(PrerequisiteError, match="already ended"):
        ld.write(b"late")


def test_a_loader_never_renames_another_image_and_checks_what_loaded(node_dir: Path) -> None:
    ld = node_side.ImageLoader(NODE, HEAD_ID, "cbx/x:1")
    ld.write(b"tar")
    engine = Engine({"cbx/x:1": OTHER_ID})
    with pytest.raises(PrerequisiteError, match=f"cbx/x:1 names {OTHER_ID}, not the head's"):
        ld.finish(engine)
    assert engine.names["cbx/x:1"] == OTHER_ID and not ld.work.exists()
    # the tar held another image than the head announced
    ld = node_side.ImageLoader(NODE, HEAD_ID, HEAD_ID)
    ld.write(b"tar")
    with pytest.raises(PrerequisiteError, match=f"is not {HEAD_ID}"):
        ld.finish(Engine(loads_as=OTHER_ID))
    assert not ld.work.exists()


def test_a_loader_past_its_cap_removes_what_it_wrote(node_dir: Path) -> None:
    ld = node_side.ImageLoader(NODE, HEAD_ID, HEAD_ID, max_bytes=4)
    ld.write(b"1234")
    with pytest.raises(PrerequisiteError, match="more than 4 bytes"):
        ld.write(b"5")
    assert not ld.work.exists()
    assert list(node_dir.iterdir()) == []


def test_gc_removes_the_load_file_of_a_killed_loader_only(node_dir: Path) -> None:
    alive = node_side.ImageLoader(NODE, HEAD_ID, HEAD_ID)
    dead = node_side.ImageLoader(NODE, HEAD_ID, HEAD_ID)
    dead.write(b"partial image")
    me = current_owner()
    (dead.work / node_side.OWNER_NAME).write_text(
        json.dumps({**asdict(me), "start": me.start + 1}))  # that process is gone
    # killed before its owner record was written: judged by the pid-start name
    bare = node_dir / f"{me.pid}-{me.start + 1}-xyz"
    bare.mkdir()
    rows = node_side.sweep_scratch(dry_run=False)
    by_name = {Path(r.name).name: r for r in rows}
    assert by_name[dead.work.name].removed and by_name[bare.name].removed
    assert by_name[dead.work.name].kind == "node_load_dir"
    assert not by_name[alive.work.name].removed
    assert alive.work.is_dir() and not dead.work.exists() and not bare.exists()
    alive.abort()


# -- the head's decision -----------------------------------------------------------------

class Head(RaySandbox):
    """The head's image decision with the cluster and the engine as our own seams."""

    def __init__(self, nodes: dict[str, str | None], head: str | None,
                 loads: str | None = None) -> None:
        self.resource = "cyclebox"
        self._ship_lock = threading.Lock()
        self.nodes_have = dict(nodes)
        self.head = head
        self.loads = loads
        self.shipped: list[tuple[str, str, list[str]]] = []

    def _node_ids(self, ref: str) -> dict[str, str | None]:
        return dict(self.nodes_have)

    def _head_image(self, ref: str) -> str | None:
        return self.head

    def _ship(self, ref: str, head_id: str, nodes: list[str]) -> None:
        self.shipped.append((ref, head_id, nodes))
        for n in nodes:
            self.nodes_have[n] = self.loads or head_id


def test_the_head_ships_exactly_to_the_nodes_that_lack_the_image() -> None:
    h = Head({"n1": HEAD_ID, "n2": None, "n3": None}, HEAD_ID)
    assert h.image_id("ref") == HEAD_ID
    assert h.shipped == [("ref", HEAD_ID, ["n2", "n3"])]
    # nothing missing: nothing shipped, the head's engine not needed
    h = Head({"n1": HEAD_ID, "n2": HEAD_ID}, None)
    assert h.image_id("ref") == HEAD_ID and h.shipped == []
    # no node has it: all get it
    h = Head({"n1": None, "n2": None}, HEAD_ID)
    assert h.image_id("ref") == HEAD_ID and h.shipped == [("ref", HEAD_ID, ["n1", "n2"])]


def test_without_the_image_on_the_head_nothing_ships_and_the_nodes_are_named() -> None:
    assert Head({"n1": None, "n2": None}, None).image_id("ref") is None
    h = Head({"node-one-0000x": HEAD_ID, "node-two-0000x": None}, None)
    with pytest.raises(PrerequisiteError, match=r"missing on \['node-two-000'\]"):
        h.image_id("ref")
    assert h.shipped == []


def test_a_different_image_under_the_name_is_refused_never_overwritten() -> None:
    h = Head({"n1": OTHER_ID, "n2": None}, HEAD_ID)
    with pytest.raises(PrerequisiteError) as exc:
        h.image_id("cbx/x:1")
    msg = str(exc.value)
    assert f"node n1 has {OTHER_ID}" in msg and f"the head has {HEAD_ID}" in msg
    assert "nothing was overwritten" in msg and "Fix:" in msg
    assert h.shipped == []
    # nodes that disagree among themselves: named against the head's id when it has one
    h = Head({"n1": OTHER_ID, "n2": HEAD_ID}, HEAD_ID)
    with pytest.raises(PrerequisiteError, match=f"the head has {HEAD_ID}; node n1 has "
                                                f"{OTHER_ID}\\)"):
        h.image_id("cbx/x:1")
    h = Head({"n1": OTHER_ID, "n2": HEAD_ID}, None)
    with pytest.raises(PrerequisiteError, match=r"the nodes disagree; node n1 has .*, node n2"):
        h.image_id("cbx/x:1")
    assert h.shipped == []


def test_a_node_that_does_not_report_the_heads_id_after_shipping_is_named() -> None:
    h = Head({"n1": HEAD_ID, "n2": None}, HEAD_ID, loads=OTHER_ID)
    with pytest.raises(PrerequisiteError, match=f"node n2 has {OTHER_ID}"):
        h.image_id("ref")
