"""What a Ray node process trusts on its own host, and what the head takes from a node
(no Ray started): the node directory must be the node user's own before a cached input
in it is mounted into a role container; a node's answer must be a record of the very
run the head asked for, within bounds.

The node's Docker backend is replaced at its seam (``node._docker``) by a recorder.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runner.errors import OutputRejected, SandboxError
from runner.isolation.docker.backend import TAIL_BYTES
from runner.isolation.ray import node as node_side
from runner.isolation.ray.archive import ENTRY, digest, pack_input
from runner.isolation.ray.backend import ANSWER_TEXT_MAX, TAR_ENTRY_OVERHEAD, take_answer
from runner.isolation.sandbox import Mount, Resources, RunRecord, RunSpec, StopReason

NODE = "f" * 40
OTHER_UID = 54321


class Prepared:
    """Stands in for a DockerPreparedRun: counts its runs and discards."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.runs = 0
        self.discards = 0

    def run(self) -> RunRecord:
        self.runs += 1
        spec = self.spec
        return RunRecord(run_id=spec.run_id, role=spec.role, image_id=spec.image,
                         container_name="c", exit_code=0, stop_reason=StopReason.OK,
                         wall_s=0.1, stdout_bytes=0, stderr_bytes=0, stdout_tail="",
                         stderr_tail="", cleanup_confirmed=True)

    def discard(self) -> None:
        self.discards += 1


class Recorder:
    """Stands in for the node's DockerSandbox: keeps each spec it was asked to prepare."""

    def __init__(self) -> None:
        self.specs: list[RunSpec] = []
        self.prepared: list[Prepared] = []

    def prepare(self, spec: RunSpec) -> Prepared:
        self.specs.append(spec)
        self.prepared.append(Prepared(spec))
        return self.prepared[-1]


@pytest.fixture()
def docker(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    rec = Recorder()
    monkeypatch.setattr(node_side, "_docker", rec)
    monkeypatch.setattr(node_side, "node_id", lambda: NODE)
    yield rec


@pytest.fixture()
def words(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The head's words by key (the mailbox actor's seam): a key without one is RUN."""
    said: dict[str, str] = {}
    monkeypatch.setattr(node_side, "_word",
                        lambda _mailbox, key: said.pop(key, node_side.RUN))
    # a word already there before the container is built ("early:KEY")
    monkeypatch.setattr(node_side, "_peek",
                        lambda _mailbox, key: said.pop(f"early:{key}", ""))
    return said


def serve(spec: RunSpec, inputs: list[tuple[int, str, list[Any]]],
          key: str = "k1") -> dict[str, Any]:
    return node_side.serve(spec, inputs, None, None, key, None)


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
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker: Recorder,
        words: dict[str, str]) -> None:
    root = tmp_path / "cyclebox-ray-0"
    monkeypatch.setenv(node_side.NODE_DIR_ENV, str(root))
    spec, inputs = run_with_input(tmp_path)
    # another user of the node squats the predictable /tmp name and plants the input
    root.mkdir(mode=0o755)
    fake = plant(root / NODE[:16], inputs[0][1])
    for p in (root, *root.rglob("*")):
        os.chown(p, OTHER_UID, OTHER_UID)
    with pytest.raises(SandboxError, match=f"owned by uid {OTHER_UID}.*CYCLEBOX_RAY_NODE_DIR"):
        serve(spec, inputs)
    assert docker.specs == [], f"a container was started with {fake}"


def test_a_symlinked_or_world_writable_node_dir_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker: Recorder,
        words: dict[str, str]) -> None:
    spec, inputs = run_with_input(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    plant(elsewhere / NODE[:16], inputs[0][1])
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    monkeypatch.setenv(node_side.NODE_DIR_ENV, str(link))
    with pytest.raises(SandboxError, match="is a symlink"):
        serve(spec, inputs)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    plant(shared / NODE[:16], inputs[0][1])
    monkeypatch.setenv(node_side.NODE_DIR_ENV, str(shared))
    with pytest.raises(SandboxError, match="writable by other users"):
        serve(spec, inputs)
    assert docker.specs == []


def test_the_node_dir_is_made_private_and_its_cache_then_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker: Recorder,
        words: dict[str, str]) -> None:
    root = tmp_path / "made" / "here"
    monkeypatch.setenv(node_side.NODE_DIR_ENV, str(root))
    spec, inputs = run_with_input(tmp_path)
    base = node_side.own_base(NODE)
    cached = plant(base, inputs[0][1])  # the node's own earlier fetch
    answer = serve(spec, inputs)
    assert answer["record"].stop_reason is StopReason.OK
    assert docker.specs[0].mounts[0].source == cached
    for d in (root, base, base / "inputs", base / "runs"):
        assert d.stat().st_mode & 0o777 == 0o711, d  # other users may not list


def test_a_prepared_container_runs_once_on_the_heads_word_and_is_removed_unrun_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker: Recorder,
        words: dict[str, str]) -> None:
    monkeypatch.setenv(node_side.NODE_DIR_ENV, str(tmp_path / "nodes"))
    spec, inputs = run_with_input(tmp_path)
    node_side.own_base(NODE)
    plant(node_side.node_base(NODE), inputs[0][1])
    got = serve(spec, inputs, "ran")
    assert got["record"].stop_reason is StopReason.OK
    ran = docker.prepared[-1]
    assert (ran.runs, ran.discards) == (1, 1)  # the discard after a run is a no-op there
    words["gone"] = "discard"
    assert serve(spec, inputs, "gone") == {"discarded": True, "node": NODE}
    gone = docker.prepared[-1]
    assert (gone.runs, gone.discards) == (0, 1)
    # discarded while its task waited for a node slot: nothing is built at all
    words["early:never"] = "discard"
    built = len(docker.prepared)
    assert serve(spec, inputs, "never") == {"discarded": True, "node": NODE}
    assert len(docker.prepared) == built
    # the word that never comes (the head died: the mailbox went with it) removes it too
    def lost(_mailbox: object, _key: str) -> str:
        raise RuntimeError("ActorDiedError: the mailbox is gone")
    monkeypatch.setattr(node_side, "_word", lost)
    with pytest.raises(RuntimeError, match="mailbox is gone"):
        serve(spec, inputs, "orphan")
    orphan = docker.prepared[-1]
    assert (orphan.runs, orphan.discards) == (0, 1)
    # every run directory (relay socket, output) is gone with its task
    assert list((node_side.node_base(NODE) / "runs").iterdir()) == []


def test_the_mailbox_delivers_one_word_per_key_whichever_comes_first() -> None:
    import asyncio

    async def go() -> None:
        box = node_side.Mailbox()
        await box.put("a", node_side.RUN)          # the word before its waiter
        assert await box.wait("a") == node_side.RUN
        waiter = asyncio.ensure_future(box.wait("b"))
        await asyncio.sleep(0)
        assert not waiter.done()                   # no word yet: the task keeps waiting
        await box.put("b", "discard")
        assert await waiter == "discard"
        await box.put("c", node_side.RUN)          # its task was refused before it waited
        await box.drop("c")
        assert await box.size() == 0               # nothing kept per key once delivered

    asyncio.run(go())


# -- what the head accepts from a node ----------------------------------------------------

def asked(tmp_path: Path) -> RunSpec:
    return RunSpec(run_id="r1", role="analyst", image="sha256:" + "0" * 64,
                   command=("true",), user="1000:1000", output_dir=tmp_path / "out",
                   resources=Resources(memory_bytes=1 << 28, cpus=1, pids=64), timeout_s=10,
                   output_cap_bytes=1 << 20, output_max_entries=100,
                   labels=(("io.cyclebox.case", "c1"), ("io.cyclebox.trial", "0")))


def answer(spec: RunSpec, node: str = NODE, output: object = b"", **update: Any
           ) -> dict[str, Any]:
    rec = RunRecord(run_id=spec.run_id, role=spec.role, image_id=spec.image,
                    container_name="c", exit_code=0, stop_reason=StopReason.OK, wall_s=0.1,
                    stdout_bytes=0, stderr_bytes=0, stdout_tail="", stderr_tail="",
                    cleanup_confirmed=True,
                    labels={**dict(spec.labels), node_side.NODE_LABEL: node})
    return {"record": rec.model_copy(update=update), "output": output, "node": node}


def test_the_head_takes_a_nodes_record_only_for_the_run_it_asked(tmp_path: Path) -> None:
    spec = asked(tmp_path)
    rec, out = take_answer(spec, NODE, answer(spec))
    assert rec.run_id == "r1" and out == b""
    other = {**dict(spec.labels), "io.cyclebox.case": "c2", node_side.NODE_LABEL: NODE}
    for forged, field in [(answer(spec, run_id="r2"), "run_id"),
                          (answer(spec, role="worker"), "role"),
                          (answer(spec, image_id="sha256:" + "1" * 64), "image_id"),
                          (answer(spec, labels=other), "labels[io.cyclebox.case]"),
                          (answer(spec, node="e" * 40), "labels[io.cyclebox.node]")]:
        with pytest.raises(SandboxError, match=rf"node ffffffffffff .*{re.escape(field)}"):
            take_answer(spec, NODE, forged)


def test_the_head_refuses_a_nodes_answer_beyond_its_bounds(tmp_path: Path) -> None:
    spec = asked(tmp_path)
    huge = "x" * (ANSWER_TEXT_MAX + 1)
    bound = spec.output_cap_bytes + (spec.output_max_entries + 2) * TAR_ENTRY_OVERHEAD
    labels = {**dict(spec.labels), node_side.NODE_LABEL: NODE}
    for bad, field in [(answer(spec, stdout_tail="y" * (TAIL_BYTES + 1)), "stdout_tail"),
                       (answer(spec, detail=huge), "detail"),
                       (answer(spec, labels={**labels, "k": huge}), "labels"),
                       (answer(spec, labels={**labels, **{f"k{i}": "" for i in range(99)}}),
                        "labels"),
                       (answer(spec, output=b"\0" * (bound + 1)), "output")]:
        with pytest.raises(SandboxError, match=f"beyond its bounds.*{field}"):
            take_answer(spec, NODE, bad)


def test_the_head_refuses_what_is_not_a_nodes_answer_and_cuts_a_nodes_error(
        tmp_path: Path) -> None:
    spec = asked(tmp_path)
    rec = answer(spec)["record"]
    for bad in (rec, None, {"record": rec.model_dump()}, {**answer(spec), "output": "text"}):
        with pytest.raises(SandboxError, match="node ffffffffffff answered"):
            take_answer(spec, NODE, bad)
    error = {"error": "OutputRejected", "message": "\x1b]0;pwned\x07" + "z" * 10**6}
    with pytest.raises(OutputRejected) as got:
        take_answer(spec, NODE, error)
    assert "\x1b" not in str(got.value) and len(str(got.value)) < ANSWER_TEXT_MAX + 100


def test_concurrent_misses_of_one_input_leave_one_memo_entry_counted_once(
        tmp_path: Path) -> None:
    """Runs of a stage share its source tree: packed by two at once, the memo must still
    count it once (a phantom count would shrink the memo for the rest of the run)."""
    from runner.isolation.ray.backend import RaySandbox

    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("x" * 5000)
    both = threading.Barrier(2)

    class Store:  # the object store's put, holding both threads until each has packed
        def put(self, data: bytes) -> object:
            both.wait(5)
            return object()

    rs = RaySandbox.__new__(RaySandbox)
    rs._ray = Store()  # type: ignore[assignment]
    rs._lock, rs._memo, rs._memo_bytes = threading.Lock(), OrderedDict(), 0
    got: list[tuple[str, Any]] = []
    threads = [threading.Thread(target=lambda: got.append(rs._input(src))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 2 and got[0] == got[1]  # the same object ref for both runs
    assert len(rs._memo) == 1
    assert rs._memo_bytes == len(pack_input(src))


@pytest.mark.skipif(os.getuid() != 0, reason="makes a directory of another uid")
def test_an_image_is_never_written_for_docker_load_under_another_users_node_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "cyclebox-ray-0"
    monkeypatch.setenv(node_side.NODE_DIR_ENV, str(root))
    (root / NODE[:16] / node_side.LOADS).mkdir(parents=True)
    for p in (root, *root.rglob("*")):
        os.chown(p, OTHER_UID, OTHER_UID)
    with pytest.raises(SandboxError, match=f"owned by uid {OTHER_UID}"):
        node_side.ImageLoader(NODE, "sha256:" + "0" * 64, "cyclebox/analyst:x")
    assert not any((root / NODE[:16] / node_side.LOADS).iterdir())
