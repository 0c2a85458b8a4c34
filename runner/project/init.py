"""``cyclebox init DIR``: a working project from the template under ``template/``.

Invariants: DIR must be absent or an empty directory (anything else is refused before a
byte is written); the template is copied file by file with ``__NAME__`` replaced, and
``manifest.json`` is built from the copied scenarios file and data, so the project runs
as is once committed. A failure part-way removes what this call created.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from runner.errors import ConfigError
from runner.failures import is_environment_error
from runner.loading import show
from runner.outdir import refuse_inside_run
from runner.project import manifest_tools

PLACEHOLDER = "__NAME__"
RENAMES = {"gitignore": ".gitignore"}
"""Template files stored under another name (package data skips dotfiles)."""
TEXT_SUFFIXES = (".md", ".py", ".yaml", ".json", "")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,40}")


@dataclass(frozen=True)
class Scaffold:
    """What ``init`` made."""

    root: Path
    name: str
    files: list[str]
    """Paths written, relative to ``root``, sorted."""


def template_root() -> Traversable:
    return resources.files("runner.project") / "template"


def project_name(dest: Path, name: str | None) -> str:
    """``name``, or one derived from the directory's name; ConfigError when unusable."""
    if name is not None:
        if not NAME_RE.fullmatch(name):
            raise ConfigError(f"{show(name)} is not a usable project name", field="--name",
                              fix="letters, digits, '_', '.', '-'; at most 41 characters, "
                              "starting with a letter or digit")
        return name
    derived = re.sub(r"[^A-Za-z0-9_.-]+", "-", dest.resolve().name).strip("-._")[:41]
    return derived if NAME_RE.fullmatch(derived) else "my-agent"


def check_target(dest: Path) -> None:
    """DIR must be absent or an empty directory; ConfigError with the fix otherwise."""
    if ".." in dest.parts:  # X/new/.. is absent now and the existing X once new is made
        raise ConfigError(f"{show(str(dest))} has a '..' part", field="DIR",
                          fix="give the directory's own path, without '..'")
    try:
        dest.resolve()  # a loop of links among its parents: RuntimeError, named here
        if dest.is_symlink():
            raise ConfigError(f"{show(str(dest))} is a symbolic link", field="DIR",
                              fix="give a new directory path")
        if not dest.exists():
            return
        if not dest.is_dir():
            raise ConfigError(f"{show(str(dest))} exists and is not a directory",
                              field="DIR", fix="give a new or empty directory")
        if any(dest.iterdir()):
            raise ConfigError(f"{show(str(dest))} is not empty; init never overwrites files",
                              field="DIR", fix="give a new or empty directory")
    except (OSError, RuntimeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(f"{show(str(dest))} cannot be used: {why}", field="DIR",
                          fix="give a new directory you can write") from None


def _walk(node: Traversable, prefix: str = "") -> list[tuple[str, Traversable]]:
    out: list[tuple[str, Traversable]] = []
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        if child.name == "__pycache__" or child.name.endswith(".pyc"):
            continue
        rel = f"{prefix}{child.name}"
        if child.is_dir():
            out += _walk(child, rel + "/")
        else:
            out.append((rel, child))
    return out


def scaffold(dest: Path, *, name: str | None = None) -> Scaffold:
    """Create the project in ``dest`` (absent or empty); see the module docstring."""
    check_target(dest)
    refuse_inside_run(dest, field="DIR")
    pname = project_name(dest, name)
    created_root = False
    written: list[str] = []
    try:
        if not dest.exists():
            dest.mkdir(parents=True)  # a racer's directory: FileExistsError, nothing undone
            created_root = True
        for rel, src in _walk(template_root()):
            parts = rel.split("/")
            parts[-1] = RENAMES.get(parts[-1], parts[-1])
            target = dest.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            data = src.read_bytes()
            if target.suffix in TEXT_SUFFIXES:
                data = data.replace(PLACEHOLDER.encode(), pname.encode())
            with target.open("xb") as f:  # never overwrite, even if a racer wrote first
                f.write(data)
            written.append("/".join(parts))
        built = manifest_tools.build(dest / "scenarios.yaml", dest / "data")
        manifest_tools.write_atomic(built.manifest, dest / "manifest.json", field="DIR")
        written.append("manifest.json")
    except BaseException as exc:
        _undo(dest, written, created_root)
        if isinstance(exc, OSError) and not is_environment_error(exc):
            # a read-only or forbidden place: the operator's choice of DIR, named
            where = show(str(exc.filename or dest))
            raise ConfigError(f"cannot write {where}: {exc.strerror or exc}", field="DIR",
                              fix="give a new directory in a place you can write") from None
        raise
    return Scaffold(root=dest, name=pname, files=sorted(written))


def _undo(dest: Path, written: list[str], created_root: bool) -> None:
    """Remove what this call wrote (only that), so the corrected rerun starts clean."""
    if created_root:
        shutil.rmtree(dest, ignore_errors=True)
        return
    for rel in written:
        (dest / rel).unlink(missing_ok=True)
    for d in sorted({p for rel in written for p in (dest / rel).parents
                     if dest in p.parents}, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            d.rmdir()
