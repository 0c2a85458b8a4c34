"""The node kinds' real lockfile with Codex CLI and Claude Code in it: Codex's platform
build comes as an npm alias (``@openai/codex-linux-x64`` is ``npm:@openai/codex@
0.171.0-linux-x64``) and is laid out under the alias from the real package's tarball;
Claude Code's install script must be acknowledged; other platforms' builds are skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.toolchain.npm_lock import DEFAULT_REGISTRY, NpmRefused, parse_lockfile

PROJECT = Path(__file__).resolve().parents[1] / "e2e" / "agents" / "node_kinds" / "project"
IGNORED = ("esbuild", "@anthropic-ai/claude-code")


def _plan(lock: bytes, ignore: tuple[str, ...] = IGNORED):  # type: ignore[no-untyped-def]
    return parse_lockfile(lock, (PROJECT / "package.json").read_bytes(),
                          source="package-lock.json", pkg_source="package.json",
                          registry=DEFAULT_REGISTRY, ignore_scripts=ignore, path="cycle.yaml",
                          field="project.npm")


def test_the_clis_native_builds_are_laid_out_and_no_other_platform() -> None:
    plan = _plan((PROJECT / "package-lock.json").read_bytes())
    by_key = {p.key: p for p in plan.packages}
    codex = by_key["node_modules/@openai/codex-linux-x64"]
    assert codex.url == "https://registry.npmjs.org/@openai/codex/-/codex-0.171.0-linux-x64.tgz"
    assert codex.version == "0.171.0-linux-x64"
    assert "node_modules/@anthropic-ai/claude-code-linux-x64" in by_key
    assert by_key["node_modules/@anthropic-ai/claude-code"].scripts_ignored is True
    skipped = {k for k, _ in plan.skipped}
    assert {"node_modules/@openai/codex-darwin-arm64",
            "node_modules/@anthropic-ai/claude-code-linux-x64-musl"} <= skipped
    assert not any("darwin" in k or "win32" in k or "musl" in k for k in by_key)


def test_claude_codes_install_script_is_refused_unless_acknowledged() -> None:
    with pytest.raises(NpmRefused, match=r"claude-code@2\.1\.332 declares an install script"):
        _plan((PROJECT / "package-lock.json").read_bytes(), ("esbuild",))


def test_an_alias_must_name_a_package() -> None:
    doc = json.loads((PROJECT / "package-lock.json").read_bytes())
    doc["packages"]["node_modules/@openai/codex-linux-x64"]["name"] = "../../etc"
    with pytest.raises(NpmRefused, match="not a package name"):
        _plan(json.dumps(doc).encode())
