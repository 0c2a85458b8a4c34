"""Proposal validation (SPEC §5): pure rules shared by the worker, the apply container and
the host's re-check. Standard library only.

A proposal is ``{"files": [{"path", "content"}], "rationale"}``. Every refusal has a
named reason so that an operator can see exactly which rule an edit broke.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import posixpath
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

MAX_FILE_BYTES = 256 * 1024
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays/objects any cyclebox JSON reader accepts."""
# A string token cannot fail once it has started: its body is possessive and it ends at
# its closing quote or at the end of the text (an unclosed string, maybe after a lone
# backslash). A pattern that could fail there was retried from every later quote, each
# try reading to the end: quadratic time in one C call holding the GIL.
_JSON_TOKENS = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)|[\[\]{}]', re.DOTALL)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_TAG = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


class Refused(Exception):
    """A proposal broke a rule; ``reason`` is one of the names below."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Change:
    path: str
    content: str


def _no_dup_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)  # built in C; a duplicate shows as a shorter dict
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r}")
            seen.add(k)
    return out


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text} overflows to infinity")
    return value


def _check_depth(text: str, limit: int, most: int | None = None) -> None:
    """Refuse nesting deeper than ``limit``, and more than ``most`` objects and arrays,
    before the parser sees them (the scan stops at the first breach)."""
    opening = text.count("[") + text.count("{")
    if opening <= limit and (most is None or opening <= most):
        return  # nesting never exceeds the opening brackets; the scan below costs per token
    depth = count = 0
    for m in _JSON_TOKENS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            count += 1
            if depth > limit:
                raise ValueError(f"nested deeper than {limit} levels")
            if most is not None and count > most:
                raise ValueError(f"more than {most} objects and arrays")
        elif c in "]}":
            depth -= 1


def _check_surrogates(obj: object) -> None:
    """Refuse lone surrogates (from ``\\udXXX`` escapes): they cannot be written as UTF-8."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("string holds a lone surrogate (not valid Unicode)") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


_DECODERS = threading.local()


_MAY_OVERFLOW = re.compile(r"[eE]\+?[0-9]{3}|[0-9]{200}")
"""Where a number may overflow a float (past 1.8e308): a three-digit exponent, or 200
digits in a row (with an exponent of two digits at most, fewer digits stay under 1e300).
Only then is each float checked in Python (:func:`_finite`), a call per number that cost
0.6 s of CPU for 4 MiB of ``[0.5,0.5,...]``; otherwise the parser's own C conversion."""


def _decoder(checked_floats: bool = True) -> json.JSONDecoder:
    """This thread's strict decoder: built once (``json.loads`` with hooks builds a decoder
    and its C scanner on every call, which costs more than parsing a small body).
    ``checked_floats``: each float through :func:`_finite` (else it cannot overflow)."""
    name = "d" if checked_floats else "fast"
    d: json.JSONDecoder | None = getattr(_DECODERS, name, None)
    if d is None:
        d = json.JSONDecoder(object_pairs_hook=_no_dup_keys, parse_constant=_no_constants,
                             parse_float=_finite if checked_floats else float)
        setattr(_DECODERS, name, d)
    return d


def strict_json(text: str, *, max_depth: int = MAX_JSON_DEPTH,
                from_utf8: bool = False, max_containers: int | None = None) -> object:
    """json.loads refusing NaN/Infinity (also by overflow), duplicate keys, nesting deeper
    than ``max_depth``, more than ``max_containers`` objects and arrays, and lone
    surrogates; every refusal is a ValueError. ``from_utf8``: ``text`` was decoded from
    UTF-8 bytes (strictly), so it holds no raw lone surrogate."""
    if not from_utf8:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text holds a lone surrogate (not valid Unicode)") from None
    _check_depth(text, max_depth, max_containers)
    try:
        obj = _decoder(_MAY_OVERFLOW.search(text) is not None).decode(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {max_depth} levels") from None
    if _SURROGATE_ESCAPE.search(text):
        _check_surrogates(obj)
    return obj


def strip_fence(text: str) -> str:
    r"""Strip one Markdown code fence wrapping the *whole* message; leave anything else.

    The text, less outer whitespace, opens with three backticks and a tag of
    ``[A-Za-z0-9_-]``, and closes with three backticks; the body runs from the last line
    break of the whitespace after the tag to the last line break of the whitespace before
    the closing backticks. String scans, linear in the text: the regular expression this
    replaces (``^\s*```[A-Za-z0-9_-]*\s*\n(.*)\n\s*```\s*$``) backtracked cubically on
    an opening fence followed by blank lines (10 000 characters took 137 s)."""
    t = text.strip()
    if len(t) < 6 or not t.startswith("```") or not t.endswith("```"):
        return text
    i = 3
    while i < len(t) - 3 and t[i] in _TAG:
        i += 1
    inner = t[i:-3]
    body = inner.lstrip()
    if not body:  # only whitespace: the two last line breaks delimit the body
        if inner.count("\n") < 2:
            return text
        last = inner.rindex("\n")
        return inner[inner.rindex("\n", 0, last) + 1:last]
    start = inner.rfind("\n", 0, len(inner) - len(body))
    tail = len(inner.rstrip())
    end = inner.rfind("\n", tail)
    if start < 0 or end < 0:
        return text
    return inner[start + 1:end]


def parse_reply(text: str) -> tuple[list[Change], str]:
    """(changes, rationale) from a model reply; Refused('malformed_proposal') otherwise."""
    try:
        obj = strict_json(strip_fence(text))
    except ValueError as exc:
        raise Refused("malformed_proposal", f"reply is not one JSON object ({exc})") from None
    if not isinstance(obj, dict) or set(obj) - {"files", "rationale"} or "files" not in obj:
        raise Refused("malformed_proposal", "expected exactly {files, rationale}")
    files, rationale = obj["files"], obj.get("rationale", "")
    if not isinstance(files, list) or not isinstance(rationale, str):
        raise Refused("malformed_proposal", "files must be a list, rationale a string")
    changes = []
    for i, f in enumerate(files):
        if (not isinstance(f, dict) or set(f) != {"path", "content"}
                or not isinstance(f["path"], str) or not isinstance(f["content"], str)):
            raise Refused("malformed_proposal", f"files[{i}] must be {{path, content}} strings")
        changes.append(Change(f["path"], f["content"]))
    return changes, rationale


def check_path(path: str, *, paths: set[str], allowlist: list[str]) -> None:
    """Path rules that need no filesystem: shape, invocation set, allowlist."""
    if "\0" in path:
        raise Refused("nul_in_path", repr(path))
    if path.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", path):
        raise Refused("absolute_path", path)
    parts = path.replace("\\", "/").split("/")
    if ".." in parts:
        raise Refused("path_traversal", path)
    if ".git" in parts or any(p.lower() == ".git" for p in parts):
        raise Refused("git_path", path)
    if (not path or path == "." or posixpath.normpath(path) != path or path.startswith("./")
            or "\\" in path):
        raise Refused("not_normalized", repr(path))
    if path not in paths:
        raise Refused("outside_invocation_set", f"{path} (allowed: {sorted(paths)})")
    if not any(fnmatch.fnmatchcase(path, g) for g in allowlist):
        raise Refused("outside_allowlist", f"{path} (allowlist: {allowlist})")


def check_changes(changes: list[Change], *, paths: set[str], allowlist: list[str],
                  max_bytes: int = MAX_FILE_BYTES) -> None:
    """Every rule that does not need the tree; raises on the first breach."""
    bad_set = [p for p in paths if not any(fnmatch.fnmatchcase(p, g) for g in allowlist)]
    if bad_set:
        raise Refused("outside_allowlist", f"invocation paths {bad_set} are outside the policy "
                      "allowlist")
    seen: set[str] = set()
    for c in changes:
        check_path(c.path, paths=paths, allowlist=allowlist)
        if c.path in seen:
            raise Refused("duplicate_path", c.path)
        seen.add(c.path)
        try:
            data = c.content.encode("utf-8")
        except UnicodeEncodeError:
            raise Refused("not_utf8", c.path) from None
        if len(data) > max_bytes:
            raise Refused("oversize_file", f"{c.path}: {len(data)} bytes > {max_bytes}")


def check_tree(changes: list[Change], root: Path, base: dict[str, str | None]) -> None:
    """Rules against the checked-out tree: no symlink on the way, source unchanged."""
    for c in changes:
        cur = root
        parts = c.path.split("/")
        for i, part in enumerate(parts):
            cur = cur / part
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                break
            except NotADirectoryError:
                raise Refused("path_through_file", f"{c.path}: a parent is a file") from None
            if stat.S_ISLNK(st.st_mode):
                raise Refused("symlink_in_path", f"{c.path} (at {cur.relative_to(root)})")
            last = i == len(parts) - 1
            if not last and not stat.S_ISDIR(st.st_mode):
                raise Refused("path_through_file", f"{c.path}: {cur.relative_to(root)} is a file")
            if last and not stat.S_ISREG(st.st_mode):
                raise Refused("not_a_regular_file", f"{c.path} exists and is not a regular file")
        expected = base.get(c.path, "missing")
        target = root / c.path
        actual = (hashlib.sha256(target.read_bytes()).hexdigest()
                  if target.is_file() else None)
        if expected == "missing":
            raise Refused("base_hash_mismatch", f"{c.path}: no base hash in the request")
        if actual != expected:
            raise Refused("base_hash_mismatch",
                          f"{c.path}: source is {actual} but the proposal was made against "
                          f"{expected}")
