"""Extra mount targets and role limits are checked when the role policy file loads (and
``sandbox exec --mount`` before any container exists): an extra mount never shadows a
path the controller or the engine mounts itself, and no limit is one the engine cannot
set. No Docker."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.cli import app
from runner.cycle.plan import check_cycle
from runner.errors import EXIT_BAD_INPUT, ConfigError, PolicyViolation
from runner.isolation.policy import (
    CONTROLLER_TARGETS,
    GATEWAY_ROOT,
    NOFILE_MAX,
    ROLE_SIZE_MAX,
    PolicyMount,
    RolePolicy,
    load_policies,
    target_within,
)
from runner.isolation.roles import role_spec
from runner.isolation.sandbox import Mount
from runner.paths import PROJECT_ROOT

BASE: dict[str, Any] = {"image": "analyst", "memory": "256m", "cpus": 1, "pids": 64,
                        "timeout_s": 10}
EXAMPLE = PROJECT_ROOT / "examples" / "shop-analyst"
ROLES = PROJECT_ROOT / "policies" / "roles.yaml"


@pytest.fixture(autouse=True)
def _state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CYCLEBOX_STATE_DIR", str(tmp_path / "state"))


def _roles(tmp_path: Path, **override: object) -> Path:
    p = tmp_path / "roles.yaml"
    p.write_text(yaml.safe_dump({"schema": 1, "roles": {"analyst": {**BASE, **override}}}))
    return p


def _source(tmp_path: Path) -> str:
    d = tmp_path / "extra"
    d.mkdir(exist_ok=True)
    return str(d)


def _refused(tmp_path: Path, field: str, *words: str, **override: object) -> str:
    with pytest.raises(ConfigError) as exc:
        load_policies(_roles(tmp_path, **override))
    msg = str(exc.value)
    assert str(tmp_path / "roles.yaml") in msg, msg
    assert exc.value.field == field, msg
    assert "Fix:" in msg and exc.value.fix, msg
    for w in words:
        assert w in msg, msg
    return msg


# -- M7: policy mount targets --------------------------------------------------------------
@pytest.mark.parametrize(("target", "root"), [
    ("/src/prompts", "/src"), ("/src", "/src"), ("//src/./prompts/", "/src"),
    ("/x/../src/prompts", "/src"), ("/data", "/data"), ("/data/sub", "/data"),
    ("/case", "/case"), ("/in", "/in"), ("/ref", "/ref"), ("/cfg", "/cfg"),
    ("/scorer", "/scorer"), ("/out", "/out"), ("/out/x", "/out"), ("/work", "/work"),
    ("/model", "/model"), ("/adapter", "/adapter"), ("/corpus", "/corpus"),
    ("/run/cyclebox/gateway", GATEWAY_ROOT), ("/run/cyclebox", GATEWAY_ROOT),
    ("/run", GATEWAY_ROOT), ("/var/run/cyclebox/gateway", "/var/run/cyclebox"),
    ("/var/run", "/var/run/cyclebox"), ("/.cyclebox-holder", "/.cyclebox-holder"),
    ("/.cyclebox-holder/holder.py", "/.cyclebox-holder"), ("/proc", "/proc"),
    ("/proc/self", "/proc"), ("/sys/fs", "/sys"), ("/dev", "/dev"), ("/dev/shm", "/dev"),
    ("/", "/"), ("/srv/..", "/"), ("/tmp", "/tmp"), ("/tmp/cache", "/tmp"),
])
def test_a_mount_at_under_or_above_a_controller_path_is_refused_by_field(
        tmp_path: Path, target: str, root: str) -> None:
    msg = _refused(tmp_path, "roles.analyst.mounts[0].target", target, root,
                   mounts=[{"source": _source(tmp_path), "target": target}])
    assert "/mnt" in msg  # the fix says where to mount it instead


def test_a_mount_under_a_custom_tmpfs_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path, "roles.analyst.mounts[0].target", "/scratch", "tmpfs",
             tmpfs={"/tmp": "16m", "/scratch/": "16m"},
             mounts=[{"source": _source(tmp_path), "target": "/scratch/x"}])


def test_two_mounts_at_one_target_are_refused(tmp_path: Path) -> None:
    src = _source(tmp_path)
    _refused(tmp_path, "roles.analyst.mounts[1].target", "roles.analyst.mounts[0]",
             mounts=[{"source": src, "target": "/mnt/a"}, {"source": src, "target": "/mnt//a/"}])


@pytest.mark.parametrize("target", ["/mnt/data", "/srcs", "/datasets", "/opt/ref", "/tmpx",
                                    "/runx", "/.cyclebox-holder-x"])
def test_a_mount_beside_the_controller_paths_loads(tmp_path: Path, target: str) -> None:
    pols = load_policies(_roles(tmp_path, mounts=[{"source": _source(tmp_path),
                                                   "target": target}]))
    assert pols.roles["analyst"].mounts[0].target == target


@pytest.mark.parametrize(("tmpfs", "words"), [
    ({"/src": "16m"}, ["/src"]), ({"/out": "16m"}, ["/out"]), ({"/proc": "16m"}, ["/proc"]),
    ({"/run": "16m"}, [GATEWAY_ROOT]), ({"/": "16m"}, ["container's root"]),
    ({"/tmp": "16m", "/tmp/": "16m"}, ["same path"]),
])
def test_a_tmpfs_on_a_controller_path_is_refused(tmp_path: Path, tmpfs: dict[str, str],
                                                 words: list[str]) -> None:
    _refused(tmp_path, "roles.analyst.tmpfs", *words, tmpfs=tmpfs)


def test_freeze_refuses_a_policy_mount_shadowing_the_frozen_tree(tmp_path: Path) -> None:
    """The reviewer's reproduction: the analyst's extra mount at /src/prompts froze, then
    every case failed on a host directory that replaced the frozen prompts."""
    doc = yaml.safe_load(ROLES.read_text())
    doc["roles"]["analyst"]["mounts"] = [{"source": _source(tmp_path),
                                          "target": "/src/prompts"}]
    roles = tmp_path / "roles.yaml"
    roles.write_text(yaml.safe_dump(doc))
    cyc = yaml.safe_load((EXAMPLE / "cycle.yaml").read_text())
    cyc["project"]["repo"] = str(PROJECT_ROOT)
    cyc["roles"] = str(roles)
    for key in ("scenarios", "policy", "data_dir"):
        cyc[key] = str(EXAMPLE / cyc[key])
    for up in cyc["upstreams"].values():
        up["script"] = str((EXAMPLE / up["script"]).resolve())
    (tmp_path / "cycle.yaml").write_text(yaml.safe_dump(cyc))
    with pytest.raises(PolicyViolation) as exc:
        check_cycle(tmp_path / "cycle.yaml", check_credentials=False)
    assert exc.value.field == "roles.analyst.mounts[0].target"
    assert "/src" in str(exc.value) and str(roles) in str(exc.value)


def test_a_policy_that_skipped_the_load_checks_is_refused_before_the_engine() -> None:
    """A role policy frozen before these checks (or built in code) fails as bad input when
    its spec is built, never as the engine's ``Duplicate mount point``."""
    pol = RolePolicy(image="analyst", memory=512 << 20, cpus=1, pids=64, timeout_s=10,
                     mounts=(PolicyMount(source="/srv/x", target="/data/"),))
    with pytest.raises(ConfigError) as exc:
        role_spec(pol, role="analyst", run_id="r", image="i", command=["true"])
    assert exc.value.field == "roles.analyst.mounts[0].target"
    pol = RolePolicy(image="analyst", memory=512 << 20, cpus=1, pids=64, timeout_s=10,
                     mounts=(PolicyMount(source="/srv/x", target="/mnt/x"),))
    with pytest.raises(ConfigError) as exc:
        role_spec(pol, role="analyst", run_id="r", image="i", command=["true"],
                  mounts=[Mount(source=Path("/srv/y"), target="/mnt/x/")])
    assert "two mounts at" in str(exc.value)


def test_every_target_the_controller_mounts_is_listed_in_one_place() -> None:
    """Each container path the host code mounts (``target="/..."``, ``output_target=``,
    the gateway's directory, the holder's) is covered by :data:`CONTROLLER_TARGETS`."""
    from runner.gateway.server import CONTAINER_DIR
    from runner.isolation.docker import hardening
    from runner.isolation.policy import HOLDER_MOUNT

    assert hardening.HOLDER_MOUNT is HOLDER_MOUNT
    assert target_within(CONTAINER_DIR, GATEWAY_ROOT)
    found: set[str] = set()
    for py in (PROJECT_ROOT / "runner").rglob("*.py"):
        found.update(re.findall(r"""\b(?:output_)?target(?:=|: str = )"(/[^"/][^"]*)\"""",
                                py.read_text()))
    assert {"/src", "/case", "/data", "/in", "/work", "/out"} <= found
    assert all(any(target_within(t, root) for root in CONTROLLER_TARGETS if root != "/")
               for t in found), sorted(found)


# -- M7: sandbox exec --mount, refused before any container --------------------------------
@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.cli import engine

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("the engine was reached")

    monkeypatch.setattr(engine, "role_image", refuse)
    monkeypatch.setattr(engine, "sandbox", refuse)


@pytest.mark.usefixtures("no_engine")
@pytest.mark.parametrize(("targets", "words"), [
    (["/run/cyclebox/gateway"], [GATEWAY_ROOT]), (["/run"], [GATEWAY_ROOT]),
    (["/var/run/cyclebox/gateway"], ["/var/run is /run"]),
    (["/proc"], ["/proc"]), (["/sys/"], ["/sys"]), (["/dev/shm"], ["/dev"]),
    (["/tmp"], ["tmpfs /tmp"]), (["/tmp/x"], ["tmpfs /tmp"]), (["/out"], ["output"]),
    (["/"], ["root"]), (["/x/../.cyclebox-holder"], ["holder"]),
    (["/mnt/a", "/mnt/a/"], ["already the target"]),
])
def test_sandbox_exec_refuses_a_mount_target_before_any_container(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], targets: list[str],
        words: list[str]) -> None:
    src = _source(tmp_path)
    flags = [a for t in targets for a in ("--mount", f"{src}:{t}")]
    out = tmp_path / "o"
    code = app(["sandbox", "exec", "--role", "analyst", *flags, "--out", str(out), "--",
                "true"], standalone_mode=False)
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT, err
    assert "--mount" in err and "Fix" in err
    for w in words:
        assert w in err, err
    assert not out.exists()


# -- L3: upper bounds of role limits -------------------------------------------------------
@pytest.mark.parametrize(("override", "field", "words"), [
    ({"nofile": 1_000_000_000_000}, "nofile", [str(NOFILE_MAX), "1 to"]),
    ({"nofile": NOFILE_MAX + 1}, "nofile", [str(NOFILE_MAX)]),
    ({"memory": "2t"}, "memory", ["1 TiB", "1t"]),
    ({"memory": ROLE_SIZE_MAX + 1}, "memory", ["1 TiB"]),
    ({"file_size": "1025g"}, "file_size", ["1 TiB"]),
    ({"stdout_cap": "2t"}, "stdout_cap", ["1 TiB"]),
    ({"output_cap": "2t"}, "output_cap", ["1 TiB"]),
    ({"tmpfs": {"/tmp": "2t"}}, "tmpfs", ["1 TiB", "/tmp"]),
    ({"user": "99999999999:10001"}, "user", ["4294967294"]),
    ({"user": "10001:4294967295"}, "user", ["4294967294"]),
])
def test_limits_above_their_range_are_refused_by_field(
        tmp_path: Path, override: dict[str, object], field: str, words: list[str]) -> None:
    _refused(tmp_path, f"roles.analyst.{field}", *words, **override)


@pytest.mark.parametrize(("override", "field"), [
    ({"nofile": 0}, "nofile"), ({"memory": 0}, "memory"), ({"file_size": "0"}, "file_size"),
    ({"cpus": 0}, "cpus"), ({"pids": 0}, "pids"), ({"timeout_s": 0}, "timeout_s"),
    ({"cpus": 65}, "cpus"), ({"pids": 32769}, "pids"), ({"timeout_s": 7 * 86400 + 1},
                                                        "timeout_s"),
])
def test_existing_bounds_still_hold(tmp_path: Path, override: dict[str, object],
                                    field: str) -> None:
    _refused(tmp_path, f"roles.analyst.{field}", **override)


def test_limits_at_their_caps_load(tmp_path: Path) -> None:
    pols = load_policies(_roles(tmp_path, nofile=NOFILE_MAX, memory="1t", file_size="1t",
                                stdout_cap="1t", output_cap="512g", tmpfs={"/tmp": "256g"},
                                user="4294967294:4294967294"))
    pol = pols.roles["analyst"]
    assert pol.nofile == NOFILE_MAX and pol.memory == ROLE_SIZE_MAX
