"""The derived analyst image with Debian and npm packages (project.apt, project.npm; issue
22): the node_kinds image, built once per session, is the hardened analyst plus node and
node_modules, labelled with what it installed, reused while unchanged; apt refuses a
package Debian does not have by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runner.errors import ConfigError

pytestmark = pytest.mark.docker

PROBE = """
import json, os, subprocess, sandbox.probe as p
f = p.facts('analyst', ['127.0.0.1:9'])
def run(*cmd):
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    return [r.returncode, r.stdout.strip()[-300:], r.stderr.strip()[-300:]]
f['node'] = run('node', '--version')
f['tsx'] = run('tsx', '--version')
f['esm'] = run('node', '--input-type=module', '-e',
               'import OpenAI from "openai"; import Anthropic from "@anthropic-ai/sdk";'
               'import { streamText } from "ai";'
               'import { createOpenAI } from "@ai-sdk/openai";'
               'console.log(typeof OpenAI, typeof Anthropic, typeof streamText,'
               ' typeof createOpenAI)')
f['write_node_modules'] = os.access('/node_modules', os.W_OK)
setuid = subprocess.run(['find', '/', '-xdev', '(', '-perm', '-4000', '-o', '-perm', '-2000',
                         ')', '-type', 'f'], capture_output=True, text=True).stdout.split()
f['setuid'] = setuid
print(json.dumps(f))
"""


def test_the_node_image_is_the_hardened_analyst_plus_node_and_its_packages(
        node_image: Any) -> None:
    from runner.isolation.docker.backend import DockerSandbox
    from runner.isolation.docker.images import resolve_image
    from runner.isolation.policy import load_policies
    from runner.isolation.roles import role_spec
    from runner.isolation.sandbox import StopReason
    from runner.paths import default_policies

    policy = load_policies(default_policies()).roles["analyst"]
    spec = role_spec(policy, role="analyst", run_id="test-agent-toolchains",
                     image=node_image.id, command=["python", "-c", PROBE])
    rec = DockerSandbox().run(spec)
    assert rec.stop_reason is StopReason.OK, rec.stderr_tail
    facts = json.loads(rec.stdout_tail)
    assert facts["node"][0] == 0 and facts["node"][1].startswith("v18."), facts["node"]
    assert facts["tsx"][0] == 0 and "tsx v4.23.15" in facts["tsx"][1], facts["tsx"]
    assert facts["esm"] == [0, "function function function function", ""], facts["esm"]
    assert facts["setuid"] == []
    assert facts["write_node_modules"] is False
    assert facts["interfaces"] == ["lo"] and facts["uid"] == 10001
    inspected = DockerSandbox().client.api.inspect_image(node_image.id)
    labels = inspected["Config"]["Labels"]
    assert labels["io.cyclebox.base"] == resolve_image("analyst")
    assert labels["io.cyclebox.role"] == "analyst"
    installed = json.loads(labels["io.cyclebox.agent_toolchains"])
    assert installed == node_image.installed
    assert any(p.startswith("nodejs=18.20") for p in installed["apt"])
    assert "tsx@4.23.15" in installed["npm"]
    assert not [p for p in installed["npm"] if p.startswith("@esbuild/darwin")]
    assert inspected["Config"]["User"] == "10001:10001"
    assert "/node_modules/.bin" in next(e for e in inspected["Config"]["Env"]
                                        if e.startswith("PATH="))


def test_an_unchanged_project_reuses_the_node_image(node_image: Any) -> None:
    from tests.fixtures.node_kinds import build_node_image

    again = build_node_image()
    assert (again.id, again.built) == (node_image.id, False)
    assert again.artifacts == node_image.artifacts


def test_the_node_image_names_every_deb_and_tarball_it_was_built_from(
        node_image: Any, tmp_path: Path) -> None:
    """agent-artifacts.json's source (issue 24): each .deb and npm tarball, by the sha256
    checked on the host; the same list when the kept copy is gone (recomputed from the
    verified tarball cache)."""
    from runner.isolation.docker.agent_image import _artifacts_file, ensure_agent_image
    from runner.isolation.docker.images import resolve_image
    from tests.fixtures.node_kinds import build_node_image, toolchains

    arts = {(a.ecosystem, a.name, a.version): a for a in node_image.artifacts}
    pins = {f"{n}={v}" for e, n, v in arts if e == "deb"}
    assert pins == set(node_image.installed["apt"])
    tsx = arts[("npm", "tsx", "4.23.15")]
    assert tsx.filename == "tsx-4.23.15.tgz"
    npm = {f"{n}@{v}" for e, n, v in arts if e == "npm"}
    assert npm == set(node_image.installed["npm"])
    assert all(len(a.sha256) == 64 for a in node_image.artifacts)
    img = ensure_agent_image(resolve_image("analyst"), toolchains(), lambda _line: None)
    kept = _artifacts_file(img.input_hash)
    assert kept.is_file()
    kept.unlink()
    assert build_node_image().artifacts == node_image.artifacts
    assert kept.is_file()


def test_a_package_debian_does_not_have_is_refused_by_name() -> None:
    from runner.isolation.docker.agent_image import ensure_agent_image
    from runner.isolation.docker.images import resolve_image
    from runner.toolchain import AgentToolchains

    with pytest.raises(ConfigError, match=r"project\.apt: apt cannot install "
                       r"\['no-such-package-cyclebox'\].*Unable to locate package"):
        ensure_agent_image(resolve_image("analyst"),
                           AgentToolchains(apt=("no-such-package-cyclebox",)), print)
