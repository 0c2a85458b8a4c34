"""``cyclebox doctor --backend ray``: is every node of the cluster ready to run roles?

The head checks the policies and that alive nodes advertise the cyclebox resource;
then on every such node (a Ray task pinned there) the same engine checks as a local
``doctor`` run against that node's engine (engine facts, seccomp, runtimes, the images of
the head's image lock, free disk at the node directory and the engine root, and with
``--probe`` a hardened probe container), plus two Ray-only checks: the relay socket path
fits the unix limit under the node directory, and the head's relay port answers from
that node. Every line is named ``node <id> (<host>): <check>``. An image a node lacks
but the head's engine holds (same id as the lock) is not a failure: the cycle ships it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import CycleboxError
from runner.isolation.docker.doctor import Check, engine_checks, policy_check
from runner.isolation.ray import node as node_side

if TYPE_CHECKING:
    from runner.isolation.docker.images import BuiltImage
    from runner.isolation.policy import RolePolicies
    from runner.isolation.ray.backend import RaySandbox

RELAY_CONNECT_S = 5.0
HOST_CHARS = 64
# a node run directory is <node_base>/runs/<pid>-<start>-<8 random>/g/gateway.sock;
# pid and process start time are decimal: pid_max <= 4194304 (7 digits), start in clock
# ticks since boot (10 digits cover a year of uptime at 100 Hz)
_RUN_DIR_SLACK = len("/runs/") + 7 + 1 + 10 + 1 + 8 + len("/g/") + len(node_side.GATEWAY_SOCKET)
SOCKET_PATH_MAX = 107


def socket_path_check(base: Path) -> Check:
    """Whether the relay socket of a run fits ``sun_path`` under ``base`` (worst case)."""
    need = len(os.fsencode(base)) + _RUN_DIR_SLACK
    return Check("relay socket path", need <= SOCKET_PATH_MAX,
                 f"{base}: up to {need} of {SOCKET_PATH_MAX} bytes",
                 f"set {node_side.NODE_DIR_ENV} on this node to a shorter directory "
                 "(e.g. /tmp/cbx) and restart its raylet")


def relay_check(host: str, port: int, timeout: float = RELAY_CONNECT_S) -> Check:
    """Whether this node opens a TCP connection to the head's relay port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        return Check("relay to head", False, f"{host}:{port}: {exc.strerror or exc}",
                     "let the nodes reach the head on that port (firewall), or set the "
                     "head's relay address to one the nodes can reach")
    return Check("relay to head", True, f"{host}:{port} reachable")


def node_checks(pols: RolePolicies, lock: Mapping[str, BuiltImage], probe: bool,
                relay: tuple[str, int]) -> tuple[str, list[Check]]:
    """Run on a node: (its host name, its checks)."""
    base = node_side.node_base()
    checks: list[Check] = []
    try:
        backend = node_side.docker_sandbox()
    except CycleboxError as exc:
        checks.append(Check("engine", False, str(exc),
                            "start a Docker engine on this node (make docker)"))
    else:
        checks += engine_checks(pols, lock, backend, probe=probe,
                                disks=[("disk (node dir)", node_side.node_root())])
    checks.append(socket_path_check(base))
    checks.append(relay_check(*relay))
    return socket.gethostname()[:HOST_CHARS], checks


def run_checks(policies_path: Path, *, sandbox: Callable[[], RaySandbox],
               probe: bool = True) -> list[Check]:
    """Every check of the cluster, in order (nothing raised for a failed check)."""
    from runner.isolation.docker.images import read_lock

    checks, pols = policy_check(policies_path)
    if pols is None:
        return checks
    try:
        rs = sandbox()
    except CycleboxError as exc:
        return [*checks, Check("ray cluster", False, str(exc).split(" Fix: ")[0],
                               getattr(exc, "fix", None) or "start the cluster (ray start "
                               "--head) or pass --ray-address HOST:PORT")]
    nodes = rs.nodes()
    checks.append(Check("ray nodes", bool(nodes),
                        f"{len(nodes)} alive node(s) advertise {rs.resource!r}"
                        + (f": {', '.join(n[:12] for n in nodes)}" if nodes else ""),
                        f"on each Docker node: ray start --address HEAD:PORT --resources "
                        f"'{{\"{rs.resource}\": 2}}'"))
    if not nodes:
        return checks
    fwd = rs.relay_forwarder()
    lock = read_lock()
    answered = rs.on_each_node(node_checks, pols, lock, probe, (fwd.host, fwd.port))
    shippable = {role: row for role, row in lock.items()
                 if rs.head_image_id(row.id) == row.id}
    for n, (host, node_rows) in answered:
        for row in node_rows:
            role = row.name.removeprefix("image ")
            c = row
            if not row.ok and row.name.startswith("image ") and role in shippable:
                # the cycle ships it from the head before any stage (image_id)
                c = Check(row.name, True, f"not on this node; {shippable[role].tag} "
                          f"{shippable[role].id[:19]} is shipped from the head when a cycle "
                          f"starts ({shippable[role].size_bytes / 1e6:.0f} MB)")
            checks.append(Check(f"node {n[:12]} ({host}): {c.name}", c.ok, c.detail, c.fix))
    got = {n for n, _ in answered}
    checks += [Check(f"node {n[:12]}", False, "did not answer (lost, or busy beyond the "
                     "timeout)", "see `ray status` and the node's raylet log")
               for n in nodes if n not in got]
    return checks
