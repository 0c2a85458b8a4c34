"""The ray backend on a real multi-node Ray cluster on this machine.

``ray.cluster_utils.Cluster`` starts a head (no cyclebox resource: it only holds the
object store the controller talks to) and two worker nodes advertising ``cyclebox: 2``;
the controller is the CLI in a subprocess that joins the cluster by address, exactly as
on a real cluster. Every node uses this machine's Docker engine (shared with other
sessions), but each has its own node directory (input cache, relay sockets).

Shown: the demo cycle reaches the same verdict and outcome hashes as the local backend
with runs spread over both nodes (recorded per run); a canary model key given to the
controller appears in no worker-node process environment, no node file and no container
(the cycle goes through a real OpenAI-compatible server, through the per-node relay); a
node removed mid-cycle gives ``node_lost`` records (infra_invalid cases, every case still
recorded) and gc leaves nothing behind; SIGINT or SIGTERM to the controller mid-stage
ends it with a verdict and a verifiable receipt, no container of the run on any node
and no node run directory left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.paths import PROJECT_ROOT
from tests.faults.test_signals import SLOW_CANDIDATE
from tests.fixtures.cycle_project import (
    EXAMPLE,
    example_agent,
    project_with_agent,
    require_judge,
    run_containers,
    signal_and_wait,
    stage_started,
    verdict,
    wait_for,
)
from tests.integration.test_openai_server import (
    KEY_ENV,
    MODELS,
    FakeLLM,
    Inspector,
    fakellm_rules,
    no_proxy_env,
    scanning_agent,
    upstream,
)

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.docker, pytest.mark.slow]

CLI = [sys.executable, "-m", "runner.cli"]
NODE_LABEL = "io.cyclebox.node"
PID_LABEL = "io.cyclebox.node_pid"
STORE = 100 * 1024 * 1024


class RayCluster:
    def __init__(self, node_dir: Path) -> None:
        self.node_dir = node_dir
        old = os.environ.get("CYCLEBOX_RAY_NODE_DIR")
        os.environ["CYCLEBOX_RAY_NODE_DIR"] = str(node_dir)  # inherited by the raylets
        try:
            self.cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 0, "object_store_memory": STORE, "include_dashboard": False})
            self.workers = [self.add() for _ in range(2)]
            self.cluster.wait_for_nodes()
        finally:
            if old is None:
                os.environ.pop("CYCLEBOX_RAY_NODE_DIR", None)
            else:
                os.environ["CYCLEBOX_RAY_NODE_DIR"] = old
        self.address = self.cluster.address

    def add(self) -> Any:
        return self.cluster.add_node(num_cpus=1, resources={"cyclebox": 2},
                                     object_store_memory=STORE)

    def pids(self) -> set[int]:
        """Every process of the cluster: the raylets, stores and their workers."""
        out: set[int] = set()
        for node in self.cluster.list_all_nodes():
            for infos in node.all_processes.values():
                out.update(i.process.pid for i in infos)
        return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    node_dir = tmp_path_factory.mktemp("nodes")
    c = RayCluster(node_dir)
    try:
        yield c
    finally:
        c.cluster.shutdown()


def cli(*args: str, env: dict[str, str] | None = None,
        timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          check=False, env=env, cwd=PROJECT_ROOT)


def containers(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "containers.jsonl").read_text().splitlines()]


def test_demo_same_verdict_and_outcome_as_local_spread_over_nodes(
        cluster: RayCluster, tmp_path: Path) -> None:
    cycle = str(EXAMPLE / "cycle.yaml")
    local, remote = tmp_path / "local", tmp_path / "ray"
    res = cli("cycle", "run", cycle, "--out", str(local), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    res = cli("cycle", "run", cycle, "--out", str(remote), "--json", "--backend", "ray",
              "--ray-address", cluster.address)
    assert res.returncode == 0, res.stdout + res.stderr
    a = json.loads((local / "receipt.json").read_text())
    b = json.loads((remote / "receipt.json").read_text())
    assert a["outcome"]["verdict"] == b["outcome"]["verdict"] == "accept_for_review"
    # the upstream identities name the run directory's copy of each script, so the
    # inputs digest differs between any two runs; everything the run produced is equal
    assert {k: v for k, v in a["outcome"].items() if k != "inputs"} == {
        k: v for k, v in b["outcome"].items() if k != "inputs"}
    res = cli("receipt", "compare", str(local), str(remote))
    assert res.returncode == 0, res.stdout + res.stderr
    res = cli("receipt", "verify", str(remote))
    assert res.returncode == 0, res.stdout + res.stderr
    # every run recorded its node; the analyst runs used both worker nodes
    rows = containers(remote)
    assert all(r["stop_reason"] == "ok" and r["cleanup_confirmed"] for r in rows)
    workers = {n.node_id for n in cluster.workers}
    assert {r["labels"][NODE_LABEL] for r in rows} <= workers
    spread = Counter(r["labels"][NODE_LABEL] for r in rows if r["role"] == "analyst")
    assert len(spread) == 2 and min(spread.values()) >= 4, spread
    assert b["leftovers"] == [] and not run_containers(run_id(remote))
    # inputs travelled content-addressed: each node cached each distinct input once
    for node in workers:
        cache = cluster.node_dir / node[:16] / "inputs"
        assert cache.is_dir() and len(list(cache.iterdir())) >= 3, node


def run_id(run: Path) -> str:
    doc = json.loads((run / "plan.json").read_text())
    return f"{doc['plan']['name']}-{doc['plan_hash'][:10]}"


Ident = tuple[int, int]
"""A process: (pid, start time in clock ticks since boot). Pids alone are reused within
minutes on a busy host (pid_max 32768): a pid is never an identity here."""


def _stat(dirfd: int) -> tuple[int, int, str]:
    """(start, ppid, comm) of the process whose ``/proc/<pid>`` directory is ``dirfd``."""
    fd = os.open("stat", os.O_RDONLY, dir_fd=dirfd)
    try:
        text = os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)
    comm, _, rest = text.partition(" (")[2].rpartition(") ")
    fields = rest.split()
    return int(fields[19]), int(fields[1]), comm


def _read(dirfd: int, name: str) -> bytes:
    fd = os.open(name, os.O_RDONLY, dir_fd=dirfd)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def mask(data: bytes, key: bytes, at: int, width: int = 120) -> str:
    """``width`` bytes either side of ``at``, the key itself masked."""
    return repr(data[max(0, at - width):at + width].replace(key, b"<KEY>"))


class EnvironScan:
    """Who holds ``key`` in their environment, judged exactly on a host whose processes
    come and go and whose pids are reused within minutes.

    Each pass lists ``/proc`` and reads every process through a directory descriptor of
    its ``/proc/<pid>`` (which names that one process: once its pid is reused the reads
    fail instead of reading the newcomer): first its stat (start time, parent), then its
    environment. A holder is judged at once: it is the root's (the controller's) when its
    parent, as read before its environment, is the root, or a process that started no
    later than it and is the root's in turn (the parent read live, or as an earlier pass
    recorded it when it has exited since). A holder whose line cannot be followed to the
    root or to pid 1 is ``unknown``, reported, never taken for the root's."""

    def __init__(self, key: bytes, root: int) -> None:
        self.key = key
        self.root = root
        self.seen: dict[Ident, int] = {}
        """Every process read (identity -> parent pid), over all passes."""
        self.holders: dict[Ident, dict[str, Any]] = {}
        self.passes = 0

    def scan(self) -> None:
        self.passes += 1
        found: list[tuple[Ident, int, str, bytes, int]] = []
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                dirfd = os.open(f"/proc/{name}", os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                continue
            try:
                start, ppid, comm = _stat(dirfd)
                env = _read(dirfd, "environ")
                try:
                    cmd = _read(dirfd, "cmdline")[:200].replace(b"\0", b" ").decode(
                        "utf-8", "replace")
                except OSError:  # exited after its environment was read: still judged
                    cmd = ""
            except OSError:  # exited before its environment could be read
                continue
            finally:
                os.close(dirfd)
            ident = (int(name), start)
            self.seen[ident] = ppid
            at = env.find(self.key)
            if at >= 0 and ident not in self.holders:
                # judged at once, while its parents most likely still run; a parent that
                # exited already may have been read later in this pass: judged again then
                self._hold(ident, ppid, cmd or f"[{comm}]", env, at)
                if self.holders[ident]["verdict"] == "unknown":
                    found.append((ident, ppid, cmd or f"[{comm}]", env, at))
        for args in found:
            self._hold(*args)

    def _hold(self, ident: Ident, ppid: int, cmd: str, env: bytes, at: int) -> None:
        verdict, line = self.judge(ident, ppid)
        self.holders[ident] = {"verdict": verdict, "cmdline": cmd, "line": line,
                               "pass": self.passes, "context": mask(env, self.key, at)}

    def _parent(self, pid: int, born_by: int) -> tuple[Ident, int] | None:
        """The process ``pid`` that started no later than ``born_by`` (so not a newcomer
        that took a parent's pid after it exited), and its own parent pid."""
        try:
            dirfd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
            try:
                start, ppid, _ = _stat(dirfd)
            finally:
                os.close(dirfd)
            if start <= born_by:
                return (pid, start), ppid
        except OSError:
            pass
        earlier = [(s, pp) for (p, s), pp in self.seen.items() if p == pid and s <= born_by]
        if not earlier:
            return None
        start, ppid = max(earlier)
        return (pid, start), ppid

    def judge(self, ident: Ident, ppid: int) -> tuple[str, list[str]]:
        """("root" | "other" | "unknown", the line of parents followed)."""
        line = [f"{ident[0]}@{ident[1]}"]
        if ident[0] == self.root:  # the root's pid is not reused while it is not reaped
            return "root", [f"{line[0]} (root)"]
        born_by = ident[1]
        while True:
            if ppid == self.root:
                return "root", [*line, f"{ppid} (root)"]
            if ppid <= 1:
                return "other", [*line, str(ppid)]
            up = self._parent(ppid, born_by)
            if up is None:
                return "unknown", [*line, f"{ppid} (exited, never read)"]
            (pid, born_by), ppid = up
            line.append(f"{pid}@{born_by}")
            if len(line) > 64:
                return "unknown", line

    def read_alive(self, pid: int) -> list[Ident]:
        """The identities read with ``pid`` (several when it was reused)."""
        return [i for i in self.seen if i[0] == pid]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200].decode(
            errors="backslashreplace")
    except OSError:
        return "?"


def start_of(pid: int) -> int | None:
    try:
        dirfd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        return _stat(dirfd)[0]
    except OSError:
        return None
    finally:
        os.close(dirfd)


def test_canary_key_on_the_head_reaches_no_worker_node(cluster: RayCluster,
                                                       tmp_path: Path) -> None:
    base = tmp_path
    canary = "sk-cbxcanary-" + os.urandom(12).hex()
    config = base / "fakellm.yaml"
    config.write_text(yaml.safe_dump(fakellm_rules(canary), sort_keys=False))
    server = FakeLLM(config, base / "fakellm.log")
    name = "rayfake-" + os.urandom(4).hex()
    try:
        cycle = project_with_agent(
            base / "ex", scanning_agent(), name=name,
            upstreams={n: upstream(n, server.url) for n in MODELS},
            worker={"model": MODELS["optimizer"], "max_tokens": 4096},
            judge={"model": MODELS["judge"], "threshold": 0.5, "required": True},
            backend="ray", ray={"address": cluster.address})
        require_judge(cycle)
        run = base / "run"
        inspector = Inspector(name)
        env = no_proxy_env(base / "tmp", **{KEY_ENV: canary})
        proc = subprocess.Popen([*CLI, "cycle", "run", str(cycle), "--out", str(run),
                                 "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=PROJECT_ROOT)
        scan = EnvironScan(canary.encode(), proc.pid)
        try:
            while proc.poll() is None:  # who holds the key while the cycle runs
                scan.scan()
                time.sleep(0.1)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
            time.sleep(1)
            inspector.close()
        assert proc.returncode == 0, out + err
        assert json.loads(out)["verdict"] == "accept_for_review"
        stats = server.stats()
    finally:
        server.close()
    # the key was used: every call reached the server with it (a relay that lost the
    # gateway would have failed the cycle; a call without the key hits the 401 rule)
    assert stats["total_requests"] > 0 and "unauthorized-or-unknown" not in stats["by_rule"]
    # only the controller (and what it started, e.g. git) ever held the key; no process
    # of the cluster, and in particular no node process that ran a relay. Processes are
    # told apart by (pid, start time): on a busy host a pid comes back within minutes.
    (Path(os.environ.get("CANARY_DIAG", str(tmp_path))) / "holders.json").write_text(
        json.dumps({"controller": proc.pid, "passes": scan.passes, "holders": {
            f"{p}@{s}": h for (p, s), h in scan.holders.items()}}, indent=1))
    assert any(p == proc.pid for p, _ in scan.holders), "the scan must see the controller"
    foreign = {f"{p}@{s}": h for (p, s), h in scan.holders.items() if h["verdict"] != "root"}
    assert not foreign, f"the key is held outside the controller: {foreign}"
    rows = containers(run)
    relays = {int(r["labels"][PID_LABEL]) for r in rows}
    cluster_pids = cluster.pids()
    # the node processes that ran the containers and their relays were read while alive:
    # a child of one of the cluster's own processes under that pid (it may be reused)
    read = {r: [i for i in scan.read_alive(r) if scan.seen[i] in cluster_pids]
            for r in relays}
    assert len(relays) >= 2 and all(read.values()), read
    cluster_ids = {(p, s) for p in cluster_pids if (s := start_of(p)) is not None}
    assert cluster_ids
    held = set(scan.holders) & (cluster_ids | {i for ids in read.values() for i in ids})
    assert not held, held
    assert len({r["labels"][NODE_LABEL] for r in rows}) == 2
    # nothing any node wrote (input cache, run directories) holds it
    files = [f for f in cluster.node_dir.rglob("*") if f.is_file() and not f.is_symlink()]
    assert files
    for f in files:
        data = f.read_bytes()
        i = data.find(b"cbxcanary")
        assert i < 0, (f, data[max(0, i - 200):i + 200].replace(canary.encode(), b"<KEY>"))
    # no container's engine view, nor anything a container could read, holds it
    assert inspector.seen
    for cid, doc in inspector.seen.items():
        i = doc.find("cbxcanary")
        assert i < 0, (cid, doc[max(0, i - 300):i + 200].replace(canary, "<KEY>"))
    scans = [json.loads(p.read_text()) for p in (run / "stages").glob(
        "*/cases/*/out/canary-scan.json")]
    assert scans and all(s["hits"] == [] and s["scanned"] > 0 for s in scans), [
        (s["hits"], s["scanned"]) for s in scans]


CHURN = """
import subprocess, sys, tempfile
src = sys.argv[1]
while True:  # short children (git) and grandchildren (a clone's upload-pack, index-pack)
    subprocess.run(["git", "--version"], capture_output=True)
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(["git", "-c", "protocol.file.allow=always", "clone", "-q",
                        "file://" + src, d + "/c"], capture_output=True)
"""


def test_environ_scan_judges_short_lived_children_and_names_a_foreign_holder(
        tmp_path: Path) -> None:
    """The canary test's judge: children and grandchildren of the root that live a few
    milliseconds are the root's (the judgement that read the parent line after a whole
    pass took about one in 150 for foreign under load); a process outside the root's
    tree holding the key is named, with its parent line and the key masked."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "f").write_text("x")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                    "add", "f"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-qm", "f"], check=True)
    key = "sk-cbxcanary-" + os.urandom(12).hex()
    env = dict(os.environ, CBX_SCAN_KEY=key)
    root = subprocess.Popen([sys.executable, "-c", CHURN, str(repo)], env=env)
    foreign = subprocess.Popen(["sleep", "60"], env=env)
    scan = EnvironScan(key.encode(), root.pid)
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            scan.scan()
            time.sleep(0.02)
    finally:
        root.kill()
        foreign.kill()
        root.wait()
        foreign.wait()
    theirs = {i: h for i, h in scan.holders.items() if i[0] != foreign.pid}
    assert len(theirs) > 5, scan.holders
    assert any(len(h["line"]) > 2 for h in theirs.values()), theirs  # grandchildren seen
    wrong = {i: h for i, h in theirs.items() if h["verdict"] != "root"}
    assert not wrong, wrong
    (named,) = [h for i, h in scan.holders.items() if i[0] == foreign.pid]
    assert named["verdict"] == "other" and named["line"][-1] == "1", named
    assert key not in str(named) and "CBX_SCAN_KEY=<KEY>" in named["context"], named


def test_doctor_checks_every_node_and_refuses_a_dead_address(cluster: RayCluster) -> None:
    """``doctor --backend ray``: every cyclebox node answers its engine, image, probe,
    relay-socket and relay-port checks; a mistyped address is refused by name within
    seconds (``ray.init`` alone would retry for many minutes)."""
    res = cli("doctor", "--backend", "ray", "--ray-address", cluster.address, "--json",
              timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    rows = json.loads(res.stdout)
    nodes = {r["name"].split()[1] for r in rows if r["name"].startswith("node ")}
    assert len(nodes) == 2, rows
    for n in nodes:
        mine = {r["name"].split(": ", 1)[1]: r for r in rows
                if r["name"].startswith(f"node {n} ")}
        for check in ("engine", "image analyst", "image worker", "image evaluator",
                      "image apply", "limits enforced", "relay socket path", "relay to head"):
            assert mine[check]["ok"], (n, check, mine.get(check))
    assert any(r["name"] == "ray nodes" and "2 alive" in r["detail"] for r in rows)

    t0 = time.monotonic()
    bad = cli("doctor", "--backend", "ray", "--ray-address", "127.0.0.1:1", "--json",
              timeout=120)
    assert bad.returncode == 5
    failed = [r for r in json.loads(bad.stdout) if not r["ok"]]
    assert [r["name"] for r in failed] == ["ray cluster"]
    assert "127.0.0.1:1" in failed[0]["detail"] and "refused" in failed[0]["detail"]
    assert time.monotonic() - t0 < 60


def test_node_lost_mid_cycle_is_named_never_lost_and_gc_cleans(cluster: RayCluster,
                                                               tmp_path: Path) -> None:
    extra = cluster.add()
    cluster.cluster.wait_for_nodes()
    run = tmp_path / "run"
    proc = subprocess.Popen([*CLI, "cycle", "run", str(EXAMPLE / "cycle.yaml"), "--out",
                             str(run), "--json", "--backend", "ray", "--ray-address",
                             cluster.address], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=PROJECT_ROOT)
    try:
        deadline = time.monotonic() + 300
        while not (run / "containers.jsonl").is_file() or not any(
                json.loads(x)["labels"].get(NODE_LABEL) == extra.node_id
                for x in (run / "containers.jsonl").read_text().splitlines()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no run reached the extra node"
            time.sleep(0.05)
        # the next run on that node is under way: take the node away
        time.sleep(0.5)
        cluster.cluster.remove_node(extra, allow_graceful=False)
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = containers(run)
    lost = [r for r in rows if r["stop_reason"] == "node_lost"]
    assert lost, (out, err[-3000:])
    assert all(r["labels"][NODE_LABEL] == extra.node_id and not r["cleanup_confirmed"]
               and "lost" in r["detail"] for r in lost)
    receipt = json.loads((run / "receipt.json").read_text())
    # nothing lost: every baseline case has its record; the lost ones are infra_invalid,
    # named, never a pass
    cases = len(json.loads((EXAMPLE / "manifest.json").read_text())["scenarios"])
    assert (run / "stages/baseline/records.jsonl").is_file(), receipt["verdict"]
    records = [json.loads(x) for x in
               (run / "stages/baseline/records.jsonl").read_text().splitlines()]
    assert len(records) == cases
    named = [r for r in records if (r.get("reason") or "").startswith("node_lost")]
    assert named and all(r["status"] == "infra_invalid" for r in named)
    assert receipt["outcome"]["verdict"] != "accept_for_review" or len(named) < cases
    # gc on every alive node: no container of the run and no node run directory is left
    res = cli("gc", "--backend", "ray", "--ray-address", cluster.address, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert not run_containers(run_id(run))
    left = [d for d in cluster.node_dir.glob("*/runs/*") if d.is_dir()]
    assert left == [], left


@pytest.mark.parametrize(("stage", "sig"), [("candidate", signal.SIGINT),
                                            ("apply", signal.SIGTERM)])
def test_a_signal_to_the_controller_mid_stage_leaves_a_receipt_and_nothing_on_the_nodes(
        cluster: RayCluster, tmp_path: Path, stage: str, sig: int) -> None:
    """The candidate's cases run in the analyst pool (their runs see the stop event); the
    apply stage runs in the controller's main thread (the signal lands in its wait)."""
    agent = example_agent().replace("from __future__ import annotations\n",
                                    "from __future__ import annotations\n" + SLOW_CANDIDATE, 1)
    cycle = project_with_agent(tmp_path / "cyc", agent)
    run = tmp_path / "run"
    proc = subprocess.Popen([*CLI, "cycle", "run", str(cycle), "--out", str(run),
                             "--backend", "ray", "--ray-address", cluster.address],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=PROJECT_ROOT, env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    try:
        wait_for(lambda: stage_started(run, stage), proc, f"stage {stage} started")
        elapsed, out, err = signal_and_wait(proc, sig, timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    detail = f"rc {proc.returncode} after {elapsed:.1f}s\n{out}\n{err[-3000:]}"
    assert proc.returncode == 130, detail
    assert "Traceback" not in err, detail
    assert verdict(run)["reasons"] == ["interrupted"], detail
    res = cli("receipt", "verify", str(run))
    assert res.returncode == 0, res.stdout + res.stderr
    assert run_containers(run_id(run)) == [], detail
    # the node tasks end (their containers removed) and remove their run directories
    deadline = time.monotonic() + 60
    while (left := [d for d in cluster.node_dir.glob("*/runs/*") if d.is_dir()]) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], left
    assert elapsed < 60, detail


def test_nodes_that_do_not_answer_cost_one_deadline_not_one_each(
        cluster: RayCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """gc, doctor and leftovers ask every node; two hanging nodes must not double the
    wait (before: 120 s per node, one after the other)."""
    from runner.isolation.ray import backend

    monkeypatch.setattr(backend, "EACH_NODE_S", 5.0)
    rs = backend.RaySandbox(cluster.address)
    try:
        assert len(rs.nodes()) == 2
        t0 = time.monotonic()
        got = rs.on_each_node(lambda s: time.sleep(s), 60)  # noqa: PLW0108 - no builtin
        took = time.monotonic() - t0
        assert got == [] and took < 9, took
        pids = rs.on_each_node(lambda: os.getpid())  # noqa: PLW0108 - ray.remote
        assert sorted(n for n, _ in pids) == rs.nodes()
    finally:
        rs.close()
        ray.shutdown()


def test_loopback_endpoint_on_a_node_reaches_the_heads_gateway(
        cluster: RayCluster, tmp_path: Path) -> None:
    """The holder on a worker node relays its loopback endpoint to the node's relay
    socket, which reaches the head's gateway: an unmodified SDK works there too."""
    from runner.gateway.calllog import CallLog
    from runner.gateway.config import load_upstreams
    from runner.gateway.server import Gateway
    from runner.isolation.docker.images import resolve_image
    from runner.isolation.launcher import launch
    from runner.isolation.policy import load_policies
    from runner.isolation.ray import backend
    from runner.paths import default_policies, default_upstreams

    code = ("import openai\nprint(openai.OpenAI().chat.completions.create(model="
            "'fixture-target', messages=[{'role': 'user', 'content': 'ping'}])"
            ".choices[0].message.content)")
    rs = backend.RaySandbox(cluster.address)
    try:
        with Gateway(tmp_path, "raylo", load_upstreams(default_upstreams()),
                     {"analyst": "target"}) as gw:
            rec = launch(rs, load_policies(default_policies()).roles["analyst"],
                         role="analyst", run_id="raylo", image=resolve_image("analyst"),
                         command=["python", "-c", code], gateway=gw, stage="s", case="c1",
                         trial=0)
    finally:
        rs.close()
        ray.shutdown()
    assert rec.stop_reason.value == "ok", rec.stderr_tail
    assert rec.stdout_tail.strip() == "pong" and NODE_LABEL in rec.labels
    recs = CallLog(tmp_path / "gateway").records()
    assert [(r.role, r.case, r.status) for r in recs] == [("analyst", "c1", "ok")]


SLOW_EVERY_RUN = "\nimport time as _t\n_t.sleep(150)  # in the stage when the head goes\n"
HEAD_LOST_BOUND_S = 30.0
"""From the head's kill to the controller's exit (Ray's own GCS wait alone is 60 s)."""


def managed() -> list[tuple[str, str, dict[str, str]]]:
    from runner.isolation.docker.backend import DockerSandbox

    return DockerSandbox().managed_containers()


@pytest.fixture
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    """A cluster of this test alone: its head is killed (only its own processes)."""
    c = RayCluster(tmp_path_factory.mktemp("own-nodes"))
    try:
        yield c
    finally:
        c.cluster.shutdown()


def test_head_lost_mid_stage_ends_with_exit_6_a_named_verdict_and_a_receipt(
        own_cluster: RayCluster, tmp_path: Path) -> None:
    """Every process of the head (GCS, raylet, object store) killed while the baseline's
    runs are under way on the worker nodes: the controller says so within seconds
    (before: exit 1 with nothing written, at Ray's 60 s GCS wait, or a hang), exit 6,
    a verdict naming the lost cluster, a receipt that verifies; the containers and node
    run directories the dead cluster left are gc-able."""
    agent = example_agent().replace("from __future__ import annotations\n",
                                    "from __future__ import annotations\n" + SLOW_EVERY_RUN, 1)
    cycle = project_with_agent(tmp_path / "cyc", agent)
    run = tmp_path / "run"
    head = own_cluster.cluster.head_node
    head_pids = {i.process.pid for infos in head.all_processes.values() for i in infos}
    assert head_pids and head_pids <= own_cluster.pids()
    proc = subprocess.Popen([*CLI, "cycle", "run", str(cycle), "--out", str(run), "--json",
                             "--backend", "ray", "--ray-address", own_cluster.address],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=PROJECT_ROOT, env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    try:
        wait_for(lambda: stage_started(run, "baseline")
                 and any(own_cluster.node_dir.glob("*/runs/*/out")), proc,
                 "baseline runs on the nodes")
        rid = run_id(run)
        t0 = time.monotonic()
        own_cluster.cluster.remove_node(head, allow_graceful=False)  # SIGKILL, its own pids
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGABRT)  # PYTHONFAULTHANDLER: every thread's stack
            out, err = proc.communicate(timeout=30)
            raise AssertionError(f"no exit 120 s after the head was killed:\n"
                                 f"{err[-8000:]}") from None
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    detail = f"rc {proc.returncode} after {elapsed:.1f}s\n{out[-3000:]}\n{err[-3000:]}"
    print(f"head killed -> controller exit {proc.returncode} in {elapsed:.1f} s\n{err}")
    assert proc.returncode == 6, detail
    assert "Traceback" not in err, detail
    assert elapsed < HEAD_LOST_BOUND_S, detail
    v = verdict(run)
    assert v["verdict"] == "invalid_comparison", v
    assert v["reasons"][0].startswith("engine_error"), v["reasons"]
    assert "Ray head" in v["reasons"][0] and own_cluster.address in v["reasons"][0], v
    assert "Ray head" in err and own_cluster.address in err, detail
    res = cli("receipt", "verify", str(run))
    assert res.returncode == 0, res.stdout + res.stderr
    receipt = json.loads((run / "receipt.json").read_text())
    assert receipt["outcome"]["verdict"] == "invalid_comparison"
    # the lost cluster's leftovers could not be checked: the receipt says so, never []
    assert receipt["leftovers"] and all("unknown" in x for x in receipt["leftovers"])
    # what the dead cluster leaves (its nodes' task processes go with it) is gc-able:
    # the containers by the local engine's gc, the node run directories by the nodes' own
    own_cluster.cluster.shutdown()
    owners = {int(labels["io.cyclebox.owner_pid"]) for _, _, labels in managed()
              if labels.get("io.cyclebox.run_id") == rid}
    # and the task processes that made a node run directory but no container yet (a
    # case prepared ahead, still staging its inputs when the head went)
    owners |= {int(json.loads((d / "owner.json").read_text())["pid"])
               for d in own_cluster.node_dir.glob("*/runs/*") if (d / "owner.json").is_file()}
    deadline = time.monotonic() + 60  # the dead raylets' task processes exit after them
    while (alive := {p for p in owners if Path(f"/proc/{p}").exists()}) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, [cmdline(p) for p in alive]
    # gc would remove every one of them (a dry run: the engine is shared, and a real gc
    # would also take other sessions' orphans); then exactly this run's are removed
    gc = cli("gc", "--dry-run", "--json")
    assert gc.returncode == 0, gc.stdout + gc.stderr
    mine = [r for r in json.loads(gc.stdout) if r["kind"] == "container" and r["run_id"] == rid]
    assert all(r["would_remove"] for r in mine), mine
    from runner.isolation.docker.backend import DockerSandbox

    DockerSandbox().leftovers(rid)
    assert run_containers(rid) == []
    from runner.isolation.ray import node as node_side

    os.environ[node_side.NODE_DIR_ENV] = str(own_cluster.node_dir)
    try:
        node_side.sweep_scratch(dry_run=False)
    finally:
        os.environ.pop(node_side.NODE_DIR_ENV)
    left = [d for d in own_cluster.node_dir.glob("*/runs/*") if d.is_dir()]
    assert left == [], left


def test_prepared_ahead_on_the_nodes_each_container_serves_its_own_case_once(
        cluster: RayCluster, tmp_path: Path) -> None:
    """``RaySandbox.prepare`` makes the container on a node before its case's turn (it
    exists, holder waiting, while nothing was handed over); each serves only the case it
    was prepared for (its own input), once; a second ``run`` gives the first record and
    starts nothing; ``discard`` removes an unrun one on its node (container and node run
    directory), after which it cannot run."""
    from runner.errors import SandboxError
    from runner.isolation.docker.images import resolve_image
    from runner.isolation.launcher import prepare
    from runner.isolation.policy import load_policies
    from runner.isolation.ray import backend
    from runner.isolation.sandbox import Mount
    from runner.paths import default_policies

    run_id = f"rayprep{os.getpid()}"
    policy = load_policies(default_policies()).roles["analyst"]
    code = "print(open('/in/which').read())"

    def case(name: str) -> Any:
        src = tmp_path / name
        src.mkdir()
        (src / "which").write_text(name)
        return prepare(rs, policy, role="analyst", run_id=run_id,
                       image=resolve_image("analyst"), command=["python", "-c", code],
                       mounts=[Mount(source=src, target="/in")], stage="s", case=name,
                       trial=0)

    def ours() -> list[dict[str, str]]:
        return [labels for _, _, labels in managed()
                if labels.get("io.cyclebox.run_id") == run_id]

    rs = backend.RaySandbox(cluster.address)
    try:
        a, b, c = case("a"), case("b"), case("c")
        deadline = time.monotonic() + 120
        while len(ours()) < 3:  # prepared ahead: created before any hand-over
            assert time.monotonic() < deadline, ours()
            time.sleep(0.1)
        rb = b.run()
        ra = a.run()
        assert (ra.stdout_tail.strip(), rb.stdout_tail.strip()) == ("a", "b")
        assert ra.stop_reason.value == rb.stop_reason.value == "ok", ra.stderr_tail
        assert ra.container_name != rb.container_name
        assert b.run() is rb  # the same record: nothing started again
        assert [lab["io.cyclebox.case"] for lab in ours()] == ["c"]
        c.discard()
        assert ours() == []
        with pytest.raises(SandboxError, match="discarded before it ran"):
            c.run()
        # the run's leftovers sweep discards what is still prepared, then sweeps the nodes
        d = case("d")
        while len(ours()) < 1:
            assert time.monotonic() < deadline, ours()
            time.sleep(0.1)
        rs.leftovers(run_id)
        assert ours() == []
        with pytest.raises(SandboxError, match="discarded before it ran"):
            d.run()
    finally:
        rs.close()
        ray.shutdown()
    left = [d for d in cluster.node_dir.glob("*/runs/*") if d.is_dir()]
    assert left == [], left


KILLED_HEAD = """
import sys, time
from pathlib import Path
from runner.isolation.docker.images import resolve_image
from runner.isolation.launcher import prepare
from runner.isolation.policy import load_policies
from runner.isolation.ray import backend
from runner.isolation.sandbox import Mount
from runner.paths import default_policies

rs = backend.RaySandbox(sys.argv[1])
policy = load_policies(default_policies()).roles["analyst"]
src = Path(sys.argv[3])
runs = [prepare(rs, policy, role="analyst", run_id=sys.argv[2], image=resolve_image("analyst"),
                command=["true"], mounts=[Mount(source=src, target="/in")], stage="s",
                case=f"c{i}", trial=0) for i in range(2)]
print("prepared", flush=True)
time.sleep(600)
"""


def test_a_controller_killed_with_prepared_containers_leaves_nothing_after_gc(
        cluster: RayCluster, tmp_path: Path) -> None:
    """SIGKILL to a controller holding prepared containers on the nodes (no finally of
    its own runs): Ray ends the node tasks it owned; whatever they could not remove is
    labelled with the run and owned by a process that is gone, and ``cyclebox gc`` on
    every node removes it with the node run directories."""
    run_id = f"raykill{os.getpid()}"
    src = tmp_path / "in"
    src.mkdir()

    def ours() -> list[str]:
        return [n for _, n, labels in managed() if labels.get("io.cyclebox.run_id") == run_id]

    proc = subprocess.Popen([sys.executable, "-c", KILLED_HEAD, cluster.address, run_id,
                             str(src)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=PROJECT_ROOT)
    try:
        deadline = time.monotonic() + 120
        while len(ours()) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "nothing was prepared"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(30)
    deadline = time.monotonic() + 30
    while ours() and time.monotonic() < deadline:  # Ray ends the dead driver's tasks
        time.sleep(0.5)
    left_by_ray = ours()
    res = cli("gc", "--backend", "ray", "--ray-address", cluster.address, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert ours() == [], (left_by_ray, res.stdout)
    runs = [d for d in cluster.node_dir.glob("*/runs/*") if d.is_dir()]
    assert runs == [], runs
    print(f"left by Ray after the driver's death, removed by gc: {left_by_ray}")
