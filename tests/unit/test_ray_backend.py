"""The ray backend's pure parts: archives, the gateway relay, the head's mount rules and
output reading, the node_lost record in a cycle, and how the backend is chosen.

The cluster itself is exercised in tests/integration/test_ray.py; nothing here starts Ray.
"""

from __future__ import annotations

import os
import socket
import tarfile
import threading
from pathlib import Path

import pytest

from runner.cli.engine import choose_backend
from runner.cycle.config import CycleFile
from runner.errors import ConfigError, PolicyViolation, SandboxError
from runner.isolation.ray.archive import (
    ENTRY,
    cached,
    digest,
    pack_input,
    pack_output,
    unpack_input,
)
from runner.isolation.ray.backend import check_mounts, lost_record, read_output
from runner.isolation.ray.relay import TICKET_BYTES, HeadForwarder, NodeRelay
from runner.isolation.sandbox import Mount, Resources, RunRecord, RunSpec, StopReason
from tests.fixtures.fake_sandbox import Call, Result
from tests.unit.test_cycle_runner import (  # noqa: F401 - planned is a fixture
    Freeze,
    analyst,
    fake,
    planned,
    records,
    run,
    script,
)


def spec(tmp_path: Path, *mounts: Mount, out: Path | None = None) -> RunSpec:
    return RunSpec(run_id="r1", role="analyst", image="sha256:" + "0" * 64,
                   command=("true",), user="1000:1000", mounts=mounts, output_dir=out,
                   resources=Resources(memory_bytes=1 << 28, cpus=1, pids=64),
                   timeout_s=10, output_cap_bytes=1 << 20, output_max_entries=100)


def record(stop: StopReason = StopReason.OK) -> RunRecord:
    return RunRecord(run_id="r1", role="analyst", image_id="sha256:x", container_name="c",
                     exit_code=0, stop_reason=stop, wall_s=1.0, stdout_bytes=0,
                     stderr_bytes=0, stdout_tail="", stderr_tail="", cleanup_confirmed=True)


# -- archives -----------------------------------------------------------------------------

def test_inputs_are_content_addressed_and_cached_once(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.txt").write_text("hello")
    os.symlink("sub/a.txt", src / "link")
    data = pack_input(src)
    os.utime(src / "sub" / "a.txt", (1, 1))  # mtimes do not change the digest
    assert pack_input(src) == data
    cache = tmp_path / "cache"
    assert cached(cache, digest(data)) is None
    got = unpack_input(data, digest(data), cache)
    assert got == cache / digest(data) / ENTRY
    assert (got / "sub" / "a.txt").read_text() == "hello"
    assert os.readlink(got / "link") == "sub/a.txt"  # kept as a link, never followed
    assert cached(cache, digest(data)) == got
    (src / "sub" / "a.txt").write_text("changed")
    assert digest(pack_input(src)) != digest(data)


def test_an_input_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(SandboxError, match="does not match its digest"):
        unpack_input(pack_input(f), "0" * 64, tmp_path / "cache")
    assert not (tmp_path / "cache" / ("0" * 64)).exists()


def test_a_fifo_is_never_shipped(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "p")
    with pytest.raises(SandboxError, match="only files, directories and symlinks"):
        pack_input(tmp_path)


# -- the head's rules and its safe reader ------------------------------------------------

def test_mount_rules_apply_on_the_head_before_anything_ships(tmp_path: Path) -> None:
    with pytest.raises(PolicyViolation, match=r"mounts\[0\].*/etc"):
        check_mounts(spec(tmp_path, Mount(source=Path("/etc"), target="/x")))
    os.symlink(tmp_path, tmp_path.parent / f"{tmp_path.name}-link")
    with pytest.raises(PolicyViolation, match="symlink"):
        check_mounts(spec(tmp_path, Mount(source=tmp_path.parent / f"{tmp_path.name}-link",
                                          target="/x")))
    with pytest.raises(PolicyViolation, match="no gateway socket"):
        check_mounts(spec(tmp_path, Mount(source=tmp_path, target="/g", gateway=True)))
    check_mounts(spec(tmp_path, Mount(source=tmp_path, target="/x")))


def test_the_nodes_output_is_read_by_the_safe_reader(tmp_path: Path) -> None:
    node_out = tmp_path / "node"
    node_out.mkdir()
    (node_out / "answer.json").write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    (out / "seed").write_text("host seed, replaced by the output")
    got = read_output(spec(tmp_path, out=out), record(), pack_output(node_out, 1 << 20), {})
    assert got.stop_reason is StopReason.OK
    assert sorted(p.name for p in out.iterdir()) == ["answer.json"]
    # a link the host did not seed is refused: an ok run becomes invalid_output
    os.symlink("/etc/passwd", node_out / "evil")
    out2 = tmp_path / "out2"
    out2.mkdir()
    got = read_output(spec(tmp_path, out=out2), record(), pack_output(node_out, 1 << 20), {})
    assert got.stop_reason is StopReason.INVALID_OUTPUT and "symlink" in got.detail
    assert not (out2 / "evil").is_symlink()
    # ... unless the host seeded exactly that link
    out3 = tmp_path / "out3"
    out3.mkdir()
    got = read_output(spec(tmp_path, out=out3), record(), pack_output(node_out, 1 << 20),
                      {"evil": "/etc/passwd"})
    assert got.stop_reason is StopReason.OK and (out3 / "evil").is_symlink()


def test_output_past_the_cap_is_a_limit_not_a_pass(tmp_path: Path) -> None:
    node_out = tmp_path / "node"
    node_out.mkdir()
    (node_out / "big").write_bytes(b"x" * (2 << 20))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(SandboxError, match="exceeds its cap"):
        pack_output(node_out, 1 << 20)
    raw = tmp_path / "raw.tar"  # a node that ignored its cap: the head's reader holds
    with tarfile.open(raw, "w") as tf:
        tf.add(node_out / "big", arcname="big")
    got = read_output(spec(tmp_path, out=out), record(), raw.read_bytes(), {})
    assert got.stop_reason is StopReason.OUTPUT_LIMIT


# -- the relay ---------------------------------------------------------------------------

def echo_gateway(path: Path) -> socket.socket:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
            conn.sendall(b"gateway saw: " + data)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv


def unanswered(conn: socket.socket) -> bool:
    """Closed without a byte of reply (EOF, or a reset since our bytes went unread)."""
    try:
        return conn.recv(100) == b""
    except ConnectionResetError:
        return True


def test_relay_forwards_bytes_to_the_heads_gateway_socket_only_with_its_ticket(
        tmp_path: Path) -> None:
    gw = echo_gateway(tmp_path / "gw.sock")
    head = HeadForwarder("127.0.0.1")
    try:
        ticket = head.add(tmp_path / "gw.sock", b"per-binding-token")
        relay = NodeRelay(tmp_path / "g", ticket, uid=os.getuid(), socket_name="gateway.sock",
                          token_name="token")
        assert (tmp_path / "g" / "token").read_bytes() == b"per-binding-token"
        assert (tmp_path / "g" / "token").stat().st_mode & 0o777 == 0o400
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(str(tmp_path / "g" / "gateway.sock"))
        c.sendall(b"POST /v1/chat")
        c.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := c.recv(4096):
            reply += chunk
        assert reply == b"gateway saw: POST /v1/chat"
        # a connection without the ticket is closed unanswered
        raw = socket.create_connection(("127.0.0.1", head.port))
        raw.sendall(b"x" * TICKET_BYTES + b"POST")
        assert unanswered(raw)
        # a removed ticket no longer routes
        head.remove(ticket)
        raw = socket.create_connection(("127.0.0.1", head.port))
        raw.sendall(ticket.secret + b"POST")
        assert unanswered(raw)
        relay.close()
        with pytest.raises(SandboxError, match="CYCLEBOX_RAY_NODE_DIR"):
            NodeRelay(tmp_path / ("d" * 120), ticket, uid=os.getuid(),
                      socket_name="gateway.sock", token_name="token")
    finally:
        head.close()
        gw.close()


# -- node loss in a cycle, and choosing the backend --------------------------------------

def test_a_lost_node_invalidates_its_case_never_passes_it(planned: Freeze,  # noqa: F811
                                                          tmp_path: Path) -> None:
    plan = planned()
    victim = "d01-revenue-march"

    def lost(call: Call) -> Result:
        if call.case == victim:
            rec = lost_record(call.spec, "n" * 56, 1.0, "NodeDiedError")
            return Result(exit_code=None, stop_reason=rec.stop_reason, detail=rec.detail,
                          cleanup_confirmed=False)
        return analyst(call)

    outcome = run(plan, fake(script(**{"analyst@baseline": lost})))
    base = records(plan, "baseline")
    assert base[victim]["status"] == "infra_invalid"
    assert base[victim]["reason"].startswith("node_lost: node nnnnnnnnnnnn lost during the run")
    assert outcome.result.verdict != "accept_for_review" or victim not in {
        c.case_id for c in outcome.result.improvements}
    rec = lost_record(spec(tmp_path), "abc" * 20, 2.0, "why")
    assert (rec.stop_reason, rec.cleanup_confirmed, rec.labels["io.cyclebox.node"]) == (
        StopReason.NODE_LOST, False, "abc" * 20)


def test_backend_choice_is_checked() -> None:
    with pytest.raises(ConfigError, match="unknown backend 'k8s'"):
        choose_backend("k8s")
    with pytest.raises(ConfigError, match="--ray-address"):
        choose_backend("docker", ray_address="10.0.0.1:6379")


def test_cycle_file_backend_is_optional_and_named() -> None:
    fields = CycleFile.model_fields
    assert fields["backend"].default == "docker" and fields["ray"].default is None
    assert fields["backend"].description and fields["ray"].description
    schema = CycleFile.model_json_schema(by_alias=True)
    assert schema["properties"]["backend"]["enum"] == ["docker", "ray"]


@pytest.mark.parametrize("address", ["auto", "10.0.0.1:6379", "head.example:6379",
                                     "[::1]:6379", "ray://head:10001", "h:1", "h:65535"])
def test_well_formed_ray_addresses_pass(address: str) -> None:
    from runner.isolation.ray.address import address_problem

    assert address_problem(address) is None


@pytest.mark.parametrize(("address", "why"), [
    ("", "empty"), ("   ", "empty"), ("head", "not HOST:PORT"), (":6379", "not HOST:PORT"),
    ("head:", "port ''"), ("head:0", "port '0'"), ("head:65536", "port '65536'"),
    ("head:6379x", "port '6379x'"), ("head:١٢٣", "port '١٢٣'"), ("::1:6379", "IPv6"),
    ("[::1:6379", "IPv6"), ("http://head:6379", "a URL"), ("he ad:1", "space"),
    ("head:1\n", "control"), ("h" * 2000 + ":1", "longer than 1024")])
def test_malformed_ray_addresses_are_named(address: str, why: str) -> None:
    from runner.isolation.ray.address import address_problem

    got = address_problem(address)
    assert got is not None and why in got, got
    with pytest.raises(ConfigError, match="--ray-address"):
        choose_backend("ray", ray_address=address)
