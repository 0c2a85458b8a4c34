"""An agent's Debian packages (``project.apt``): resolved and downloaded on the host by
apt itself, installed offline in the derived image.

The host's apt is run with a private state (``<state>/apt/``): its own sources (Debian
bookworm, bookworm-updates and bookworm-security from ``DEBIAN_MIRROR``, the mirror the
base image was bootstrapped from), its own lists, cache and preferences, and as its dpkg
status the ANALYST IMAGE's ``/var/lib/dpkg/status``, so apt resolves exactly what the
image lacks, whatever the host has installed. apt verifies the signed Release files
(the host's Debian archive keyring) and every .deb's SHA256 against them; each .deb's
SHA256 from ``--print-uris`` is checked again here before it enters a build context.
Only download commands run: no package is unpacked or configured on the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from runner.errors import ConfigError, PrerequisiteError

MAX_APT_PACKAGES = 64
MAX_APT_DEBS = 2000
"""At most this many .debs resolved for one image (``texlive-full`` alone needs ~480)."""
MAX_APT_BYTES = 2 * 1024 ** 3
"""At most this many bytes of .debs (2 GiB) resolved for one image."""
_CHUNK = 1024 * 1024
_PKG = re.compile(r"[a-z0-9][a-z0-9+.-]+(?:=[A-Za-z0-9.+~:-]+)?")
_URI = re.compile(r"^'(?P<url>[^']+)' (?P<file>\S+\.deb) (?P<size>\d+)(?: \S*)?$")
SUITES = ("bookworm", "bookworm-updates")
LISTS_MAX_AGE_S = 24 * 3600
"""Private package lists older than this are refreshed (``apt-get update``)."""
APT_TIMEOUT_S = 600
APT_FIX = ("list Debian bookworm package names, optionally pinned as name=version "
           "(e.g. nodejs=18.20.4+dfsg-1~deb12u3)")


@dataclass(frozen=True)
class AptDeb:
    """One .deb apt would download for the image."""

    package: str
    version: str
    arch: str
    url: str
    filename: str
    size: int
    sha256: str

    @property
    def pin(self) -> str:
        return f"{self.package}={self.version}"


def check_apt_names(names: tuple[str, ...], *, path: str, field: str = "project.apt"
                    ) -> tuple[str, ...]:
    """The package names, checked: plain Debian names (optionally ``=version``), never an
    option (nothing reaches apt-get's command line that it could read as a flag)."""
    if len(names) > MAX_APT_PACKAGES:
        raise ConfigError(f"{len(names)} packages; at most {MAX_APT_PACKAGES}", path=path,
                          field=field, fix=APT_FIX)
    for n in names:
        if not _PKG.fullmatch(n):
            shown = "".join(c if c.isprintable() else "?" for c in n[:80])
            raise ConfigError(f"{shown!r} is not a Debian package name", path=path,
                              field=field, fix=APT_FIX)
    if len(set(names)) != len(names):
        raise ConfigError("a package is listed twice", path=path, field=field, fix=APT_FIX)
    return tuple(sorted(names))


def parse_print_uris(stdout: str) -> list[tuple[str, str, str, str, str, int]]:
    """(package, version, arch, url, file, size) of each .deb ``apt-get install --print-uris
    -qq`` names (``'URL' FILE SIZE HASH`` lines; apt prints the MD5 there, so the SHA256
    comes from :func:`parse_show`), sorted by file name."""
    out = []
    for line in stdout.splitlines():
        m = _URI.match(line.strip())
        if not m:
            continue
        pkg, version, arch = unquote(m["file"][:-4]).split("_", 2)
        out.append((pkg, version, arch, m["url"], m["file"], int(m["size"])))
    return sorted(out)


def parse_show(stdout: str) -> dict[tuple[str, str], str]:
    """(package, version) -> SHA256 from ``apt-cache show`` records (the signed lists)."""
    out: dict[tuple[str, str], str] = {}
    for record in stdout.split("\n\n"):
        fields = dict(ln.split(": ", 1) for ln in record.splitlines()
                      if ": " in ln and not ln.startswith(" "))
        sha = fields.get("SHA256", "")
        if "Package" in fields and "Version" in fields and re.fullmatch(r"[0-9a-f]{64}", sha):
            out.setdefault((fields["Package"], fields["Version"]), sha)
    return out


def debs_of(print_uris: str, show: str) -> list[AptDeb]:
    """The .debs with their SHA256; ConfigError naming one the lists give no SHA256."""
    hashes = parse_show(show)
    out = []
    for pkg, version, arch, url, file, size in parse_print_uris(print_uris):
        sha = hashes.get((pkg, version))
        if sha is None:
            raise ConfigError(f"apt's lists give no SHA256 for {pkg}={version}",
                              field="project.apt", fix="use a mirror that publishes SHA256")
        out.append(AptDeb(package=pkg, version=version, arch=arch, url=url,
                          filename=file, size=size, sha256=sha))
    return out


def installed_packages(status: bytes) -> set[str]:
    """The packages a dpkg status file records as installed."""
    out = set()
    for record in status.decode("utf-8", "replace").split("\n\n"):
        fields = dict(ln.split(": ", 1) for ln in record.splitlines()
                      if ": " in ln and not ln.startswith(" "))
        if "Package" in fields and fields.get("Status", "").endswith(" installed"):
            out.add(fields["Package"].strip())
    return out


def check_resolved(names: tuple[str, ...], debs: list[AptDeb], installed: set[str], *,
                   path: str, field: str = "project.apt") -> None:
    """ConfigError unless apt took every requested name as exactly that package (the
    image has it, or one of ``debs`` is it), and the .debs fit the caps. apt reads a
    name that is no package as a pattern (``fonts-noto-c.+`` installs four) and a
    virtual name as whatever provides it: neither is what was listed."""
    got = {d.package for d in debs} | installed
    shown = sorted(d.package for d in debs)
    for n in names:
        name = n.split("=", 1)[0]
        if name not in got:
            raise ConfigError(f"{name!r} is not a Debian package apt installs by that exact "
                              "name (apt took it as a pattern or a virtual package: "
                              f"{', '.join(shown[:5]) or 'nothing'}"
                              f"{' ...' if len(shown) > 5 else ''})", path=path, field=field,
                              fix="list the exact package names (apt-cache policy NAME "
                                  "shows one)")
    total = sum(d.size for d in debs)
    if len(debs) > MAX_APT_DEBS or total > MAX_APT_BYTES:
        raise ConfigError(f"{list(names)[:5]} need {len(debs)} .debs ({total / 2**30:.2f} "
                          f"GiB); at most {MAX_APT_DEBS} .debs and {MAX_APT_BYTES / 2**30:.2f} "
                          "GiB per image",
                          path=path, field=field,
                          fix="list fewer or smaller packages (e.g. not a -full metapackage)")


def sources_list(mirror: str, security: str) -> str:
    """The private sources: the base image's suite, its updates and its security fixes."""
    lines = [f"deb {mirror} {s} main" for s in SUITES]
    lines.append(f"deb {security} bookworm-security main")
    return "".join(f"{ln}\n" for ln in lines)


class AptResolver:
    """apt on the host with a private state seeded from an image's dpkg status."""

    def __init__(self, root: Path, image_status: bytes) -> None:
        self.root = root
        mirror = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
        security = os.environ.get("DEBIAN_SECURITY_MIRROR",
                                  "http://deb.debian.org/debian-security")
        for d in ("lists/partial", "archives/partial", "etc/preferences.d", "etc/parts"):
            (root / d).mkdir(parents=True, exist_ok=True)
        self._write(root / "etc" / "sources.list", sources_list(mirror, security).encode())
        status_sha = hashlib.sha256(image_status).hexdigest()[:16]
        self.status = root / f"status-{status_sha}"
        self._write(self.status, image_status)

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        if not path.is_file() or path.read_bytes() != data:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)

    def _apt(self, *args: str, tool: str = "apt-get", archives: Path | None = None
             ) -> subprocess.CompletedProcess[str]:
        r = self.root
        opts = {
            "Dir::State": str(r), "Dir::State::Lists": str(r / "lists"),
            "Dir::State::status": str(self.status),
            "Dir::Cache": str(r), "Dir::Cache::archives": str(archives or r / "archives"),
            "Dir::Cache::pkgcache": "", "Dir::Cache::srcpkgcache": "",
            "Dir::Etc::SourceList": str(r / "etc" / "sources.list"),
            "Dir::Etc::SourceParts": str(r / "etc" / "parts"),
            "Dir::Etc::Preferences": str(r / "etc" / "preferences"),
            "Dir::Etc::PreferencesParts": str(r / "etc" / "preferences.d"),
            "APT::Architecture": "amd64", "APT::Architectures": "amd64",
            "APT::Install-Recommends": "false", "APT::Install-Suggests": "false",
            "Acquire::Languages": "none", "Debug::NoLocking": "true",
        }
        cmd = [tool, "-q"]
        for k, v in opts.items():
            cmd += ["-o", f"{k}={v}"]
        try:
            return subprocess.run([*cmd, *args], capture_output=True, text=True,
                                  timeout=APT_TIMEOUT_S, check=False,
                                  env={**os.environ, "DEBIAN_FRONTEND": "noninteractive",
                                       "LC_ALL": "C"})
        except FileNotFoundError:
            raise PrerequisiteError("apt-get is not installed on this host; project.apt "
                                    "resolves Debian packages with it. Fix: run on Debian "
                                    "12 (or drop project.apt)") from None
        except subprocess.TimeoutExpired:
            raise PrerequisiteError(f"apt-get {args[0]} took more than {APT_TIMEOUT_S} s. "
                                    "Fix: check the Debian mirror (DEBIAN_MIRROR)") from None

    def update(self) -> None:
        """``apt-get update`` of the private lists when missing or a day old."""
        stamp = self.root / "lists" / ".updated"
        if stamp.is_file() and time.time() - stamp.stat().st_mtime < LISTS_MAX_AGE_S:
            return
        done = self._apt("update")
        if done.returncode != 0:
            raise PrerequisiteError(f"apt-get update failed: {_tail(done.stderr)}. Fix: make "
                                    "the Debian mirror reachable (DEBIAN_MIRROR)")
        stamp.touch()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One apt at a time on this private state (apt's own locks are off: they would
        be the host's): concurrent freezes of one state directory queue here."""
        with (self.root / "lock").open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def resolve(self, names: tuple[str, ...], *, path: str) -> list[AptDeb]:
        """The .debs ``names`` need beyond what the image has (nothing downloaded)."""
        with self._locked():
            return self._resolve(names, path=path)

    def _resolve(self, names: tuple[str, ...], *, path: str) -> list[AptDeb]:
        self.update()
        # the answer depends only on the lists, the image's status and the names: kept
        # until the lists are refreshed (an unchanged project's freeze runs no apt)
        stamp = (self.root / "lists" / ".updated").stat().st_mtime_ns
        key = hashlib.sha256(f"{stamp}\n{self.status.name}\n{' '.join(names)}".encode())
        memo = self.root / "resolved" / f"{key.hexdigest()[:32]}.json"
        debs: list[AptDeb] | None = None
        if memo.is_file():
            try:
                debs = [AptDeb(**d) for d in json.loads(memo.read_text())]
            except (ValueError, TypeError):
                memo.unlink()  # unreadable: resolved again
        if debs is None:
            debs = self._resolve_now(names, path=path)
            memo.parent.mkdir(exist_ok=True)
            tmp = memo.with_name(memo.name + ".tmp")
            tmp.write_text(json.dumps([dataclasses.asdict(d) for d in debs]))
            os.replace(tmp, memo)
        check_resolved(names, debs, installed_packages(self.status.read_bytes()), path=path)
        return debs

    def _resolve_now(self, names: tuple[str, ...], *, path: str) -> list[AptDeb]:
        # --print-uris leaves out what the archive cache already holds: resolve against an
        # empty one, so the list is always everything the image lacks
        empty = self.root / "resolve-archives"
        shutil.rmtree(empty, ignore_errors=True)
        (empty / "partial").mkdir(parents=True)
        done = self._apt("install", "--print-uris", "-qq", "-y", "--no-remove", "--", *names,
                         archives=empty)
        if done.returncode != 0:
            raise ConfigError(f"apt cannot install {list(names)} into the analyst image: "
                              f"{_tail(done.stderr)}", path=path, field="project.apt",
                              fix=APT_FIX)
        pins = [f"{p}={v}" for p, v, *_ in parse_print_uris(done.stdout)]
        show = self._apt_cache("show", "--no-all-versions", "--", *pins) if pins else ""
        return debs_of(done.stdout, show)

    def _apt_cache(self, *args: str) -> str:
        done = self._apt(*args, tool="apt-cache")
        if done.returncode != 0:
            raise PrerequisiteError(f"apt-cache {args[0]} failed: {_tail(done.stderr)}")
        return done.stdout

    def download(self, names: tuple[str, ...], debs: list[AptDeb], dest: Path) -> None:
        """Download ``debs`` (apt checks them against the signed lists) and copy each,
        its SHA256 checked again, into ``dest``."""
        with self._locked():
            self._download(names, debs, dest)

    def _download(self, names: tuple[str, ...], debs: list[AptDeb], dest: Path) -> None:
        done = self._apt("install", "--download-only", "-qq", "-y", "--no-remove", "--",
                         *names)
        if done.returncode != 0:
            raise PrerequisiteError(f"apt-get download failed: {_tail(done.stderr)}. Fix: "
                                    "make the Debian mirror reachable (DEBIAN_MIRROR)")
        dest.mkdir(parents=True, exist_ok=True)
        for d in debs:
            src = self.root / "archives" / d.filename
            if _copy_hashed(src, dest / d.filename) != d.sha256:
                src.unlink(missing_ok=True)
                (dest / d.filename).unlink(missing_ok=True)
                raise PrerequisiteError(f"{d.filename}: the downloaded .deb does not match "
                                        f"apt's SHA256 {d.sha256[:16]}... Fix: run again "
                                        f"(the file was removed: {src})")


def _copy_hashed(src: Path, dest: Path) -> str:
    """Copy ``src`` to ``dest`` in chunks; the SHA256 of the bytes copied ('' when
    ``src`` is no regular file). The copy is what is checked, never a second read."""
    h = hashlib.sha256()
    if not src.is_file():
        return ""
    try:
        with src.open("rb") as f, dest.open("wb") as out:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                out.write(chunk)
    except OSError:
        return ""
    return h.hexdigest()


def _tail(stderr: str) -> str:
    from runner.failures import one_line

    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("W:")]
    return one_line(" / ".join(lines[-6:]) or "(apt printed nothing)", 600)


__all__ = ["MAX_APT_BYTES", "MAX_APT_DEBS", "AptDeb", "AptResolver", "check_apt_names",
           "check_resolved", "debs_of", "installed_packages", "parse_print_uris", "parse_show",
           "sources_list"]
