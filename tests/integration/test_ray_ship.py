"""The ray backend ships an image to a node whose engine lacks it, on real engines.

A local Ray cluster: a head without the cyclebox resource, one node on the shared Docker
engine (it has the role images) and one node on a second, private dockerd started for
this module (:mod:`tests.fixtures.second_engine`; empty: it lacks every image). Shown:
``RaySandbox.image_id`` of the analyst image ships it to the second engine only (by the
head's id, through the object store) and returns the head's id; a hardened role run on
that node then runs from the shipped image; a name the head uses that holds a different
image on the second engine is refused, naming the node and both ids, and left as it is.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import secrets
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runner.isolation.ray.doctor import run_checks as ray_doctor
from tests.fixtures.second_engine import SecondEngine, unavailable

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from runner.errors import PrerequisiteError  # noqa: E402
from runner.isolation.docker.images import resolve_image  # noqa: E402
from runner.isolation.launcher import launch, output_dir  # noqa: E402
from runner.isolation.policy import load_policies  # noqa: E402
from runner.isolation.ray.backend import RaySandbox  # noqa: E402
from runner.isolation.ray.node import NODE_DIR_ENV, sweep_scratch  # noqa: E402
from runner.isolation.sandbox import StopReason  # noqa: E402
from runner.paths import default_policies  # noqa: E402

pytestmark = [pytest.mark.docker, pytest.mark.slow]
WHY = unavailable()
STORE = 100 * 1024 * 1024
NODE_LABEL = "io.cyclebox.node"


class Setup:
    def __init__(self, cluster: Any, shared: Any, private: Any, engine: SecondEngine,
                 node_dir: Path) -> None:
        self.cluster, self.shared, self.private = cluster, shared, private
        self.engine, self.node_dir = engine, node_dir


def _with_env(changes: dict[str, str], fn: Any) -> Any:
    """``fn()`` with ``changes`` in os.environ (the raylets it starts inherit them)."""
    old = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        return fn()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    if WHY is not None:
        pytest.skip(WHY)
    engine = SecondEngine(tmp_path_factory.mktemp("engine2"))
    node_dir = tmp_path_factory.mktemp("nodes")
    shared_bridge = Path("/sys/class/net/docker0")
    had_bridge = shared_bridge.exists()
    engine.start()
    # the shared engine's default network must survive a second engine (dockerd with
    # --bridge none deletes docker0)
    assert shared_bridge.exists() or not had_bridge, "the second engine removed docker0"
    cluster = None
    try:
        env = {"CYCLEBOX_RAY_NODE_DIR": str(node_dir)}

        def start() -> Any:
            c = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 0, "object_store_memory": STORE, "include_dashboard": False})
            return c, c.add_node(num_cpus=1, resources={"cyclebox": 2},
                                 object_store_memory=STORE)

        cluster, shared = _with_env(env, start)
        private = _with_env({**env, "DOCKER_HOST": engine.host}, lambda: cluster.add_node(
            num_cpus=1, resources={"cyclebox": 2}, object_store_memory=STORE))
        cluster.wait_for_nodes()
        yield Setup(cluster, shared, private, engine, node_dir)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        engine.stop()
        assert shared_bridge.exists() or not had_bridge, "the second engine removed docker0"


@pytest.fixture(scope="module")
def head(setup: Setup) -> Iterator[RaySandbox]:
    sb = RaySandbox(setup.cluster.address)
    try:
        yield sb
    finally:
        sb.close()


def inspect_id(engine: SecondEngine, ref: str) -> str | None:
    res = engine.docker("image", "inspect", "--format", "{{.Id}}", ref, check=False)
    return res.stdout.decode().strip() if res.returncode == 0 else None


def test_a_missing_image_is_shipped_and_runs_there(setup: Setup, head: RaySandbox,
                                                   tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    analyst = resolve_image("analyst")
    assert inspect_id(setup.engine, analyst) is None  # the second engine starts empty
    # doctor --backend ray: the empty node's missing images are not failures, since the
    # head holds them and a cycle ships them; its engine answers from that node
    rows = {c.name: c for c in ray_doctor(default_policies(), sandbox=lambda: head,
                                          probe=False)}
    private = [c for name, c in rows.items()
               if name.startswith(f"node {setup.private.node_id[:12]} ")]
    mine = {c.name.split(": ", 1)[1]: c for c in private}
    assert mine["engine"].ok and mine["relay to head"].ok, mine
    assert mine["image analyst"].ok and "shipped from the head" in mine["image analyst"].detail
    shared = {c.name.split(": ", 1)[1]: c for name, c in rows.items()
              if name.startswith(f"node {setup.shared.node_id[:12]} ")}
    assert shared["image analyst"].ok and "shipped" not in shared["image analyst"].detail
    caplog.set_level(logging.INFO, logger="runner.isolation.ray.backend")
    t0 = time.monotonic()
    assert head.image_id(analyst) == analyst
    took = time.monotonic() - t0
    assert inspect_id(setup.engine, analyst) == analyst
    shipped = [r.getMessage() for r in caplog.records if "shipped image" in r.getMessage()]
    assert len(shipped) == 1 and "to 1 node(s)" in shipped[0], shipped
    size = int(re.search(r"\((\d+) bytes", shipped[0]).group(1))  # type: ignore[union-attr]
    print(f"\nship: {shipped[0]}; image_id() took {took:.1f} s ({size / took / 2**20:.0f} "
          "MiB/s end to end)")
    # nothing is left of the transfer on the nodes
    assert [p for p in setup.node_dir.glob("*/loads/*")] == []
    # asked again, nothing ships
    caplog.clear()
    assert head.image_id(analyst) == analyst
    assert not [r for r in caplog.records if "shipped image" in r.getMessage()]

    # a hardened role run from the shipped image, on the second engine's node
    policy = load_policies(default_policies()).roles["analyst"]
    nodes: dict[str, Any] = {}
    for i in range(4):
        out = output_dir(policy, tmp_path / f"out{i}")
        rec = launch(head, policy, role="analyst", run_id="test-ray-ship", image=analyst,
                     command=["python", "-c", "import json, os; json.dump({'uid': os.getuid()"
                              "}, open('/out/r.json', 'w')); print('ran')"],
                     output_dir=out)
        assert rec.stop_reason is StopReason.OK, rec.detail + rec.stderr_tail
        assert rec.stdout_tail.strip() == "ran" and rec.cleanup_confirmed
        assert json.loads((out / "r.json").read_text())["uid"] != 0
        nodes[rec.labels[NODE_LABEL]] = rec
        if setup.private.node_id in nodes:
            break
    assert setup.private.node_id in nodes, nodes.keys()
    assert set(nodes) <= {setup.shared.node_id, setup.private.node_id}
    # it really ran on the second engine: that engine's event log saw the container
    # (until the next whole second: a relative "0s" would cut off the current one)
    until = str(int(time.time()) + 1)
    events = setup.engine.docker("events", "--since", "10m", "--until", until, "--filter",
                                 "label=io.cyclebox.run_id=test-ray-ship", "--format",
                                 "{{.Action}}").stdout.decode().split()
    assert "start" in events and "destroy" in events, events


def _empty_image_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("marker")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"cbx"))
    return buf.getvalue()


def test_a_different_image_under_the_heads_name_is_refused_and_kept(
        setup: Setup, head: RaySandbox) -> None:
    analyst = resolve_image("analyst")
    name = f"cbx-ship-test-{secrets.token_hex(4)}:x"
    subprocess.run(["docker", "tag", analyst, name], check=True, timeout=60)
    try:
        setup.engine.docker("import", "-", name, stdin=_empty_image_tar())
        other = inspect_id(setup.engine, name)
        assert other is not None and other != analyst
        with pytest.raises(PrerequisiteError) as exc:
            head.image_id(name)
        msg = str(exc.value)
        node = setup.private.node_id[:12]
        assert f"node {node} has {other}" in msg and f"the head has {analyst}" in msg, msg
        assert setup.shared.node_id[:12] not in msg and "Fix:" in msg
        assert inspect_id(setup.engine, name) == other  # not overwritten
    finally:
        subprocess.run(["docker", "rmi", name], check=False, capture_output=True, timeout=60)


def test_a_name_the_head_resolved_is_given_where_it_named_nothing(
        setup: Setup, head: RaySandbox) -> None:
    analyst = resolve_image("analyst")
    name = f"cbx-ship-test-{secrets.token_hex(4)}:y"
    subprocess.run(["docker", "tag", analyst, name], check=True, timeout=60)
    try:
        assert inspect_id(setup.engine, name) is None
        assert head.image_id(name) == analyst
        assert inspect_id(setup.engine, name) == analyst
    finally:
        subprocess.run(["docker", "rmi", name], check=False, capture_output=True, timeout=60)


def test_a_node_lost_mid_transfer_is_named_and_gc_removes_its_file(
        setup: Setup, head: RaySandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """Last: it takes the second engine's node away."""
    image = resolve_image("evaluator")
    assert inspect_id(setup.engine, image) is None
    loads = setup.node_dir / setup.private.node_id[:16] / "loads"
    failure: list[BaseException] = []

    def ship() -> None:
        try:
            head.image_id(image)
        except BaseException as exc:  # handed to the test thread
            failure.append(exc)

    t = threading.Thread(target=ship)
    t.start()
    deadline = time.monotonic() + 120
    while not any(f.stat().st_size > 0 for f in loads.glob("*/image.tar")):
        assert t.is_alive(), failure
        assert time.monotonic() < deadline, "the transfer never started"
        time.sleep(0.05)
    setup.cluster.remove_node(setup.private, allow_graceful=False)
    t.join(timeout=60)
    assert not t.is_alive(), "the head hung on a lost node"
    assert len(failure) == 1 and isinstance(failure[0], PrerequisiteError), failure
    assert f"node {setup.private.node_id[:12]} was lost" in str(failure[0]), failure[0]
    # the killed loader's file is left with its owner record; the node part of gc
    # (what `cyclebox gc --backend ray` runs on every node; not run through the cluster
    # here, whose Docker sweep would judge other sessions' containers on the shared
    # engine) removes it once that process is gone
    assert list(loads.glob("*/image.tar"))
    monkeypatch.setenv(NODE_DIR_ENV, str(setup.node_dir))
    deadline = time.monotonic() + 30
    removed: list[str] = []
    while list(loads.glob("*")):
        removed += [r.name for r in sweep_scratch(dry_run=False)
                    if r.kind == "node_load_dir" and r.removed]
        assert time.monotonic() < deadline, "the killed loader's directory stayed"
        time.sleep(0.5)
    assert removed and all(str(loads) in n for n in removed), removed
