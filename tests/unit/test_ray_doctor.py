"""The Ray doctor's node-side checks and the head's address check (no Ray cluster)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

pytest.importorskip("ray")

from runner.errors import PrerequisiteError
from runner.isolation.ray.backend import check_reachable
from runner.isolation.ray.doctor import relay_check, socket_path_check


def test_socket_path_fits_under_a_short_node_dir_only() -> None:
    assert socket_path_check(Path("/tmp/cyclebox-ray-0/0123456789abcdef")).ok
    long = socket_path_check(Path("/tmp/" + "d" * 60 + "/0123456789abcdef"))
    assert not long.ok and "CYCLEBOX_RAY_NODE_DIR" in long.fix


def test_relay_check_connects_or_names_the_port() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        assert relay_check("127.0.0.1", port).ok
    gone = relay_check("127.0.0.1", port, timeout=2)
    assert not gone.ok and f"127.0.0.1:{port}" in gone.detail


def test_dead_address_is_refused_at_once_by_name() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
    with pytest.raises(PrerequisiteError, match=rf"not reachable at 127\.0\.0\.1:{port}.*Fix:"):
        check_reachable(f"127.0.0.1:{port}", timeout=2)
    with pytest.raises(PrerequisiteError, match=r"not found at nonsense.*Fix:"):
        check_reachable("nonsense", timeout=2)
    check_reachable("ray://head:10001")  # Ray Client: left to Ray
