"""The watch on the Ray head (runner.isolation.ray.headwatch): a head that stops
answering is lost after the grace, named with its cluster; one that answers again within
it is not; a caller is held while the head is suspect. Nothing here starts Ray (the
killed head itself: tests/integration/test_ray.py)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from runner.errors import SandboxError
from runner.isolation.ray.headwatch import HeadWatch, probe

GCS = ("10.9.8.7", 6379)


class Head:
    """A fake probe: answers while ``up``; counts the probes."""

    def __init__(self) -> None:
        self.up = True
        self.probes = 0

    def __call__(self, where: tuple[str, int]) -> str | None:
        self.probes += 1
        return None if self.up else "Connection refused"


def watch(head: Head, **kw: object) -> HeadWatch:
    opts: dict[str, object] = {"every": 0.05, "grace": 0.3, "check": head, **kw}
    return HeadWatch("10.9.8.7:6379", [("GCS", GCS)], **opts)  # type: ignore[arg-type]


def wait_lost(w: HeadWatch, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while w.lost is None:
        assert time.monotonic() < deadline, "never lost"
        time.sleep(0.01)
    return w.lost


def test_an_answering_head_is_never_lost() -> None:
    head = Head()
    w = watch(head)
    try:
        time.sleep(0.5)
        w.ensure()
        w.check()
        assert w.lost is None and head.probes >= 5
    finally:
        w.close()


def test_a_head_that_stops_answering_is_lost_after_the_grace_named() -> None:
    head, called = Head(), []
    w = watch(head, on_lost=lambda: called.append(1))
    try:
        w.ensure()
        head.up = False
        t0 = time.monotonic()
        why = wait_lost(w)
        took = time.monotonic() - t0
        assert 0.25 <= took < 2.0, took
        assert why.startswith("Ray head lost: the cluster at 10.9.8.7:6379 ")
        assert "GCS at 10.9.8.7:6379: Connection refused" in why and "Fix:" in why
        with pytest.raises(SandboxError, match=r"Ray head lost.*10\.9\.8\.7:6379"):
            w.check()
        with pytest.raises(SandboxError, match="Ray head lost"):
            w.ensure()
        head.up = True  # lost for good: a head back later is another cluster's session
        time.sleep(0.2)
        with pytest.raises(SandboxError):
            w.ensure()
        assert called == [1]
    finally:
        w.close()


def test_a_head_back_within_the_grace_is_no_loss_and_holds_the_caller_meanwhile() -> None:
    head = Head()
    w = watch(head, grace=2.0)
    try:
        head.up = False
        threading.Timer(0.4, lambda: setattr(head, "up", True)).start()
        t0 = time.monotonic()
        w.ensure()  # suspect: held until the head answers again
        assert 0.3 <= time.monotonic() - t0 < 1.9
        time.sleep(2.2)
        assert w.lost is None
        w.check()
    finally:
        w.close()


def test_ensure_ends_with_the_loss_while_held() -> None:
    head = Head()
    head.up = False
    w = watch(head)
    try:
        t0 = time.monotonic()
        with pytest.raises(SandboxError, match="Ray head lost"):
            w.ensure()
        assert time.monotonic() - t0 < 2.0
    finally:
        w.close()


def test_probe_is_a_tcp_connect_that_names_a_refusal() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    where = srv.getsockname()[:2]
    assert probe(where) is None
    srv.close()
    assert probe(where) == "Connection refused"
