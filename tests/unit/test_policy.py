"""Role policy loading refuses every forbidden setting by field, file and reason."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from runner.errors import ConfigError, PolicyViolation
from runner.isolation.policy import load_policies, mount_violation, parse_policies, parse_size
from runner.paths import default_policies

BASE = {"image": "analyst", "memory": "256m", "cpus": 1, "pids": 64, "timeout_s": 10}


def _load(tmp_path: Path, **override: object) -> None:
    role = {**BASE, **override}
    p = tmp_path / "roles.yaml"
    p.write_text(yaml.safe_dump({"schema": 1, "roles": {"analyst": role}}))
    load_policies(p)


def test_shipped_policies_load() -> None:
    pols = load_policies(default_policies())
    assert set(pols.roles) == {"analyst", "worker", "evaluator", "apply", "trainer"}
    assert all(p.network == "none" and not p.privileged for p in pols.roles.values())


@pytest.mark.parametrize(("override", "field", "words"), [
    ({"privileged": True}, "roles.analyst.privileged", "privileged"),
    ({"network": "host"}, "roles.analyst.network", "none"),
    ({"network": "bridge"}, "roles.analyst.network", "none"),
    ({"cap_add": ["NET_ADMIN"]}, "roles.analyst.cap_add", "NET_ADMIN"),
    ({"pid_mode": "host"}, "roles.analyst.pid_mode", "namespace"),
    ({"uts_mode": "host"}, "roles.analyst.uts_mode", "namespace"),
    ({"userns_mode": "host"}, "roles.analyst.userns_mode", "namespace"),
    ({"ipc_mode": "host"}, "roles.analyst.ipc_mode", "IPC"),
    ({"devices": ["/dev/sda"]}, "roles.analyst.devices", "devices"),
    ({"user": "0:0"}, "roles.analyst.user", "uid"),
    ({"mounts": [{"source": "/var/run", "target": "/s"}]},
     "roles.analyst.mounts[0]", "/run"),
    ({"mounts": [{"source": "/etc", "target": "/e"}]}, "roles.analyst.mounts[0]", "/etc"),
    ({"mounts": [{"source": "/var", "target": "/v"}]}, "roles.analyst.mounts[0]", "contains"),
    ({"mounts": [{"source": "/srv/data", "target": "/d", "mode": "rw"}]},
     "roles.analyst.mounts[0]", "read-only"),
])
def test_forbidden_settings_are_refused_by_field(tmp_path: Path, override: dict[str, object],
                                                 field: str, words: str) -> None:
    with pytest.raises(PolicyViolation) as exc:
        _load(tmp_path, **override)
    msg = str(exc.value)
    assert str(tmp_path / "roles.yaml") in msg
    assert field in msg
    assert words in msg
    assert "Fix:" in msg


def test_unknown_key_and_bad_size_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"roles\.analyst\.seccomp"):
        _load(tmp_path, seccomp="unconfined")
    with pytest.raises(ConfigError, match=r"roles\.analyst\.memory"):
        _load(tmp_path, memory="lots")


def test_schema_version_checked() -> None:
    with pytest.raises(ConfigError, match="schema must be 1"):
        parse_policies({"schema": 2, "roles": {}}, path="x.yaml")


def test_sockets_are_refused_by_type_whatever_their_name(tmp_path: Path) -> None:
    import socket

    engine = tmp_path / "engine"
    engine.mkdir()
    data = tmp_path / "data"
    (data / "deep").mkdir(parents=True)
    (data / "deep" / "file.txt").write_text("x")
    assert mount_violation(str(data), read_only=True) is None
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(engine / "api"))  # an engine-like API socket with an innocent name
    try:
        link = tmp_path / "innocent"
        link.symlink_to(engine / "api")
        assert "unix socket" in (mount_violation(str(link), read_only=True) or "")
        assert "unix socket" in (mount_violation(str(engine), read_only=True) or "")
        os.link(engine / "api", data / "deep" / "renamed")  # hard link into a data dir
        assert "unix socket" in (mount_violation(str(data), read_only=True) or "")
        assert mount_violation(str(engine), read_only=True, allow_socket=True) is None
    finally:
        s.close()


@pytest.mark.parametrize(("text", "value"), [("512m", 512 * 1024**2), ("1g", 1024**3),
                                             ("64MiB", 64 * 1024**2), (4096, 4096),
                                             ("1.5k", 1536)])
def test_parse_size(text: str | int, value: int) -> None:
    assert parse_size(text) == value
