"""One typed loader for every YAML and JSON file an operator (or a past run) hands us.

Invariants (every loader in cyclebox goes through :func:`load_model` or its parts:
:func:`load_with_bytes` when the exact bytes are needed too, :func:`parse_model` for bytes
read another way (by directory fd, from a container's collected output),
:func:`load_lines` for JSON Lines):
- A file is read once, capped (:data:`MAX_BYTES`), and must be UTF-8; an error names the
  file and the byte offset of the first bad byte.
- YAML is parsed by :class:`StrictLoader`: anchors and aliases are refused before any
  node is built (an alias bomb costs nothing), so are merge keys, duplicate keys, custom
  tags, non-finite floats and nesting deeper than :data:`MAX_DEPTH`.
- JSON goes through ``sandbox.proposal.strict_json`` (duplicate keys, NaN/Infinity, depth,
  lone surrogates refused).
- Validation errors become one :class:`~runner.errors.ConfigError` naming the file, the
  field path (``roles.analyst.memory``, ``scenarios[3].split``) and the fix; every float
  of a loaded model must be finite.
- Nothing here writes anything; loaders are pure apart from reading the one file.
"""

from __future__ import annotations

import math
import os
import stat
import sys
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.events import AliasEvent, CollectionStartEvent, ScalarEvent
from yaml.nodes import MappingNode, Node, ScalarNode

from runner.errors import ConfigError
from sandbox.proposal import strict_json

MAX_BYTES = 16 * 1024 * 1024
"""Largest input file read (JSON, JSON Lines)."""
MAX_YAML_BYTES = 4 * 1024 * 1024
"""Largest YAML file read: the pure-Python parser is slow, and no config is this big."""
MAX_DEPTH = 64
"""Deepest nesting of YAML collections (JSON: strict_json's own limit, also 64)."""
_SHOW = 160

M = TypeVar("M", bound=BaseModel)
Format = Literal["yaml", "json"]


def show(value: object, limit: int = _SHOW) -> str:
    """A printable, bounded rendering of a hostile string (control characters escaped)."""
    text = value if isinstance(value, str) else repr(value)
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return out + ("…" if len(text) > limit else "")


# -- reading ---------------------------------------------------------------------------------
def read_capped(path: Path, *, max_bytes: int = MAX_BYTES, what: str = "file",
                fix: str | None = None, ref: tuple[str, str] | None = None) -> bytes:
    """The bytes of a regular file, at most ``max_bytes``; ConfigError naming it otherwise.

    ``ref`` is (file, field) of the input that named this file, so the error points at the
    place to correct rather than only at a missing path.
    """
    rpath, rfield = ref if ref else (None, None)

    def fail(msg: str) -> ConfigError:
        if ref:
            return ConfigError(f"{what} {show(str(path))} {msg}", path=rpath, field=rfield,
                               fix=fix)
        return ConfigError(msg, path=show(str(path)), field=None, fix=fix)

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise fail("does not exist") from None
    except NotADirectoryError:
        raise fail("does not exist (a parent is not a directory)") from None
    except OSError as exc:
        raise fail(f"cannot be read: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise fail("is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise fail("is not a regular file")
        if st.st_size > max_bytes:
            raise fail(f"is {st.st_size} bytes; the limit is {max_bytes}")
        chunks, got = [], 0
        while chunk := os.read(fd, min(1 << 20, max_bytes + 1 - got)):
            got += len(chunk)
            if got > max_bytes:
                raise fail(f"grew past the limit of {max_bytes} bytes while reading")
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise fail(f"cannot be read: {exc.strerror}") from None
    finally:
        os.close(fd)


def decode_utf8(data: bytes, *, path: str, fix: str | None = None) -> str:
    """UTF-8 text (a leading BOM dropped); ConfigError naming the first bad byte's offset.
    ``fix``: the caller's (a file cyclebox wrote is rebuilt, not re-saved); the generic
    advice then goes into the message."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        generic = "save the file as UTF-8"
        raise ConfigError(f"not UTF-8: byte {exc.start} (0x{data[exc.start]:02x}) "
                          "cannot be decoded" + (f" ({generic})" if fix else ""), path=path,
                          fix=fix or generic) from None
    return text.removeprefix("\ufeff")


# -- YAML ------------------------------------------------------------------------------------
class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors, aliases, merge keys, duplicate keys, non-finite
    floats and deep nesting. Aliases are refused at the event level, so no expansion is
    ever attempted (the billion-laughs file stops at its first ``&``)."""

    _depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        mark: Any = event.start_mark
        if isinstance(event, AliasEvent):
            raise ComposerError(None, None, "YAML aliases (*name) are not accepted", mark)
        if isinstance(event, ScalarEvent | CollectionStartEvent) and event.anchor is not None:
            raise ComposerError(None, None, "YAML anchors (&name) are not accepted", mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise ConstructorError(None, None, "YAML merge keys (<<) are not accepted",
                                       key_node.start_mark)
            key = self.construct_object(key_node, deep=True)
            try:
                dup = key in seen
            except TypeError:
                raise ConstructorError(None, None, "a mapping key must be a plain value",
                                       key_node.start_mark) from None
            if dup:
                raise ConstructorError(None, None, f"duplicate key {show(key)!s}",
                                       key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_float(self, node: ScalarNode) -> float:
        value = super().construct_yaml_float(node)
        if not math.isfinite(value):
            raise _NonFinite(node)
        return value


class _NonFinite(ConstructorError):
    """A non-finite float; carries its node so that the error can name the field."""

    def __init__(self, node: ScalarNode) -> None:
        super().__init__(None, None, f"non-finite number {show(node.value)} is not accepted",
                         node.start_mark)
        self.node = node


def _node_loc(root: Node, target: Node) -> tuple[int | str, ...] | None:
    """The key path from ``root`` to ``target`` in a composed YAML tree (None: not found)."""
    stack: list[tuple[Node, tuple[int | str, ...]]] = [(root, ())]
    while stack:
        node, loc = stack.pop()
        if node is target:
            return loc
        if isinstance(node, MappingNode):
            for key, value in node.value:
                name = key.value if isinstance(key, ScalarNode) else "?"
                stack.append((value, (*loc, str(name))))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, (*loc, i)) for i, v in enumerate(node.value))
    return None


StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)


def parse_yaml(text: str, *, path: str) -> Any:
    """One YAML document under :class:`StrictLoader`; ConfigError with line and column."""
    loader: StrictLoader | None = None
    root: Node | None = None
    try:
        loader = StrictLoader(text)  # the reader checks characters here already
        root = loader.get_single_node()
        return None if root is None else loader.construct_document(root)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        refused = isinstance(exc, ComposerError | ConstructorError)
        loc = (_node_loc(root, exc.node) if isinstance(exc, _NonFinite) and root is not None
               else None)
        raise ConfigError(f"not accepted as YAML: {where}{show(exc.problem or exc)}",
                          path=path, field=field_path(loc) if loc else None,
                          fix="plain YAML: no anchors, aliases, merge keys, "
                          "duplicate keys, custom tags or non-finite numbers" if refused
                          else "correct the YAML syntax at that line") from None
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        # ValueError: e.g. an integer longer than Python converts (sys.int_info)
        raise ConfigError(f"not accepted as YAML: {show(str(exc) or type(exc).__name__)}",
                          path=path) from None
    finally:
        if loader is not None:
            loader.dispose()


def parse_json(text: str, *, path: str, fix: str | None = None) -> Any:
    """Strict JSON (see module docstring); ConfigError naming the file. ``fix``: the
    caller's, as for :func:`decode_utf8`."""
    try:
        return strict_json(text)
    except (ValueError, RecursionError) as exc:
        why = str(exc)
        if "int_max_str_digits" in why or "Exceeds the limit" in why:
            why = f"a number longer than {sys.get_int_max_str_digits()} digits"
        generic = "plain JSON: no NaN/Infinity, duplicate keys or nesting deeper than 64"
        raise ConfigError(f"invalid JSON: {show(why, 300)}" + (f" ({generic})" if fix else ""),
                          path=path, fix=fix or generic) from None


def format_of(path: Path) -> Format:
    return "json" if path.suffix.lower() in (".json", ".jsonl") else "yaml"


def load_data(path: Path, *, fmt: Format | None = None, what: str = "file",
              fix: str | None = None, ref: tuple[str, str] | None = None) -> Any:
    """Read, decode and parse one file (format from its suffix unless given)."""
    fmt = fmt or format_of(path)
    cap = MAX_YAML_BYTES if fmt == "yaml" else MAX_BYTES
    data = read_capped(path, max_bytes=cap, what=what, fix=fix, ref=ref)
    text = decode_utf8(data, path=show(str(path)), fix=fix)
    if fmt == "yaml":
        return parse_yaml(text, path=show(str(path)))
    return parse_json(text, path=show(str(path)), fix=fix)


# -- validation ------------------------------------------------------------------------------
def field_path(loc: tuple[int | str, ...] | list[int | str]) -> str:
    """``('roles', 'analyst', 'memory')`` -> ``roles.analyst.memory``; ints as ``[i]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            s = show(part, 60)
            out += ("." if out else "") + s
    return out or "(top level)"


def _input_loc(loc: tuple[int | str, ...], data: Any) -> tuple[int | str, ...]:
    """``loc`` without the tags pydantic inserts for a discriminated union member (the
    value of the discriminator, e.g. ``upstreams.target.scripted.script``): a part that is
    not a key of the input mapping but one of its values is such a tag."""
    out: list[int | str] = []
    cur: Any = data
    for part in loc:
        if isinstance(cur, dict) and part not in cur and isinstance(part, str) \
                and any(v == part for v in cur.values() if isinstance(v, str)):
            continue
        out.append(part)
        if isinstance(cur, dict):
            cur = cur.get(part)
        elif isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur):
            cur = cur[part]
        else:
            cur = None
    return tuple(out)


def _non_finite(value: Any, loc: tuple[int | str, ...]) -> tuple[int | str, ...] | None:
    if isinstance(value, float) and not math.isfinite(value):
        return loc
    if isinstance(value, dict):
        for k, v in value.items():
            if (hit := _non_finite(v, (*loc, str(k)))) is not None:
                return hit
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            if (hit := _non_finite(v, (*loc, i))) is not None:
                return hit
    return None


def validate(model: type[M], data: Any, *, path: str, fix: str, prefix: str = "") -> M:
    """``model`` from parsed data; ConfigError naming file, field path and fix otherwise."""
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise ConfigError(f"expected a mapping at the top level, got {kind}", path=path,
                          field=prefix or None, fix=fix)
    try:
        obj = model.model_validate(data)
    except ValidationError as exc:
        errs = exc.errors(include_url=False)
        e = errs[0]
        more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
        loc = field_path(_input_loc(e["loc"], data))
        if e["type"] in ("union_tag_invalid", "union_tag_not_found"):
            # a discriminated union: the field to correct is the tag itself
            tag = str(e.get("ctx", {}).get("discriminator", "")).strip("'")
            loc = f"{loc}.{tag}" if loc != "(top level)" else tag
        field = f"{prefix}.{loc}" if prefix else loc
        msg = show(e["msg"].removeprefix("Value error, "), 300)
        raise ConfigError(msg + more, path=path, field=field, fix=fix) from None
    except (ValueError, TypeError, OverflowError) as exc:
        # a validator's own bug or an exotic input: still the operator's file, named
        raise ConfigError(show(str(exc), 300), path=path, field=prefix or None,
                          fix=fix) from None
    hit = _non_finite(obj.model_dump(mode="python", by_alias=True), ())
    if hit is not None:
        loc = field_path(hit)
        raise ConfigError("must be a finite number", path=path,
                          field=f"{prefix}.{loc}" if prefix else loc, fix=fix)
    return obj


def load_model(path: Path, model: type[M], *, fix: str, fmt: Format | None = None,
               what: str = "file", ref: tuple[str, str] | None = None,
               schema: int | None = None) -> M:
    """Read ``path`` and validate it as ``model``; every failure is one ConfigError.

    ``schema`` checks a top-level ``schema:`` version first, so that a file of another
    version gets that message rather than a list of unknown keys.
    """
    return load_with_bytes(path, model, fix=fix, fmt=fmt, what=what, ref=ref,
                           schema=schema)[0]


def load_with_bytes(path: Path, model: type[M], *, fix: str, fmt: Format | None = None,
                    what: str = "file", ref: tuple[str, str] | None = None,
                    schema: int | None = None) -> tuple[M, bytes]:
    """:func:`load_model`, also returning the exact bytes validated (for a caller that
    hashes them or hands them on: the bytes checked are the bytes used)."""
    fmt = fmt or format_of(path)
    cap = MAX_YAML_BYTES if fmt == "yaml" else MAX_BYTES
    raw = read_capped(path, max_bytes=cap, what=what, fix=fix, ref=ref)
    return parse_model(raw, model, path=show(str(path)), fix=fix, fmt=fmt,
                       schema=schema), raw


def parse_model(raw: bytes, model: type[M], *, path: str, fix: str, fmt: Format = "json",
                schema: int | None = None) -> M:
    """``model`` from bytes already read (e.g. opened without following links); the same
    rules and errors as :func:`load_model`, naming ``path``."""
    text = decode_utf8(raw, path=path, fix=fix)
    data = (parse_yaml(text, path=path) if fmt == "yaml"
            else parse_json(text, path=path, fix=fix))
    if schema is not None:
        check_schema(data, schema, path=path)
    return validate(model, data, path=path, fix=fix)


def load_lines(path: Path, model: type[M], *, fix: str, what: str = "file",
               max_bytes: int = MAX_BYTES) -> list[M]:
    """JSON Lines: one ``model`` per non-blank line; a bad line is a ConfigError naming
    ``file:line`` and the field."""
    text = decode_utf8(read_capped(path, max_bytes=max_bytes, what=what, fix=fix),
                       path=show(str(path)), fix=fix)
    out: list[M] = []
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{show(str(path))}:{n}"
        out.append(validate(model, parse_json(line, path=where, fix=fix), path=where,
                            fix=fix))
    return out


def check_schema(data: Any, version: int, *, path: str) -> None:
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise ConfigError(f"expected a mapping at the top level, got {kind}", path=path,
                          fix=f"start the file with schema: {version}")
    got = data.get("schema")
    if type(got) is not int or got != version:
        raise ConfigError(f"schema must be {version} (a number), got "
                          f"{show(repr(got) if isinstance(got, str) else got)}", path=path,
                          field="schema", fix=f"set schema: {version}")


# -- references ------------------------------------------------------------------------------
def relative_inside(value: str, *, path: str, field: str, fix: str) -> str:
    """A relative POSIX path without ``..``, NUL or backslashes; returned normalised."""
    if not value or "\0" in value:
        raise ConfigError(f"{show(value)!s} is not a usable path", path=path, field=field,
                          fix=fix)
    p = Path(value)
    if p.is_absolute() or value.startswith("~"):
        raise ConfigError(f"{show(value)} is absolute; it must be relative", path=path,
                          field=field, fix=fix)
    if ".." in p.parts:
        raise ConfigError(f"{show(value)} escapes its directory (..)", path=path, field=field,
                          fix=fix)
    return p.as_posix()


def is_inside(child: Path, parent: Path) -> bool:
    """``child`` resolves to ``parent`` or below it (symlinks followed on both); False when
    either cannot be resolved."""
    try:
        c, p = child.resolve(), parent.resolve()
    except (OSError, ValueError, RuntimeError):
        return False
    return c == p or p in c.parents


def existing_dir(p: Path, *, path: str, field: str, fix: str) -> Path:
    return checked_path(p, kind="dir", path=path, field=field, fix=fix)


def checked_path(p: Path, *, kind: Literal["file", "dir"], path: str, field: str,
                 fix: str) -> Path:
    """``p`` when it is an existing file (or directory); ConfigError naming the field that
    named it otherwise, also for names the OS refuses (too long, NUL, unknown ~user)."""
    try:
        exists, is_kind = p.exists(), (p.is_file() if kind == "file" else p.is_dir())
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{show(str(p))} is not a usable path ({show(str(exc), 80)})",
                          path=path, field=field, fix=fix) from None
    if not exists:
        raise ConfigError(f"{show(str(p))} does not exist", path=path, field=field, fix=fix)
    if not is_kind:
        what = "a regular file" if kind == "file" else "a directory"
        raise ConfigError(f"{show(str(p))} is not {what}", path=path, field=field, fix=fix)
    return p


def resolve_under(base: Path, value: str, *, path: str, field: str, fix: str) -> Path:
    """``value`` (``~`` expanded) as an absolute path, relative ones against ``base``."""
    try:
        p = Path(value).expanduser()
        return p if p.is_absolute() else (base / p).resolve()
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{show(value)} is not a usable path ({show(str(exc), 80)})",
                          path=path, field=field, fix=fix) from None
