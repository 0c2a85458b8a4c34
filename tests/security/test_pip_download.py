"""The host's ``pip download`` of an agent's requirements runs no project code.

A requirement line that names an archive (``evil.tar.gz``) is a local file to pip, found
relative to the working directory; pip builds an sdist's metadata even under
``--only-binary=:all:``, running its build backend on the host. The operator's working
directory is often the project checkout, so the attacker controls that file."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.errors import ConfigError, PrerequisiteError
from runner.isolation.docker.images import download_wheels
from runner.requirements import check_requirements

_BACKEND = '''\
import pathlib
pathlib.Path({marker!r}).write_text("ran on the host")
def get_requires_for_build_wheel(config_settings=None): return []
'''


def _evil_sdist(where: Path, marker: Path) -> Path:
    """``where/evil.tar.gz``: an sdist whose in-tree build backend (no build requirement,
    so no network) writes ``marker`` when imported."""
    import tarfile

    src = where / "src" / "evil-1.0"
    src.mkdir(parents=True)
    (src / "pyproject.toml").write_text('[build-system]\nrequires = []\n'
                                        'build-backend = "backend"\nbackend-path = ["."]\n')
    (src / "backend.py").write_text(_BACKEND.format(marker=str(marker)))
    (src / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n")
    with tarfile.open(where / "evil.tar.gz", "w:gz") as tar:
        tar.add(src, arcname="evil-1.0")
    return where / "evil.tar.gz"


@pytest.mark.parametrize("line", ["evil.tar.gz", "evil.zip", "evil-1.0-py3-none-any.whl",
                                  "evil.tgz", "evil.tar", "Evil.TAR.BZ2", "evil.tar.xz"])
def test_an_archive_name_is_not_a_plain_requirement(line: str) -> None:
    with pytest.raises(ConfigError, match="is not a plain requirement"):
        check_requirements(f"{line}\n".encode(), source="requirements.txt",
                           path="cycle.yaml", field="project.requirements")


def test_pip_download_does_not_read_the_operators_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "PWNED"
    project = tmp_path / "project"
    project.mkdir()
    _evil_sdist(project, marker)
    req = tmp_path / "req.txt"
    req.write_text("evil.tar.gz\n")         # past the line check: the download's own guard
    monkeypatch.chdir(project)
    monkeypatch.delenv("PIP_DOWNLOAD_ARGS", raising=False)
    with pytest.raises((PrerequisiteError, ConfigError)):
        download_wheels(req, tmp_path / "wheels", lambda _m: None, what="the agent")
    assert not marker.exists(), "the project's sdist ran on the host"


def test_pip_is_not_imported_from_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m pip`` puts its working directory first on sys.path: a project checkout
    holding a ``pip/`` package ran it on the host instead of pip."""
    marker = tmp_path / "PWNED"
    fake = tmp_path / "project" / "pip"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r})"
                                      ".write_text('ran')\n")
    req = tmp_path / "req.txt"
    req.write_text("humanize==4.12.3\n")
    monkeypatch.chdir(fake.parent)
    monkeypatch.setenv("PIP_DOWNLOAD_ARGS", f"--no-index --find-links {tmp_path / 'none'}")
    with pytest.raises(PrerequisiteError):
        download_wheels(req, tmp_path / "wheels", lambda _m: None, what="the agent")
    assert not marker.exists(), "a pip/ package in the working directory ran on the host"


def test_a_wheels_direct_url_dependency_is_not_built_on_the_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wheel may declare ``Requires-Dist: evil @ file:///...tar.gz`` (or https://):
    pip downloads and builds that sdist to read its metadata, --only-binary=:all:
    notwithstanding. PyPI refuses such uploads; another index (PIP_DOWNLOAD_ARGS) need
    not. Offline here: the index is a --find-links directory."""
    import zipfile

    marker = tmp_path / "PWNED"
    sdist = _evil_sdist(tmp_path, marker)
    index = tmp_path / "index"
    index.mkdir()
    meta = ("Metadata-Version: 2.1\nName: lure\nVersion: 1.0\n"
            f"Requires-Dist: evil @ {sdist.as_uri()}\n")
    wheel = ("Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\n"
             "Tag: py3-none-any\n")
    with zipfile.ZipFile(index / "lure-1.0-py3-none-any.whl", "w") as z:
        z.writestr("lure-1.0.dist-info/METADATA", meta)
        z.writestr("lure-1.0.dist-info/WHEEL", wheel)
        z.writestr("lure-1.0.dist-info/RECORD", "lure-1.0.dist-info/METADATA,,\n"
                   "lure-1.0.dist-info/WHEEL,,\nlure-1.0.dist-info/RECORD,,\n")
    req = tmp_path / "req.txt"
    req.write_text("lure==1.0\n")
    monkeypatch.setenv("PIP_DOWNLOAD_ARGS", f"--no-index --find-links {index}")
    with pytest.raises(ConfigError, match=r"lure-1\.0-py3-none-any\.whl requires 'evil @ file"):
        download_wheels(req, tmp_path / "wheels", lambda _m: None, what="the agent")
    assert not marker.exists(), "a dependency's sdist was built on the host"


def _wheel(where: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A minimal pure-Python wheel whose METADATA lists ``requires`` as Requires-Dist."""
    import zipfile

    path = where / f"{name}-{version}-py3-none-any.whl"
    meta = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            + "".join(f"Requires-Dist: {r}\n" for r in requires))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
        z.writestr(f"{name}-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: t\n"
                   "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{name}-{version}.dist-info/RECORD", "")
    return path


@pytest.mark.parametrize("target", ["passwd", "host-wheel", "http"])
def test_a_wheels_direct_url_dependency_is_refused_before_anything_is_fetched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    """Issue 21 ("requirements on the host"): a wheel from the index whose metadata says
    ``Requires-Dist: evil @ file:///etc/passwd`` made the host's pip read that file (or
    copy a host wheel into build/wheels/agent/, or fetch an http URL). Refused by name
    (the wheel and the requirement) before the URL is touched; nothing is left in the
    wheel directory."""
    import http.server
    import threading

    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "host").mkdir()
    secret = _wheel(tmp_path / "host", "evil", "1.0") if target == "host-wheel" else None
    url = {"passwd": "file:///etc/passwd",
           "host-wheel": secret.as_uri() if secret else "",
           "http": f"http://127.0.0.1:{server.server_address[1]}/evil-1.0-py3-none-any.whl",
           }[target]
    index = tmp_path / "index"
    index.mkdir()
    _wheel(index, "lure", "1.0", (f"evil @ {url}",))
    req = tmp_path / "req.txt"
    req.write_text("lure==1.0\n")
    monkeypatch.setenv("PIP_DOWNLOAD_ARGS", f"--no-index --find-links {index}")
    wheels = tmp_path / "state" / "wheels" / "agent" / "x"
    try:
        with pytest.raises(ConfigError) as caught:
            download_wheels(req, wheels, lambda _m: None, what="the agent",
                            field="project.requirements")
    finally:
        server.shutdown()
    text = str(caught.value)
    assert "project.requirements" in text
    assert "lure-1.0-py3-none-any.whl" in text and f"evil @ {url}" in text, text
    assert hits == [], f"the host fetched {hits}"
    assert not wheels.exists()
    assert list(wheels.parent.iterdir()) == [], "a partial wheel directory was left"


def test_the_metadata_check_refuses_what_pip_would_let_through(tmp_path: Path) -> None:
    """Second line behind pip's hook: every downloaded wheel's Requires-Dist is read."""
    from runner.requirements import requires_dist_urls

    bad = _wheel(tmp_path, "lure", "1.0", ("evil @ https://x.invalid/e.whl",
                                            "ok>=1 ; python_version >= '3'",
                                            "vcs @ git+https://x.invalid/r"))
    assert requires_dist_urls(bad) == ["evil @ https://x.invalid/e.whl",
                                       "vcs @ git+https://x.invalid/r"]
    assert requires_dist_urls(_wheel(tmp_path, "fine", "1.0", ("a==1", "b[x]>=2"))) == []
    (tmp_path / "junk-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    assert requires_dist_urls(tmp_path / "junk-1.0-py3-none-any.whl")
    # METADATA under a compression zipfile cannot read (9, deflate64): refused, not a crash
    odd = bytearray(_wheel(tmp_path, "odd", "1.0", ("a==1",)).read_bytes())
    for sig, at in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
        i = odd.find(sig)
        while i >= 0:
            odd[i + at:i + at + 2] = (9).to_bytes(2, "little")
            i = odd.find(sig, i + 4)
    (tmp_path / "odd2-1.0-py3-none-any.whl").write_bytes(bytes(odd))
    assert requires_dist_urls(tmp_path / "odd2-1.0-py3-none-any.whl") == [
        "<unreadable wheel: NotImplementedError>"]


def test_a_cached_wheel_set_is_checked_too(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A wheel directory cached before the metadata check (its stamp still matching) is
    refused the same way instead of being reused."""
    import hashlib

    monkeypatch.delenv("PIP_DOWNLOAD_ARGS", raising=False)
    req = tmp_path / "req.txt"
    req.write_text("lure==1.0\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "lure", "1.0", ("evil @ file:///etc/passwd",))
    (wheels / ".stamp").write_text(hashlib.sha256(req.read_bytes()).hexdigest())
    (wheels / ".digest").write_text("0" * 64)
    with pytest.raises(ConfigError, match=r"lure-1\.0-py3-none-any\.whl requires 'evil @"):
        download_wheels(req, wheels, lambda _m: None, what="the agent",
                        field="project.requirements")
