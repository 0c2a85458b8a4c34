"""The role launcher: policy + gateway + spec + run, on whatever Sandbox it is given."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from runner.errors import ConfigError
from runner.isolation.launcher import (
    EGRESS_ENV,
    ENDPOINT_ENV_NAMES,
    OFFLINE_ENV,
    TRUST_ENV,
    endpoint_env,
    launch,
    output_dir,
    placement_labels,
)
from runner.isolation.policy import RolePolicy, load_policies
from runner.isolation.sandbox import Mount
from runner.paths import default_policies
from tests.fixtures.fake_sandbox import Call, FakeSandbox, Result


@dataclass
class Binding:
    directory: Path
    role: str = "worker"

    def mount(self) -> Mount:
        return Mount(source=self.directory, target="/run/cyclebox/gateway", gateway=True)

    def env(self) -> dict[str, str]:
        return endpoint_env(f"tok-{self.role}")


@dataclass
class FakeGateway:
    """Records every binding; the socket directory is a plain directory."""

    root: Path
    calls: list[dict[str, Any]] = field(default_factory=list)
    open: int = 0

    @contextmanager
    def bound(self, role: str, *, stage: str, uid: int, case: str | None = None,
              trial: int | None = None) -> Iterator[Binding]:
        self.calls.append({"role": role, "stage": stage, "uid": uid, "case": case,
                           "trial": trial})
        d = self.root / f"g{len(self.calls)}"
        d.mkdir()
        self.open += 1
        try:
            yield Binding(d, role)
        finally:
            self.open -= 1


def policy(role: str, **update: Any) -> RolePolicy:
    return load_policies(default_policies()).roles[role].model_copy(update=update)


def test_role_policy_uid_and_gid() -> None:
    p = policy("worker", user="20002:30003")
    assert (p.uid, p.gid) == (20002, 30003)


def test_a_model_role_gets_a_socket_bound_for_its_own_uid(tmp_path: Path) -> None:
    gw = FakeGateway(tmp_path)
    seen: list[int] = []

    def worker(call: Call) -> Result:
        seen.append(gw.open)  # the socket is bound while the container runs
        return Result(files={"proposal.json": "{}"})

    box = FakeSandbox({"worker": worker})
    out = output_dir(policy("worker"), tmp_path / "out")
    cancel = threading.Event()
    chunks: list[tuple[str, bytes]] = []
    rec = launch(box, policy("worker", user="20002:20002"), role="worker", run_id="r1",
                 image="sha256:abc", command=["python", "-m", "sandbox.worker"],
                 mounts=[Mount(source=tmp_path, target="/in")], output_dir=out,
                 gateway=gw, stage="propose", cancel=cancel,
                 on_output=lambda s, b: chunks.append((s, b)))
    assert gw.calls == [{"role": "worker", "stage": "propose", "uid": 20002, "case": None,
                         "trial": None}]
    assert seen == [1] and gw.open == 0
    [spec] = box.specs
    assert [m.target for m in spec.mounts] == ["/in", "/run/cyclebox/gateway"]
    assert spec.mounts[-1].gateway and spec.mounts[-1].read_only
    assert dict(spec.labels) == {"io.cyclebox.stage": "propose"}
    assert spec.command == ("python", "-m", "sandbox.worker")
    assert spec.output_dir == out and (out / "proposal.json").read_text() == "{}"
    assert rec.stop_reason.value == "ok"


def test_a_bound_role_gets_the_endpoint_environment_over_any_other(tmp_path: Path) -> None:
    gw = FakeGateway(tmp_path)
    box = FakeSandbox({"analyst": lambda _c: Result()})
    pol = policy("analyst", env={"OPENAI_BASE_URL": "http://evil", "A": "1"})
    launch(box, pol, role="analyst", run_id="r1", image="img", command=["x"],
           env={"ANTHROPIC_API_KEY": "sk-from-caller", "B": "2"}, gateway=gw, stage="s")
    [spec] = box.specs
    env = dict(spec.env)
    assert env == {"A": "1", "B": "2", **endpoint_env("tok-analyst")}
    assert env["OPENAI_BASE_URL"] == env["OPENAI_API_BASE"] == "http://127.0.0.1:40080/v1"
    assert env["ANTHROPIC_BASE_URL"] == env["CYCLEBOX_GATEWAY_URL"] == "http://127.0.0.1:40080"
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == "tok-analyst"
    assert set(endpoint_env("t")) == set(ENDPOINT_ENV_NAMES) | set(OFFLINE_ENV) | set(EGRESS_ENV) \
        | set(TRUST_ENV)


def test_an_unbound_role_gets_no_endpoint_environment(tmp_path: Path) -> None:
    box = FakeSandbox({"analyst": lambda _c: Result(), "apply": lambda _c: Result()})
    launch(box, policy("analyst"), role="analyst", run_id="r1", image="img", command=["x"])
    launch(box, policy("apply"), role="apply", run_id="r1", image="img", command=["x"],
           gateway=FakeGateway(tmp_path))
    for spec in box.specs:
        assert not set(dict(spec.env)) & set(ENDPOINT_ENV_NAMES)


def test_a_role_without_upstream_gets_no_socket(tmp_path: Path) -> None:
    gw = FakeGateway(tmp_path)
    box = FakeSandbox({"apply": lambda _c: Result()})
    launch(box, policy("apply"), role="apply", run_id="r1", image="img", command=["true"],
           output_dir=output_dir(policy("apply"), tmp_path / "work"), output_target="/work",
           gateway=gw, stage="apply")
    assert gw.calls == []
    [spec] = box.specs
    assert spec.mounts == () and spec.output_target == "/work"


def test_without_a_gateway_a_model_role_has_no_model_access(tmp_path: Path) -> None:
    box = FakeSandbox({"analyst": lambda _c: Result()})
    launch(box, policy("analyst"), role="analyst", run_id="doctor", image="img",
           command=["python", "-m", "sandbox.probe"])
    [spec] = box.specs
    assert not any(m.gateway for m in spec.mounts)
    assert spec.labels == () and spec.output_dir is None


def test_spec_follows_the_policy(tmp_path: Path) -> None:
    pol = policy("analyst", memory=300 * 1024**2, timeout_s=7.0, env={"A": "1"})
    box = FakeSandbox({"analyst": lambda _c: Result()})
    launch(box, pol, role="analyst", run_id="r1", image="img", command=["x"],
           env={"B": "2"}, stage="baseline", case="c1", trial=0)
    [spec] = box.specs
    assert spec.resources.memory_bytes == 300 * 1024**2 and spec.timeout_s == 7.0
    assert dict(spec.env) == {"A": "1", "B": "2"}
    assert dict(spec.labels) == placement_labels("baseline", "c1", 0) == {
        "io.cyclebox.stage": "baseline", "io.cyclebox.case": "c1", "io.cyclebox.trial": "0"}


def test_output_dir_is_fresh(tmp_path: Path) -> None:
    out = output_dir(policy("analyst"), tmp_path / "a" / "out")
    assert out.is_dir() and (out.stat().st_mode & 0o777) == 0o700
    with pytest.raises(ConfigError, match="already exists"):
        output_dir(policy("analyst"), out)


def test_every_proxy_variable_points_at_the_deny_all_proxy_but_the_gateway_is_direct() -> None:
    env = endpoint_env("t")
    from sandbox.holder import EGRESS_PORT, RELAY_HOST

    proxies = {k: v for k, v in env.items() if k.lower().endswith("_proxy")
               and k.lower() != "no_proxy"}
    # no ALL_PROXY: httpx would build (and load a CA bundle for) one more transport
    assert set(proxies) == {"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"}
    assert set(proxies.values()) == {f"http://{RELAY_HOST}:{EGRESS_PORT}"}
    for name in ("NO_PROXY", "no_proxy"):
        assert RELAY_HOST in env[name].split(",")
    # the gateway endpoint is on the host NO_PROXY names, so clients reach it directly
    assert env["OPENAI_BASE_URL"].startswith(f"http://{RELAY_HOST}:")
    assert env["DISABLE_TELEMETRY"] == env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    # the trust store as its hashed directory: no bundle parsed per client transport
    assert env["SSL_CERT_DIR"] == "/etc/ssl/certs" and "SSL_CERT_FILE" not in env


def test_a_cycle_file_warm_that_cannot_be_warmed_is_refused_naming_the_field(
        tmp_path: Path) -> None:
    """``project.warm`` is checked when the cycle file is loaded: the file, the field and
    the fix named; a warm list on a python entry loads, and without it the frozen
    project is what it was (no ``warm`` key: old plans hash as before)."""
    import yaml

    from runner.cycle.config import load_cycle
    from runner.paths import PROJECT_ROOT

    doc = yaml.safe_load((PROJECT_ROOT / "examples/shop-analyst/cycle.yaml").read_text())
    assert doc["project"]["warm"] == ["openai"]
    path = tmp_path / "cycle.yaml"
    for entry, warm, why in [(["node", "/src/a.js"], ["openai"], "run by python"),
                             (["python", "-u", "/src/a.py"], ["openai"], "interpreter option"),
                             (["python", "/src/a.py"], ["openai;x"], "module name")]:
        path.write_text(yaml.safe_dump({**doc, "project": {**doc["project"], "entry": entry,
                                                            "warm": warm}}))
        with pytest.raises(ConfigError) as exc:
            load_cycle(path)
        assert str(path) in str(exc.value) and "project.warm" in str(exc.value), exc.value
        assert why in str(exc.value)
    path.write_text(yaml.safe_dump(doc))
    assert load_cycle(path)[0].project.warm == ("openai",)
    del doc["project"]["warm"]
    path.write_text(yaml.safe_dump(doc))
    assert "warm" not in load_cycle(path)[0].project.model_dump()


def test_an_output_directory_is_made_fresh_never_through_a_link_and_named_when_it_cannot(
        tmp_path: Path) -> None:
    """An attack review of ``sandbox exec --out``: a dangling link was followed and its
    target made (with every missing parent); an unwritable place was exit 10."""
    import os

    from runner.isolation.roles import fresh_output_dir

    made = fresh_output_dir(tmp_path / "new")
    assert made.is_dir() and oct(made.stat().st_mode & 0o777) == "0o700"
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "elsewhere" / "deep" / "target")
    with pytest.raises(ConfigError, match="already exists"):
        fresh_output_dir(link)
    assert not (tmp_path / "elsewhere").exists()
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.getuid() != 0:  # root writes anyway; a file as parent fails for everyone
        with pytest.raises(ConfigError, match="cannot make"):
            fresh_output_dir(locked / "out")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="cannot make"):
        fresh_output_dir(tmp_path / "afile" / "out")
