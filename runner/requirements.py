"""An agent's declared requirements (``project.requirements``): checked before anything
reaches the host's ``pip download``. Only plain requirement lines pass: a name, optional
extras and version specifiers; no pip options, URLs, paths or markers."""

from __future__ import annotations

import re

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
            raise ConfigError(f"{source} line {number}: {shown!r} is not a plain requirement",
                              path=path, field=field, fix=REQUIREMENTS_FIX)
        lines.append(line)
    if not lines:
        raise ConfigError(f"{source} lists no requirement", path=path, field=field,
                          fix="list at least one package, or drop project.requirements")
    return "".join(f"{ln}\n" for ln in lines)


__all__ = ["MAX_REQUIREMENTS_BYTES", "check_requirements"]
