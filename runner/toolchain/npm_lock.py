"""An agent's npm lockfile (``project.npm``), read as npm ci reads it, refused where npm
would run or fetch something we cannot check.

Pure: bytes in, a typed plan out. What passes is exactly what ``npm ci`` would install
from a v2/v3 lockfile's ``packages`` map (arborist's ``loadVirtual``): each key
(``node_modules/a/node_modules/b``) is where the package goes, ``resolved`` the tarball
(pacote derives ``<registry>/<name>/-/<base>-<version>.tgz`` when npm wrote none, as
``omit-lockfile-registry-resolved`` does) and ``integrity`` the SRI digest the tarball
must match. Refused, each by name with the fix (exit 3):

* a ``file:``, ``link:``, git, GitHub shorthand or any URL not under the npm registry
  (``npm_config_registry`` when set), a workspace link (``link: true``);
* a missing or non-sha512 ``integrity`` (nothing unverified is ever extracted);
* ``hasInstallScript`` unless the operator lists the name in ``project.npm_ignore_scripts``
  (it is then installed WITHOUT its script: we never run a lifecycle script anywhere);
* a package whose ``os``/``cpu``/``libc`` excludes linux x64 glibc that is not optional
  (an optional one is skipped, as npm skips it, and named in the build log);
* a lockfile out of step with its package.json (npm ci refuses that too).

An npm alias (``npm:real@version``) is installed under its alias, from the real
package's registry tarball.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from runner.errors import ConfigError

MAX_LOCKFILE_BYTES = 16 * 1024 * 1024
"""Largest package-lock.json read."""
MAX_PACKAGE_JSON_BYTES = 1024 * 1024
MAX_PACKAGES = 5000
"""Most lockfile entries accepted (a CLI with its whole tree has a few hundred)."""
DEFAULT_REGISTRY = "https://registry.npmjs.org/"
PLATFORM = {"os": "linux", "cpu": "x64", "libc": "glibc"}
"""The analyst image's platform (Debian bookworm, amd64, glibc)."""
LOCK_FIX = ("regenerate the lockfile from the npm registry with `npm install "
            "--package-lock-only --ignore-scripts` next to package.json and commit both")

_NAME = re.compile(r"(?:@[a-z0-9][a-z0-9._~-]*/)?[a-z0-9_][a-z0-9._~-]*", re.IGNORECASE)
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,127}")
_BIN_NAME = re.compile(r"[A-Za-z0-9@_][A-Za-z0-9._@+-]*")
_NOT_REGISTRY = re.compile(r"^(?:file:|link:|git\+|git:|github:|gitlab:|bitbucket:|gist:)")


class NpmRefused(ConfigError):
    """The lockfile asks for something cyclebox does not install (exit 3)."""


@dataclass(frozen=True)
class NpmPackage:
    """One lockfile entry that will be laid out."""

    key: str
    """Where it goes, relative to the install root (``node_modules/a/node_modules/b``)."""
    name: str
    version: str
    url: str
    """The tarball, under the registry."""
    integrity: str
    """The SRI ``sha512-<base64>`` the tarball must match before it is extracted."""
    bin: tuple[tuple[str, str], ...] = ()
    """(link name, path inside the package) for ``<parent node_modules>/.bin``."""
    scripts_ignored: bool = False
    """It declares an install script the operator acknowledged (never run)."""

    @property
    def sha512_hex(self) -> str:
        return base64.b64decode(self.integrity.split("-", 1)[1]).hex()


@dataclass(frozen=True)
class NpmPlan:
    """What a lockfile installs."""

    packages: tuple[NpmPackage, ...]
    skipped: tuple[tuple[str, str], ...]
    """(key, why) of optional packages for another platform, as npm skips them."""

    def pins(self) -> list[str]:
        """``name@version`` of each installed package, in key order (for labels/plan)."""
        return [f"{p.name}@{p.version}" for p in self.packages]


def registry_from_env(env: dict[str, str]) -> str:
    """The registry npm would use: ``npm_config_registry`` (either case), with a slash."""
    reg = env.get("npm_config_registry") or env.get("NPM_CONFIG_REGISTRY") or DEFAULT_REGISTRY
    return reg if reg.endswith("/") else reg + "/"


def _refuse(source: str, key: str, why: str, *, path: str, field: str, fix: str) -> NpmRefused:
    from runner.failures import one_line

    return NpmRefused(f"{source}: {one_line(key, 200)!r}: {one_line(why, 400)}", path=path,
                      field=field, fix=fix)


def _json(data: bytes, limit: int, source: str, *, path: str, field: str) -> dict[str, object]:
    if len(data) > limit:
        raise NpmRefused(f"{source} has {len(data)} bytes; at most {limit}", path=path,
                         field=field, fix=LOCK_FIX)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise NpmRefused(f"{source} is not JSON ({exc})", path=path, field=field,
                         fix=LOCK_FIX) from None
    if not isinstance(doc, dict):
        raise NpmRefused(f"{source} is not a JSON object", path=path, field=field,
                         fix=LOCK_FIX)
    return doc


def platform_problem(entry: dict[str, object]) -> str | None:
    """Why an entry's ``os``/``cpu``/``libc`` excludes linux x64 glibc (npm's
    ``checkPlatform``: a list of allowed values, ``!x`` excluding), or None."""
    for field, actual in PLATFORM.items():
        values = entry.get(field)
        if values is None:
            continue
        vals = [values] if isinstance(values, str) else values
        if not isinstance(vals, list) or not all(isinstance(v, str) for v in vals):
            return f"{field} is not a list of strings"
        if not vals:
            continue
        if f"!{actual}" in vals:
            return f"{field} excludes {actual}"
        allowed = [v for v in vals if not v.startswith("!")]
        if allowed and actual not in allowed and "any" not in allowed:
            return f"{field} {allowed} does not include {actual}"
    return None


def tarball_url(name: str, version: str, registry: str) -> str:
    """pacote's registry tarball address for ``name@version``."""
    base = name.rsplit("/", 1)[-1]
    return f"{registry}{quote(name, safe='@/')}/-/{quote(base)}-{quote(version)}.tgz"


def registry_problem(url: str, registry: str) -> str | None:
    """Why ``url`` is not a tarball under ``registry``, or None. Plain http is accepted
    only for a loopback registry (a local mirror); everything else must be https."""
    if _NOT_REGISTRY.match(url):
        return f"resolved {url!r} is a {url.split(':', 1)[0]}: dependency, not a registry tarball"
    if not url.isascii() or not url.isprintable() or " " in url:
        return f"resolved {url!r} holds a space, a control or a non-ASCII character"
    try:
        u, r = urlsplit(url), urlsplit(registry)
        ports = (u.port, r.port)
    except ValueError as exc:  # a port out of range, an unclosed [IPv6 literal
        return f"resolved {url!r} is not a URL ({exc})"
    if u.scheme not in ("https", "http") or not u.hostname:
        return f"resolved {url!r} is not a registry URL"
    if (u.scheme, u.hostname, ports[0]) != (r.scheme, r.hostname, ports[1]):
        return f"resolved {url!r} is not on the npm registry {registry}"
    if u.scheme == "http" and r.hostname not in ("127.0.0.1", "localhost", "::1"):
        return f"registry {registry} is plain http (only a loopback mirror may be)"
    if not u.path.startswith(r.path) or "/-/" not in u.path or not u.path.endswith(".tgz"):
        return f"resolved {url!r} is not a tarball under {registry}"
    if u.query or u.fragment or u.username or u.password or ".." in u.path.split("/"):
        return f"resolved {url!r} carries a query, fragment, credentials or '..'"
    return None


def _name_of(key: str) -> str | None:
    """The package name a ``packages`` key installs (the part after its last
    ``node_modules/``), or None when the key is not a plain node_modules path."""
    parts = key.split("/")
    if not key.startswith("node_modules/") or any(p in ("", ".", "..") for p in parts):
        return None
    i = 0
    name = ""
    while i < len(parts):
        if parts[i] != "node_modules" or i + 1 >= len(parts):
            return None
        if parts[i + 1].startswith("@"):
            if i + 2 >= len(parts):
                return None
            name, i = f"{parts[i + 1]}/{parts[i + 2]}", i + 3
        else:
            name, i = parts[i + 1], i + 2
        if not _NAME.fullmatch(name):
            return None
    return name


def _bins(entry: dict[str, object], key: str, source: str, **named: str) -> tuple[
        tuple[str, str], ...]:
    raw = entry.get("bin") or {}
    if not isinstance(raw, dict):
        raise _refuse(source, key, "bin is not an object", **named, fix=LOCK_FIX)
    out = []
    for link, target in sorted(raw.items()):
        parts = str(target).replace("\\", "/").split("/")
        if (not isinstance(target, str) or not _BIN_NAME.fullmatch(str(link))
                or target.startswith("/") or ".." in parts):
            raise _refuse(source, key, f"bin {link!r} -> {target!r} leaves the package",
                          **named, fix=LOCK_FIX)
        out.append((str(link), "/".join(p for p in parts if p not in ("", "."))))
    return tuple(out)


def _in_sync(lock_root: dict[str, object], package_json: dict[str, object], source: str,
             pkg_source: str, **named: str) -> None:
    for field in ("dependencies", "devDependencies", "optionalDependencies"):
        want, have = package_json.get(field) or {}, lock_root.get(field) or {}
        if want != have:
            raise _refuse(source, field, f"differs from {pkg_source} (the lockfile is out of "
                          "step with package.json; npm ci refuses it too)", **named,
                          fix=LOCK_FIX)


def parse_lockfile(lock: bytes, package_json: bytes, *, source: str, pkg_source: str,
                   registry: str, ignore_scripts: tuple[str, ...], path: str,
                   field: str) -> NpmPlan:
    """The packages ``lock`` (the file ``source``) installs; NpmRefused naming the entry,
    ``source``, ``path`` (the cycle file) and ``field`` otherwise."""
    named = {"path": path, "field": field}
    doc = _json(lock, MAX_LOCKFILE_BYTES, source, **named)
    pkg = _json(package_json, MAX_PACKAGE_JSON_BYTES, pkg_source, **named)
    if doc.get("lockfileVersion") not in (2, 3) or not isinstance(doc.get("packages"), dict):
        raise NpmRefused(f"{source} is lockfileVersion {doc.get('lockfileVersion')!r} without "
                         "a packages map; only v2 and v3 lockfiles are read", **named,
                         fix=LOCK_FIX + " (npm 7 or later)")
    entries = doc["packages"]
    if not isinstance(entries, dict):  # checked above; for the type checker
        raise NpmRefused(f"{source} has no packages map", **named, fix=LOCK_FIX)
    if len(entries) > MAX_PACKAGES:
        raise NpmRefused(f"{source} has {len(entries)} packages; at most {MAX_PACKAGES}",
                         **named, fix="install fewer packages")
    root = entries.get("", {})
    _in_sync(root if isinstance(root, dict) else {}, pkg, source, pkg_source, **named)
    scripts_fix = ("add the package's name to project.npm_ignore_scripts to install it "
                   "WITHOUT its script (cyclebox never runs a lifecycle script), or drop "
                   "the dependency")
    packages, skipped, with_scripts = [], [], set()
    for key, entry in sorted(entries.items()):
        if key == "":
            continue
        if not isinstance(entry, dict):
            raise _refuse(source, key, "entry is not an object", **named, fix=LOCK_FIX)
        if entry.get("inBundle"):
            continue  # inside its parent's tarball (bundleDependencies), checked with it
        name = _name_of(key)
        if entry.get("link") or name is None:
            raise _refuse(source, key, "a link/workspace or file: dependency (not a registry "
                          "package under node_modules/)", **named,
                          fix="publish it to the registry or vendor it in the agent's source "
                          "tree")
        # An npm alias (``"x": "npm:real@1.0"``, as @openai/codex names its platform
        # builds) is a registry package laid out under another name: fetched by its own
        # name, integrity-checked like any other.
        real = entry.get("name", name)
        if not isinstance(real, str) or not _NAME.fullmatch(real):
            raise _refuse(source, key, f"an alias of {real!r}, which is not a package name",
                          **named, fix=LOCK_FIX)
        version = entry.get("version")
        if not isinstance(version, str) or not version:
            raise _refuse(source, key, "has no version", **named, fix=LOCK_FIX)
        registry_fix = ("depend on registry releases only (no file:, link:, git or "
                        "tarball-URL dependencies), or set npm_config_registry to the "
                        "registry the lockfile was made from")
        if _NOT_REGISTRY.match(version) or "://" in version:
            raise _refuse(source, key, registry_problem(version, registry) or version,
                          **named, fix=registry_fix)
        if not _VERSION.fullmatch(version):
            raise _refuse(source, key, f"version {version!r} is not a registry version",
                          **named, fix=LOCK_FIX)
        resolved = entry.get("resolved")
        url = resolved if isinstance(resolved, str) else tarball_url(real, version, registry)
        if url.startswith(DEFAULT_REGISTRY) and registry != DEFAULT_REGISTRY:
            # npm's replace-registry-host (default "npmjs"): a lockfile made against the
            # public registry is fetched from the configured mirror; integrity still pins it
            url = registry + url[len(DEFAULT_REGISTRY):]
        problem = registry_problem(url, registry)
        if problem:
            raise _refuse(source, key, problem, **named, fix=registry_fix)
        off = platform_problem(entry)
        if off is not None:
            if entry.get("optional"):
                skipped.append((key, off))
                continue
            raise _refuse(source, key, f"not installable on linux x64 glibc ({off})", **named,
                          fix="depend on a package that supports linux x64")
        integrity = entry.get("integrity")
        sha512 = next((s for s in str(integrity or "").split() if s.startswith("sha512-")),
                      None)
        if sha512 is None:
            raise _refuse(source, key, f"has no sha512 integrity ({integrity!r}): its tarball "
                          "could not be checked", **named, fix=LOCK_FIX)
        try:
            if len(base64.b64decode(sha512[7:], validate=True)) != 64:
                raise ValueError
        except (binascii.Error, ValueError):
            raise _refuse(source, key, f"integrity {sha512[:40]!r} is not a sha512 digest",
                          **named, fix=LOCK_FIX) from None
        script = bool(entry.get("hasInstallScript"))
        if script:
            with_scripts.add(name)
            if name not in ignore_scripts:
                raise _refuse(source, key, f"{name}@{version} declares an install script "
                              "(hasInstallScript)", **named, fix=scripts_fix)
        packages.append(NpmPackage(key=key, name=name, version=version, url=url,
                                   integrity=sha512, bin=_bins(entry, key, source, **named),
                                   scripts_ignored=script))
    stale = sorted(set(ignore_scripts) - with_scripts)
    if stale:
        raise NpmRefused(f"project.npm_ignore_scripts names {stale}, which {source} does not "
                         "install with an install script", path=path,
                         field="project.npm_ignore_scripts",
                         fix="list only installed packages that declare hasInstallScript")
    return NpmPlan(packages=tuple(packages), skipped=tuple(skipped))


__all__ = ["DEFAULT_REGISTRY", "MAX_LOCKFILE_BYTES", "NpmPackage", "NpmPlan", "NpmRefused",
           "parse_lockfile", "platform_problem", "registry_from_env", "registry_problem",
           "tarball_url"]
