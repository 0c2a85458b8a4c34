"""An agent's declared requirements (``project.requirements``): checked before anything
reaches the host's ``pip download``. Only plain requirement lines pass: a name, optional
extras and version specifiers; no pip options, URLs, paths or markers."""

from __future__ import annotations

import re
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from runner.errors import ConfigError

MAX_REQUIREMENTS_BYTES = 64 * 1024
"""Largest requirements file accepted."""
REQUIREMENTS_FIX = ("one requirement per line: a name, optional [extras] and version "
                    "specifiers (e.g. humanize==4.12.3); no pip options, URLs, file "
                    "references or environment markers")

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_SPEC = r"(?:===|==|!=|~=|<=|>=|<|>)\s*[A-Za-z0-9.*+!_-]+"
_LINE = re.compile(rf"{_NAME}\s*(?:\[\s*{_NAME}(?:\s*,\s*{_NAME})*\s*\])?\s*"
                   rf"(?:{_SPEC}(?:\s*,\s*{_SPEC})*)?")
_ARCHIVE = re.compile(r"\.(?:whl|zip|tar|tgz|tbz|txz|tlz|tar\.gz|tar\.bz2|tar\.xz|tar\.lz|"
                      r"tar\.lzma)\s*(?:\[[^]]*\]\s*)?$", re.IGNORECASE)
"""A name pip reads as a local archive file (relative to its working directory): an
sdist there would be built, its code run, on the host even under --only-binary."""


_URLISH = re.compile(r"@|://|^\s*[./~]|^\s*(?:git|hg|svn|bzr)\+", re.IGNORECASE)
"""A requirement that names a URL, VCS checkout or path rather than an index package."""
_SPECS = re.compile(r"(===|==|!=|~=|<=|>=|<|>)\s*([A-Za-z0-9.*+!_-]+)")
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
MAX_METADATA_BYTES = 4 * 1024 * 1024
"""Largest METADATA read from a downloaded wheel."""


class RequirementsRefused(ConfigError):
    """pip (or the metadata check) refused the requirements: bad input, exit 3. Raised
    without the requirements file's name, which :meth:`named` adds."""

    def __init__(self, reason: str, *, field: str | None, fix: str,
                 source: str | None = None, path: str | None = None) -> None:
        super().__init__(f"{source}: {reason}" if source else reason, path=path,
                         field=field, fix=fix)
        self.reason = reason

    def named(self, source: str, path: str) -> RequirementsRefused:
        """The same refusal naming the requirements file ``source`` and the file ``path``
        that named it."""
        return RequirementsRefused(self.reason, field=self.field, fix=self.fix or "",
                                   source=source, path=path)


def pip_reason(stderr: str, limit: int) -> str:
    """pip's own reason from its stderr, as one escaped, bounded line: terminal escape
    sequences removed, pip's generic advice dropped, lines joined with ' / '."""
    from runner.failures import one_line

    lines = []
    for raw in _ANSI.sub("", stderr).splitlines():
        line = raw.strip()
        if line.startswith("To fix this you could try"):
            break
        if line and not line.startswith(_PROGRESS) and not line.startswith(
                ("CYCLEBOX-REFUSED ", "[notice]", "ERROR: ResolutionImpossible: for help")):
            lines.append(line)
    # pip's reason starts at its first ERROR line: what came before is progress, and a
    # bounded reason must not spend its characters on it
    first = next((i for i, ln in enumerate(lines) if ln.startswith("ERROR")), 0)
    return one_line(" / ".join(lines[first:]) or "(pip printed no reason)", limit)


_PROGRESS = ("Processing ", "Requirement already satisfied", "Collecting ", "Downloading ",
             "Using cached ", "Installing collected packages", "Removing intermediate container",
             "---> ", "Saved ", "File was already downloaded", "Obtaining ")
"""pip's (and the engine's) progress lines: never the reason."""


def unpinned(requirements: str) -> list[str]:
    """The checked requirement lines that do not pin one version (``==`` or ``===``
    without a wildcard): each may resolve to another release tomorrow."""
    out = []
    for ln in requirements.splitlines():
        specs = _SPECS.findall(ln)
        if ln.strip() and not any(op in ("==", "===") and "*" not in v for op, v in specs):
            out.append(ln)
    return out


def requires_dist_urls(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` entries of a wheel's METADATA that name a URL or path (e.g.
    ``evil @ file:///etc/passwd``); a wheel whose metadata cannot be read is one such
    entry (it is refused, not trusted)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            metas = [i for i in z.infolist() if i.filename.count("/") == 1
                     and i.filename.endswith(".dist-info/METADATA")]
            if len(metas) != 1 or metas[0].file_size > MAX_METADATA_BYTES:
                return [f"<{len(metas)} METADATA files or one too large>"]
            with z.open(metas[0]) as f:
                text = f.read(MAX_METADATA_BYTES + 1).decode("utf-8", "replace")
    except (OSError, zipfile.BadZipFile, ValueError, NotImplementedError, EOFError) as exc:
        return [f"<unreadable wheel: {type(exc).__name__}>"]
    headers = HeaderParser().parsestr(text, headersonly=True)
    return [str(v) for v in headers.get_all("Requires-Dist") or []
            if _URLISH.search(str(v).split(";", 1)[0])]


def check_requirements(data: bytes, *, source: str, path: str, field: str) -> str:
    """The requirement lines of ``data`` (the file ``source``), checked and normalised
    (comments and blank lines dropped, one per line); ConfigError naming ``path`` (the
    file that named it), ``field`` and the line otherwise."""
    if len(data) > MAX_REQUIREMENTS_BYTES:
        raise ConfigError(f"{source} has {len(data)} bytes; at most "
                          f"{MAX_REQUIREMENTS_BYTES}", path=path, field=field,
                          fix=REQUIREMENTS_FIX)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source} is not UTF-8 (byte {exc.start})", path=path,
                          field=field, fix=REQUIREMENTS_FIX) from None
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        name = re.split(r"===|==|!=|~=|<=|>=|<|>", line, maxsplit=1)[0]
        if not _LINE.fullmatch(line) or _ARCHIVE.search(name):
            shown = "".join(c if c.isprintable() else "?" for c in line[:80])
            kind = (" (a URL, VCS or path requirement: refused, nothing is fetched from it)"
                    if _URLISH.search(line) and not line.startswith("-") else "")
            raise ConfigError(f"{source} line {number}: {shown!r} is not a plain "
                              f"requirement{kind}",
                              path=path, field=field, fix=REQUIREMENTS_FIX)
        lines.append(line)
    if not lines:
        raise ConfigError(f"{source} lists no requirement", path=path, field=field,
                          fix="list at least one package, or drop project.requirements")
    return "".join(f"{ln}\n" for ln in lines)


__all__ = ["MAX_REQUIREMENTS_BYTES", "RequirementsRefused", "check_requirements", "pip_reason",
           "requires_dist_urls", "unpinned"]
