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
    with pytest.raises(PrerequisiteError):
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
    with pytest.raises(PrerequisiteError, match="only wheels"):
        download_wheels(req, tmp_path / "wheels", lambda _m: None, what="the agent")
    assert not marker.exists(), "a dependency's sdist was built on the host"
