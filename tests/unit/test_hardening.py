"""RunSpec -> docker create arguments: every SPEC §2 control present, nothing else passed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runner.errors import PolicyViolation
from runner.isolation.docker.hardening import HOLDER_MOUNT
from runner.isolation.docker.hardening import create_kwargs as _create_kwargs
from runner.isolation.owner import Owner
from runner.isolation.policy import load_policies
from runner.isolation.roles import parse_mount_flag, resolve_user, role_spec
from runner.isolation.sandbox import MANAGED_LABEL, Mount, Resources, RunSpec
from runner.isolation.seccomp import load_profile
from runner.paths import default_policies

OWNER = Owner(pid=42, start=1234, boot_id="boot", host="h")
HOLDER = Path("/staged/holder")


def create_kwargs(spec: RunSpec, owner: Owner, nonce: str) -> dict[str, Any]:
    return _create_kwargs(spec, owner, nonce, holder_dir=HOLDER)


def _spec(**kw: object) -> RunSpec:
    base: dict[str, object] = {
        "run_id": "r1", "role": "analyst", "image": "sha256:abc", "command": ("true",),
        "user": "10001:10001", "resources": Resources(memory_bytes=1 << 28, cpus=1.5, pids=99),
        "timeout_s": 5,
    }
    base.update(kw)
    return RunSpec.model_validate(base)


def test_every_control_is_set(tmp_path: Path) -> None:
    kw = create_kwargs(_spec(output_dir=tmp_path,
                             mounts=(Mount(source=tmp_path, target="/in"),)), OWNER, "n1")
    assert kw["network_mode"] == "none"
    assert kw["read_only"] is True
    assert kw["cap_drop"] == ["ALL"]
    assert "cap_add" not in kw
    nnp, seccomp = kw["security_opt"]
    assert nnp == "no-new-privileges:true"
    assert seccomp == f"seccomp={load_profile().text}"
    assert "io_uring" not in seccomp and "unconfined" not in seccomp
    assert kw["privileged"] is False
    assert kw["user"] == "10001:10001"
    assert kw["pids_limit"] == 99
    assert kw["mem_limit"] == kw["memswap_limit"] == 1 << 28
    assert kw["nano_cpus"] == 1_500_000_000
    assert kw["ipc_mode"] == "private"
    assert kw["restart_policy"] == {"Name": "no"}
    assert kw["log_config"]["Type"] == "none"
    assert kw["tmpfs"]["/tmp"].startswith("rw,nosuid,nodev,noexec,size=")
    assert kw["environment"] == {}
    assert {u["Name"] for u in kw["ulimits"]} == {"nofile", "fsize", "core"}
    for forbidden in ("pid_mode", "uts_mode", "userns_mode", "devices", "ports",
                      "volumes", "network", "dns"):
        assert forbidden not in kw
    # the output directory is never a bind mount of a host path; the holder's code is
    # the container's own copy, read-only
    code, ro = kw["mounts"]
    assert code["Source"] == str(HOLDER) and code["Target"] == HOLDER_MOUNT
    for m in (code, ro):
        assert m["ReadOnly"] is True and m["BindOptions"]["Propagation"] == "rprivate"
    assert ro["Target"] == "/in"
    out = kw["tmpfs"]["/out"]
    assert out.startswith("rw,nosuid,nodev,noexec,size=67108864,nr_inodes=10001,")
    assert out.endswith("mode=0700,uid=10001,gid=10001")
    assert kw["entrypoint"][:4] == ["python3", "-I", "-S", "-c"]
    assert kw["command"] == ["hold", "/out"]
    # the holder starts the command as the container's own user; its stdin is the
    # host's case channel, never a tty
    assert kw["user"] == "10001:10001" and kw["privileged"] is False
    assert kw["stdin_open"] is True and kw["tty"] is False


def test_output_target_collision_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyViolation, match="also mounted"):
        create_kwargs(_spec(output_dir=tmp_path, output_target="/tmp"), OWNER, "n")


def test_nothing_is_mounted_at_or_under_the_holder_code(tmp_path: Path) -> None:
    """A file mounted over the holder's bytecode or source would be PID 1 (a reviewer ran
    one): refused however the target is spelled, for binds, tmpfs and the output."""
    for target in (HOLDER_MOUNT, HOLDER_MOUNT + "/", "/" + HOLDER_MOUNT,
                   HOLDER_MOUNT + "/a70d0d0a.code", HOLDER_MOUNT + "/./holder.py",
                   "/x/.." + HOLDER_MOUNT + "/holder.py", "/." + HOLDER_MOUNT):
        with pytest.raises(PolicyViolation, match="where the holder's code is mounted"):
            create_kwargs(_spec(mounts=(Mount(source=tmp_path, target=target),)), OWNER, "n")
        with pytest.raises(PolicyViolation, match="where the holder's code is mounted"):
            create_kwargs(_spec(tmpfs=((target, 1 << 20),)), OWNER, "n")
        with pytest.raises(PolicyViolation, match="where the holder's code is mounted"):
            create_kwargs(_spec(output_dir=tmp_path, output_target=target), OWNER, "n")
    # a neighbour is not inside it
    create_kwargs(_spec(mounts=(Mount(source=tmp_path, target=HOLDER_MOUNT + "-x"),)),
                  OWNER, "n")


def test_the_holder_files_are_readable_by_the_role_whatever_the_umask(tmp_path: Path) -> None:
    import os

    from runner.isolation.docker.hardening import write_holder_files

    old = os.umask(0o077)
    try:
        d = write_holder_files(tmp_path / "h")
    finally:
        os.umask(old)
    assert d.stat().st_mode & 0o777 == 0o755
    assert sorted(f.stat().st_mode & 0o777 for f in d.iterdir()) == [0o444, 0o444]
    with pytest.raises(FileExistsError):  # never over something already there
        write_holder_files(d)


def test_memory_must_cover_every_tmpfs() -> None:
    from runner.isolation.docker.hardening import SHM_BYTES
    from runner.isolation.policy import SHM_BYTES as POLICY_SHM
    from runner.isolation.policy import memory_needed, policy_violations

    assert SHM_BYTES == POLICY_SHM
    for role, pol in load_policies(default_policies()).roles.items():
        assert pol.memory >= memory_needed(pol), role
    pol = load_policies(default_policies()).roles["analyst"]
    small = pol.model_copy(update={"memory": memory_needed(pol) - 1})
    assert any(f == "roles.analyst.memory" or f.endswith(".memory")
               for f, _, _ in policy_violations("analyst", small))


def test_labels_carry_run_role_owner() -> None:
    kw = create_kwargs(_spec(labels=(("io.cyclebox.case", "c1"),)), OWNER, "n1")
    labels = kw["labels"]
    assert labels[MANAGED_LABEL] == "1"
    assert labels["io.cyclebox.run_id"] == "r1"
    assert labels["io.cyclebox.role"] == "analyst"
    assert labels["io.cyclebox.owner_pid"] == "42"
    assert labels["io.cyclebox.owner_start"] == "1234"
    assert labels["io.cyclebox.case"] == "c1"
    assert kw["name"] == "cyclebox-r1-analyst-n1"


def test_root_user_is_unrepresentable() -> None:
    with pytest.raises(ValueError, match="user"):
        _spec(user="0:0")


def test_socket_mount_refused_at_translation(tmp_path: Path) -> None:
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "api"))
    try:
        with pytest.raises(PolicyViolation, match="unix socket"):
            create_kwargs(_spec(mounts=(Mount(source=tmp_path / "api", target="/x"),)),
                          OWNER, "n")
        kw = create_kwargs(_spec(mounts=(Mount(source=tmp_path, target="/gw", gateway=True),)),
                           OWNER, "n")
        assert kw["mounts"][1]["ReadOnly"] is True
        # the holder relays its loopback endpoint to that one socket
        assert kw["command"] == ["hold", "-", "/gw/gateway.sock"]
        with pytest.raises(PolicyViolation, match="more than one gateway"):
            create_kwargs(_spec(mounts=(Mount(source=tmp_path, target="/gw", gateway=True),
                                        Mount(source=tmp_path, target="/g2", gateway=True))),
                          OWNER, "n")
    finally:
        s.close()
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(PolicyViolation, match="writable"):
        create_kwargs(_spec(mounts=(Mount(source=plain, target="/x", read_only=False),)),
                      OWNER, "n")


def test_resolve_user() -> None:
    assert resolve_user("10001:10001", host_uid=0, host_gid=0) == "10001:10001"
    assert resolve_user("10001:10001", host_uid=1000, host_gid=1000) == "1000:1000"


def test_mount_flag(tmp_path: Path) -> None:
    m = parse_mount_flag(f"{tmp_path}:/data")
    assert m.read_only and m.target == "/data"
    (tmp_path / "f").write_text("x")
    with pytest.raises(Exception, match="empty directory"):
        parse_mount_flag(f"{tmp_path}:/data:rw")
    with pytest.raises(Exception, match="does not exist"):
        parse_mount_flag(f"{tmp_path}/nope:/data")
    with pytest.raises(Exception, match="/etc"):
        parse_mount_flag("/etc:/data")


def test_role_spec_from_policy(tmp_path: Path) -> None:
    pol = load_policies(default_policies()).roles["trainer"]
    spec = role_spec(pol, role="trainer", run_id="r", image="sha256:x", command=["true"],
                     output_dir=tmp_path)
    assert spec.resources.memory_bytes == pol.memory
    assert ("HF_HUB_OFFLINE", "1") in spec.env
    assert spec.timeout_s == pol.timeout_s


def test_gateway_socket_name_agrees_everywhere() -> None:
    from runner.gateway.server import CONTAINER_DIR, SOCKET_NAME
    from runner.isolation.ray import node
    from runner.isolation.sandbox import GATEWAY_SOCKET
    from sandbox import gateway_client

    assert SOCKET_NAME == GATEWAY_SOCKET == node.GATEWAY_SOCKET
    assert str(gateway_client.GATEWAY_DIR) == CONTAINER_DIR
