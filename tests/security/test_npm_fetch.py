"""The host-side npm fetch (project.npm) attacked: a tampered tarball, a tarball whose
entries escape its directory (``..``, an absolute name, a symlink, a hard link), an
install script, a ``file:`` and a git dependency. Each is refused by name, nothing from a
package runs on the host, and nothing is left in the cache, the layout or the build
context.

The hostile registry is a loopback HTTP server started here (``npm_config_registry``
pointed at it), so the real fetch code (urllib, bounded, redirects refused) runs."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import os
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runner.toolchain import AgentToolchains, NpmInput
from runner.toolchain.npm_fetch import lay_out
from runner.toolchain.npm_lock import NpmRefused, parse_lockfile


def sri(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def tgz(files: dict[str, bytes], *, extra: list[tarfile.TarInfo] | None = None) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
        for info in extra or []:
            tar.addfile(info)
    return out.getvalue()


class Registry:
    """A loopback 'npm registry' serving the tarballs it is given; counts requests."""

    def __init__(self) -> None:
        self.tarballs: dict[str, bytes] = {}
        self.requests: list[str] = []
        registry = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                registry.requests.append(self.path)
                body = registry.tarballs.get(self.path)
                if body is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def publish(self, name: str, version: str, body: bytes) -> str:
        path = f"/{name}/-/{name.rsplit('/', 1)[-1]}-{version}.tgz"
        self.tarballs[path] = body
        return self.url + path.lstrip("/")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[Registry]:
    r = Registry()
    monkeypatch.setenv("npm_config_registry", r.url)
    yield r
    r.close()


def lockfile(packages: dict[str, dict[str, Any]]) -> tuple[bytes, bytes]:
    deps = {k.rsplit("node_modules/", 1)[-1]: v.get("version", "") for k, v in packages.items()}
    doc = {"name": "agent", "lockfileVersion": 3,
           "packages": {"": {"name": "agent", "dependencies": deps}, **packages}}
    return json.dumps(doc).encode(), json.dumps({"name": "agent", "dependencies": deps}).encode()


def install(tmp: Path, registry: Registry, packages: dict[str, dict[str, Any]],
            ignore: tuple[str, ...] = ()) -> Path:
    """Parse and lay out like the builder does; returns the layout directory."""
    lock, pkg = lockfile(packages)
    plan = parse_lockfile(lock, pkg, source="package-lock.json", pkg_source="package.json",
                          registry=registry.url, ignore_scripts=ignore, path="cycle.yaml",
                          field="project.npm")
    ctx = tmp / "context"
    ctx.mkdir(exist_ok=True)
    lay_out(plan, ctx / "node_modules", tmp / "cache", lambda _m: None,
            source="package-lock.json", field="project.npm", path="cycle.yaml")
    return ctx / "node_modules"


def nothing_left(tmp: Path) -> None:
    ctx = tmp / "context"
    assert not ctx.exists() or list(ctx.iterdir()) == [], list(ctx.rglob("*"))
    cache = tmp / "cache"
    assert not cache.exists() or list(cache.iterdir()) == [], list(cache.iterdir())


def test_a_well_formed_package_is_laid_out_with_its_bin(tmp_path: Path,
                                                        registry: Registry) -> None:
    body = tgz({"package/package.json": b'{"name":"ok"}',
                "package/cli.js": b"#!/usr/bin/env node\n"})
    url = registry.publish("ok", "1.0.0", body)
    nm = install(tmp_path, registry, {"node_modules/ok": {
        "version": "1.0.0", "resolved": url, "integrity": sri(body), "bin": {"ok": "cli.js"}}})
    assert (nm / "ok" / "cli.js").read_bytes().startswith(b"#!")
    assert (nm / ".bin" / "ok").is_symlink()
    assert str((nm / ".bin" / "ok").readlink()) == "../ok/cli.js"
    assert (nm / "ok" / "cli.js").stat().st_mode & 0o111


def test_the_layout_is_readable_by_the_images_uid_whatever_the_hosts_umask(
        tmp_path: Path, registry: Registry) -> None:
    """helper-43 #5: under umask 077 node_modules, a scope and a package's own directory
    were 0700 (unreadable by the image's uid, and cached so under the image's tag)."""
    import stat

    body = tgz({"package/package.json": b'{"name":"@s/ok"}',
                "package/lib/cli.js": b"#!/usr/bin/env node\n"})
    url = registry.publish("@s/ok", "1.0.0", body)
    old = os.umask(0o077)
    try:
        nm = install(tmp_path, registry, {"node_modules/@s/ok": {
            "version": "1.0.0", "resolved": url, "integrity": sri(body),
            "bin": {"ok": "lib/cli.js"}}})
    finally:
        os.umask(old)
    modes = {str(p.relative_to(nm)): stat.S_IMODE(p.lstat().st_mode)
             for p in [nm, *nm.rglob("*")] if not p.is_symlink()}
    assert modes == {".": 0o755, "@s": 0o755, ".bin": 0o755, "@s/ok": 0o755,
                     "@s/ok/lib": 0o755, "@s/ok/package.json": 0o644,
                     "@s/ok/lib/cli.js": 0o755}, modes


def test_a_tarball_that_does_not_match_its_integrity_is_refused_unextracted(
        tmp_path: Path, registry: Registry) -> None:
    real = tgz({"package/index.js": b"module.exports = 1\n"})
    evil = tgz({"package/index.js": b"require('child_process').exec('id')\n"})
    url = registry.publish("lodash", "4.17.21", evil)  # the mirror serves something else
    with pytest.raises(NpmRefused, match=r"project\.npm: package-lock\.json: "
                       r"node_modules/lodash: the tarball .* does not match the lockfile's "
                       r"integrity.*nothing was extracted"):
        install(tmp_path, registry, {"node_modules/lodash": {
            "version": "4.17.21", "resolved": url, "integrity": sri(real)}})
    assert registry.requests == ["/lodash/-/lodash-4.17.21.tgz"]
    nothing_left(tmp_path)


def _link(name: str, target: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize(("files", "extra", "named"), [
    ({"package/../../escaped.js": b"x"}, [], r"package/\.\./\.\./escaped\.js|\.\./\.\./"
                                              r"escaped\.js"),
    ({"/etc/cron.d/evil": b"x"}, [], r"/etc/cron\.d/evil"),
    ({"package/index.js": b"x"}, [_link("package/link", "/etc/passwd", tarfile.SYMTYPE)],
     r"link"),
    ({"package/index.js": b"x"}, [_link("package/hard", "package/index.js", tarfile.LNKTYPE)],
     r"hard"),
    ({"evil.js": b"x"}, [], r"evil\.js.*outside the package"),
])
def test_a_tarball_escaping_its_directory_is_refused_by_name(
        tmp_path: Path, registry: Registry, files: dict[str, bytes],
        extra: list[tarfile.TarInfo], named: str) -> None:
    body = tgz(files, extra=extra)
    url = registry.publish("evil", "1.0.0", body)
    with pytest.raises(NpmRefused, match=r"node_modules/evil: evil@1\.0\.0's tarball was "
                       r"refused: .*(" + named + ")"):
        install(tmp_path, registry, {"node_modules/evil": {
            "version": "1.0.0", "resolved": url, "integrity": sri(body)}})
    assert not (tmp_path / "escaped.js").exists()
    assert not any(tmp_path.rglob("escaped.js"))
    ctx = tmp_path / "context"
    assert list(ctx.iterdir()) == []  # no half-laid-out node_modules


def test_an_install_script_is_refused_and_when_acknowledged_never_runs(
        tmp_path: Path, registry: Registry) -> None:
    marker = tmp_path / "PWNED"
    manifest = json.dumps({"name": "hooked", "version": "1.0.0", "scripts": {
        "preinstall": f"touch {marker}", "install": f"touch {marker}",
        "postinstall": f"touch {marker}"}}).encode()
    body = tgz({"package/package.json": manifest, "package/index.js": b""})
    url = registry.publish("hooked", "1.0.0", body)
    entry = {"version": "1.0.0", "resolved": url, "integrity": sri(body),
             "hasInstallScript": True}
    with pytest.raises(NpmRefused, match=r"'node_modules/hooked': hooked@1\.0\.0 declares an "
                       r"install script .*project\.npm_ignore_scripts"):
        install(tmp_path, registry, {"node_modules/hooked": entry})
    assert registry.requests == []  # refused before any fetch
    nothing_left(tmp_path)
    nm = install(tmp_path, registry, {"node_modules/hooked": entry}, ignore=("hooked",))
    assert (nm / "hooked" / "package.json").is_file()
    assert not marker.exists(), "an install script ran on the host"


@pytest.mark.parametrize(("entry", "named"), [
    ({"version": "1.0.0", "resolved": "file:../../../etc"}, "file: dependency"),
    ({"version": "file:../vendored"}, "file: dependency"),
    ({"version": "1.0.0", "resolved": "git+https://github.com/evil/evil.git#abc"},
     r"git\+https: dependency"),
    ({"version": "1.0.0", "resolved": "git+ssh://git@github.com/evil/evil.git#abc"},
     r"git\+ssh: dependency"),
    ({"version": "1.0.0", "resolved": "https://evil.example/evil-1.0.0.tgz"},
     "not on the npm registry"),
])
def test_file_git_and_url_dependencies_are_refused_before_any_fetch(
        tmp_path: Path, registry: Registry, entry: dict[str, Any], named: str) -> None:
    with pytest.raises(NpmRefused, match=r"'node_modules/evil': .*" + named):
        install(tmp_path, registry, {"node_modules/evil": {**entry, "integrity": sri(b"x")}})
    assert registry.requests == []
    nothing_left(tmp_path)


def test_a_redirect_off_the_registry_is_not_followed(tmp_path: Path, registry: Registry,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.errors import PrerequisiteError

    body = tgz({"package/index.js": b""})
    handler = registry.server.RequestHandlerClass

    def redirect(self: http.server.BaseHTTPRequestHandler) -> None:
        registry.requests.append(self.path)
        self.send_response(302)
        self.send_header("Location", "https://evil.example/x.tgz")
        self.end_headers()

    monkeypatch.setattr(handler, "do_GET", redirect)
    url = registry.url + "r/-/r-1.0.0.tgz"
    with pytest.raises(PrerequisiteError, match="302"):
        install(tmp_path, registry, {"node_modules/r": {
            "version": "1.0.0", "resolved": url, "integrity": sri(body)}})
    assert registry.requests == ["/r/-/r-1.0.0.tgz"]
    nothing_left(tmp_path)


@pytest.mark.docker
def test_the_builder_leaves_no_build_context_and_no_image_after_a_refusal(
        tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the derived-image builder: the refusal happens while the context is
    filled; the context directory is removed and no image is tagged."""
    from runner.isolation.docker.agent_image import derived_images, ensure_agent_image
    from runner.isolation.docker.images import resolve_image

    analyst = resolve_image("analyst")
    state = tmp_path / "state"
    monkeypatch.setenv("CYCLEBOX_STATE_DIR", str(state))
    body = tgz({"package/index.js": b"1"})
    url = registry.publish("tampered", "1.0.0", tgz({"package/index.js": b"2"}))
    lock, pkg = lockfile({"node_modules/tampered": {
        "version": "1.0.0", "resolved": url, "integrity": sri(body)}})
    tc = AgentToolchains(npm=NpmInput(lockfile=lock, package_json=pkg,
                                      source="package-lock.json"))
    before = {d.id for d in derived_images()}
    with pytest.raises(NpmRefused, match="does not match the lockfile's integrity"):
        ensure_agent_image(analyst, tc, lambda _m: None)
    assert list((state / "context").iterdir()) == []
    assert not list((state / "npm" / "tarballs").glob("*"))
    assert {d.id for d in derived_images()} == before


def test_a_decompression_bomb_stops_at_the_bound(tmp_path: Path, registry: Registry,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.toolchain import npm_fetch
    from runner.untar import Limits

    monkeypatch.setattr(npm_fetch, "LIMITS", Limits(max_entries=100, max_bytes=1 << 20,
                                                    max_depth=16))
    body = tgz({"package/zeros.bin": b"\0" * (8 << 20)})  # 8 MB of zeros: ~8 KB gzipped
    assert len(body) < 64 << 10
    url = registry.publish("bomb", "1.0.0", body)
    with pytest.raises(NpmRefused, match=r"bomb@1\.0\.0's tarball was refused: more than "
                       r"100 entries or 1048576 bytes unpacked"):
        install(tmp_path, registry, {"node_modules/bomb": {
            "version": "1.0.0", "resolved": url, "integrity": sri(body)}})
    assert list((tmp_path / "context").iterdir()) == []


def test_a_tarball_holding_a_nested_packages_place_is_refused(tmp_path: Path,
                                                              registry: Registry) -> None:
    outer = tgz({"package/index.js": b"", "package/node_modules/inner": b"a file"})
    inner = tgz({"package/index.js": b""})
    u1 = registry.publish("outer", "1.0.0", outer)
    u2 = registry.publish("inner", "1.0.0", inner)
    with pytest.raises(NpmRefused, match=r"node_modules/outer/node_modules/inner: its place is "
                       r"taken by a file of an enclosing package's tarball"):
        install(tmp_path, registry, {
            "node_modules/outer": {"version": "1.0.0", "resolved": u1, "integrity": sri(outer)},
            "node_modules/outer/node_modules/inner": {"version": "1.0.0", "resolved": u2,
                                                      "integrity": sri(inner)}})
    assert list((tmp_path / "context").iterdir()) == []


def test_the_tarball_sha256_is_of_the_bytes_fetched_and_of_the_checked_cache(
        tmp_path: Path, registry: Registry) -> None:
    """The provenance's sha256 (agent-artifacts.json) is hashed from the bytes whose sha512
    matched the lockfile: at fetch, and again from the cache, which is re-checked first."""
    from runner.toolchain.npm_fetch import cached_tarball, tarball_filename

    body = tgz({"package/package.json": b'{"name":"@s/ok"}'})
    url = registry.publish("@s/ok", "1.0.0", body)
    lock, pkg = lockfile({"node_modules/@s/ok": {"version": "1.0.0", "resolved": url,
                                                 "integrity": sri(body)}})
    plan = parse_lockfile(lock, pkg, source="package-lock.json", pkg_source="package.json",
                          registry=registry.url, ignore_scripts=(), path="cycle.yaml",
                          field="project.npm")
    (tmp_path / "context").mkdir()
    got = lay_out(plan, tmp_path / "context" / "node_modules", tmp_path / "cache",
                  lambda _m: None, source="package-lock.json", field="project.npm",
                  path="cycle.yaml")
    assert got == {"node_modules/@s/ok": hashlib.sha256(body).hexdigest()}
    assert tarball_filename(plan.packages[0]) == "ok-1.0.0.tgz"
    again = cached_tarball(plan.packages[0], tmp_path / "cache", source="package-lock.json",
                           field="project.npm", path="cycle.yaml")
    assert again.sha256 == hashlib.sha256(body).hexdigest()
    assert len(registry.requests) == 1  # the second came from the cache
    again.path.write_bytes(b"tampered")  # a corrupt cache entry is fetched again
    third = cached_tarball(plan.packages[0], tmp_path / "cache", source="package-lock.json",
                           field="project.npm", path="cycle.yaml")
    assert third.sha256 == hashlib.sha256(body).hexdigest()
    assert len(registry.requests) == 2


def _pax_tgz(n: int, *, chain: int = 1, pax: dict[str, str] | None = None,
             comment: int = 0) -> bytes:
    """``n`` one-byte files, each after ``chain`` PAX records (a comment of ``comment``
    bytes, plus ``pax``)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for i in range(n):
            for _ in range(chain - 1):  # bare extended headers in a row
                extra = tarfile.TarInfo("PaxHeader")
                extra.type = tarfile.XHDTYPE
                data = b"10 path=x\n"
                extra.size = len(data)
                tar.addfile(extra, io.BytesIO(data))
            info = tarfile.TarInfo(f"package/f{i}")
            info.size = 1
            info.pax_headers = {**({"comment": "c" * comment} if comment else {}),
                                **(pax or {})}
            tar.addfile(info, io.BytesIO(b"x"))
    return out.getvalue()


@pytest.mark.parametrize(("case", "body", "match"), [
    ("metadata-total", lambda: _pax_tgz(20, comment=(4 << 20) - 64),
     "more than 67108864 bytes of tar metadata records"),
    ("metadata-chain", lambda: _pax_tgz(1, chain=400), "or 8 in a row"),
])
def test_tar_metadata_is_bounded_over_the_whole_archive(
        tmp_path: Path, registry: Registry, case: str, body: Any, match: str) -> None:
    """An attack review: every PAX record was capped at 4 MB, but tarfile kept each one
    (with its member) for the whole archive: 400 one-byte files after 4 MB comments, a
    1.7 MB tarball, took 1.7 GB of host memory. A chain of 400 records raised
    RecursionError (exit 10). Both are refused by name."""
    data = body()
    url = registry.publish("meta", "1.0.0", data)
    with pytest.raises(NpmRefused, match=match):
        install(tmp_path, registry, {"node_modules/meta": {
            "version": "1.0.0", "resolved": url, "integrity": sri(data)}})
    assert list((tmp_path / "context").iterdir()) == []


@pytest.mark.parametrize("mtime", ["inf", "nan", "1e999", "-5"])
def test_an_odd_pax_mtime_is_clamped_not_a_crash(tmp_path: Path, registry: Registry,
                                                  mtime: str) -> None:
    data = _pax_tgz(1, pax={"mtime": mtime})
    url = registry.publish("odd", "1.0.0", data)
    nm = install(tmp_path, registry, {"node_modules/odd": {
        "version": "1.0.0", "resolved": url, "integrity": sri(data)}})
    assert (nm / "odd" / "f0").read_bytes() == b"x"


def test_the_packages_of_a_layout_are_bounded_together(
        tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """One small tarball installed under many keys (each unpacked on its own, each under
    the per-package bound) filled the disk: 16 KB fetched gave 513 MB (attack review)."""
    from runner.toolchain import npm_fetch

    monkeypatch.setattr(npm_fetch, "MAX_LAYOUT_BYTES", 3 << 20)
    body = tgz({"package/zeros.bin": b"\0" * (1 << 20)})
    url = registry.publish("blob", "1.0.0", body)
    packages = {f"node_modules/a{i}": {"name": "blob", "version": "1.0.0", "resolved": url,
                                       "integrity": sri(body)} for i in range(5)}
    with pytest.raises(NpmRefused, match=r"the packages unpack to more than 3145728 bytes "
                       r"together \(at node_modules/a3\)"):
        install(tmp_path, registry, packages)
    assert list((tmp_path / "context").iterdir()) == []


def test_the_tarballs_of_a_layout_are_bounded_together(
        tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """helper-43 #6: bytes past a tarball's tar end are fetched and cached but never
    unpacked, so the unpacked bound did not cap them (40 MB of them per package: 168 MB
    fetched for 144 B counted). The fetched tarballs are bounded together too."""
    import os as _os

    from runner.toolchain import npm_fetch

    monkeypatch.setattr(npm_fetch, "MAX_FETCHED_BYTES", 3 << 20)
    packages = {}
    for i in range(3):
        # random bytes after the gzip'd tar end: never unpacked, still downloaded
        body = tgz({"package/index.js": b"x"}) + _os.urandom(1 << 20)
        url = registry.publish(f"p{i}", "1.0.0", body)
        packages[f"node_modules/p{i}"] = {"version": "1.0.0", "resolved": url,
                                          "integrity": sri(body)}
    with pytest.raises(NpmRefused, match=r"tarballs come to more than 3145728 bytes "
                       r"\(at node_modules/p2\)"):
        install(tmp_path, registry, packages)
    assert list((tmp_path / "context").iterdir()) == []


@pytest.mark.parametrize(("resolved", "why"), [
    ("https://registry.npmjs.org:99999/a/-/a-1.0.0.tgz", "is not a URL"),
    ("https://[registry.npmjs.org/a/-/a-1.0.0.tgz", "is not a URL"),
    ("https://registry.npmjs.org/a/-/a\x1b]0;x\x07 -1.0.0.tgz", "holds a space, a control"),
])
def test_a_malformed_resolved_url_is_bad_input(tmp_path: Path, resolved: str,
                                               why: str) -> None:
    lock, pkg = lockfile({"node_modules/a": {"version": "1.0.0", "resolved": resolved,
                                             "integrity": sri(b"x")}})
    with pytest.raises(NpmRefused, match=why):
        parse_lockfile(lock, pkg, source="package-lock.json", pkg_source="package.json",
                       registry="https://registry.npmjs.org/", ignore_scripts=(),
                       path="cycle.yaml", field="project.npm")


@pytest.mark.parametrize("which", ["lockfile", "package.json"])
def test_a_deeply_nested_lockfile_is_bad_input(which: str) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    lock, pkg = lockfile({})
    lock, pkg = (deep, pkg) if which == "lockfile" else (lock, deep)
    with pytest.raises(NpmRefused, match="is not JSON"):
        parse_lockfile(lock, pkg, source="package-lock.json", pkg_source="package.json",
                       registry="https://registry.npmjs.org/", ignore_scripts=(),
                       path="cycle.yaml", field="project.npm")
