"""An operator's bad day: every bad input through the real CLI (``runner.cli.main``).

Each case builds one bad input from a copy of the bundled example, runs the command,
and asserts: the exit code (3 bad input, 5 missing prerequisite), a first stderr line
that names the file or field, no traceback, and that nothing was written (``--out``
absent, a prepared plan not started, an existing directory untouched).

The cases run in-process through ``main()`` (the console-script entry point) for speed;
:func:`test_same_answers_from_the_installed_command` runs a sample through the
installed ``cyclebox`` executable to show the two agree. ``bad_inputs_table.py`` prints
the table as Markdown from the same cases.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.paths import PROJECT_ROOT
from tests.fixtures.deep import LONG_DEPTH, LONG_FILE, LONG_PART, make_long

EXAMPLE = PROJECT_ROOT / "examples" / "shop-analyst"
ROLES = PROJECT_ROOT / "policies" / "roles.yaml"
CLI = str(Path(sys.executable).with_name("cyclebox"))
FAKE_IMAGES = {r: f"sha256:{'0' * 63}{i}" for i, r in
               enumerate(("analyst", "worker", "evaluator", "apply", "trainer"))}
BOMB = ('a: &a ["x","x","x","x","x","x","x","x","x"]\n'
        + "".join(f'{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n'
                  for p, c in zip("abcdefgh", "bcdefghi", strict=True)))


# -- the sandbox every case starts from --------------------------------------------------------
@dataclass
class Env:
    """A private copy of the example (absolute paths), an output path that must stay absent,
    and the environment the command runs with."""

    root: Path
    out: Path
    vars: dict[str, str] = field(default_factory=dict)
    untouched: list[Path] = field(default_factory=list)
    """Paths whose bytes must not change (e.g. an existing --out)."""
    cleanups: list[Callable[[], object]] = field(default_factory=list)
    """Run after the command, last first (e.g. unmounting a read-only bind)."""

    @property
    def ex(self) -> Path:
        return self.root / "ex"

    @property
    def cycle(self) -> Path:
        return self.ex / "cycle.yaml"

    def cycle_doc(self) -> dict[str, Any]:
        return dict(yaml.safe_load(self.cycle.read_text()))

    def set_cycle(self, **changes: Any) -> Path:
        doc = self.cycle_doc()
        doc.update(changes)
        self.cycle.write_text(yaml.safe_dump(doc, sort_keys=False))
        return self.cycle

    def edit_cycle(self, fn: Callable[[dict[str, Any]], None]) -> Path:
        doc = self.cycle_doc()
        fn(doc)
        self.cycle.write_text(yaml.safe_dump(doc, sort_keys=False))
        return self.cycle

    def write(self, rel: str, data: bytes | str) -> Path:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        return p

    def manifest(self) -> dict[str, Any]:
        return dict(json.loads((self.ex / "manifest.json").read_text()))

    def set_manifest(self, doc: dict[str, Any]) -> None:
        (self.ex / "manifest.json").write_text(json.dumps(doc, indent=1))

    def roles_yaml(self, edit: Callable[[dict[str, Any]], None]) -> None:
        doc = yaml.safe_load(ROLES.read_text())
        edit(doc)
        self.write("roles.yaml", yaml.safe_dump(doc))
        self.set_cycle(roles=str(self.root / "roles.yaml"))

    def run_args(self) -> list[str]:
        return ["cycle", "run", str(self.cycle), "--out", str(self.out)]

    def read_only(self, path: Path) -> Path:
        """Make the directory ``path`` read-only (a read-only bind mount onto itself; root
        ignores permission bits, not a read-only mount); undone after the command."""
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
        self.cleanups.append(lambda: subprocess.run(["umount", "-l", str(path)], check=False))
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        return path

    def prepare(self) -> Path:
        """A prepared plan (freeze succeeded) in ``root/prepared``; returns plan.json."""
        code, _, err = run_cli(["cycle", "run", str(self.cycle), "--out",
                                str(self.root / "prepared"), "--prepare-only"], self.vars)
        assert code == 0, err
        return self.root / "prepared" / "plan.json"


def make_env(root: Path) -> Env:
    shutil.copytree(EXAMPLE, root / "ex", ignore=shutil.ignore_patterns("project"))
    env = Env(root=root, out=root / "out")
    doc = env.cycle_doc()
    doc["project"]["repo"] = str(PROJECT_ROOT)
    doc["roles"] = str(ROLES)
    doc["upstreams"]["judge"]["script"] = str(PROJECT_ROOT / "policies/scripts/default.yaml")
    env.cycle.write_text(yaml.safe_dump(doc, sort_keys=False))
    state = root / "state"
    state.mkdir()
    (state / "images.lock.json").write_text(json.dumps({r: {
        "role": r, "tag": f"cyclebox/{r}:fake", "id": i, "input_hash": "0" * 64,
        "size_bytes": 1, "built": False, "seconds": 0.0} for r, i in FAKE_IMAGES.items()}))
    env.vars["CYCLEBOX_STATE_DIR"] = str(state)
    return env


@contextlib.contextmanager
def _patched_env(extra: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(extra)
    for k in [k for k, v in extra.items() if v == ""]:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_cli(args: list[str], env: dict[str, str]) -> tuple[int | str, str, str]:
    """(exit code, stdout, stderr) of ``cyclebox ARGS`` through ``runner.cli.main``.

    An exception escaping main() is returned as the code ``'traceback: <type>'`` (and its
    traceback appended to stderr), so a case can never pass by crashing."""
    import traceback

    from runner.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: int | str
    saved_argv = sys.argv
    sys.argv = ["cyclebox", *args]
    try:
        with _patched_env(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException as exc:  # the point is to catch any crash
                code = f"traceback: {type(exc).__name__}"
                err.write("Traceback (most recent call last):\n" + traceback.format_exc())
    finally:
        sys.argv = saved_argv
    return code, out.getvalue(), err.getvalue()


# -- the cases -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Env], list[str]]
    """Makes the bad input in the env; returns the CLI arguments."""
    code: int
    expect: tuple[str, ...]
    """Substrings the first line of stderr must hold (file and/or field)."""


CASES: list[Case] = []


def case(id_: str, code: int, *expect: str) -> Callable[[Callable[[Env], list[str]]],
                                                         Callable[[Env], list[str]]]:
    def deco(fn: Callable[[Env], list[str]]) -> Callable[[Env], list[str]]:
        CASES.append(Case(id_, fn, code, expect))
        return fn
    return deco


def _cycle_text(e: Env, text: str | bytes) -> list[str]:
    e.cycle.write_bytes(text.encode() if isinstance(text, str) else text)
    return e.run_args()


def _nested_yaml(depth: int) -> str:
    return "schema: 1\nname: " + "[" * depth + "]" * depth + "\n"


# cycle file: reading and syntax
@case("cycle-missing", 3, "nope.yaml", "does not exist")
def _(e: Env) -> list[str]:
    return ["cycle", "run", str(e.root / "nope.yaml"), "--out", str(e.out)]


@case("cycle-is-directory", 3, "is a directory")
def _(e: Env) -> list[str]:
    return ["cycle", "run", str(e.ex), "--out", str(e.out)]


@case("cycle-not-utf8", 3, "cycle.yaml", "not UTF-8: byte 9")
def _(e: Env) -> list[str]:
    return _cycle_text(e, b"schema: 1\xff\nname: x\n")


@case("cycle-empty", 3, "cycle.yaml", "empty")
def _(e: Env) -> list[str]:
    return _cycle_text(e, "")


@case("cycle-is-a-list", 3, "cycle.yaml", "expected a mapping")
def _(e: Env) -> list[str]:
    return _cycle_text(e, "- schema: 1\n")


@case("cycle-yaml-syntax", 3, "cycle.yaml", "line 3, column 1")
def _(e: Env) -> list[str]:
    return _cycle_text(e, "schema: 1\nname: [unclosed\n")


@case("cycle-alias-bomb", 3, "cycle.yaml", "anchors")
def _(e: Env) -> list[str]:
    # a billion laughs reaching edit.allowlist, a field the schema checks
    text = e.cycle.read_text().replace("  allowlist:\n", "  allowlist: *i\n  old:\n")
    assert "*i" in text
    return _cycle_text(e, BOMB + text)


@case("cycle-alias-in-field", 3, "cycle.yaml", "anchors")
def _(e: Env) -> list[str]:
    text = e.cycle.read_text().replace("name: shop-analyst", "name: &n shop-analyst")
    return _cycle_text(e, text)


@case("cycle-duplicate-key", 3, "cycle.yaml", "duplicate key")
def _(e: Env) -> list[str]:
    return _cycle_text(e, e.cycle.read_text() + "name: other\n")


@case("cycle-merge-key", 3, "cycle.yaml", "merge")
def _(e: Env) -> list[str]:
    return _cycle_text(e, e.cycle.read_text() + "dream:\n  <<: {mode: template}\n")


@case("cycle-python-tag", 3, "cycle.yaml", "not accepted as YAML")
def _(e: Env) -> list[str]:
    return _cycle_text(e, "schema: 1\nname: !!python/object/apply:os.system [true]\n")


@case("cycle-deep-nesting", 3, "cycle.yaml", "deeper than 64")
def _(e: Env) -> list[str]:
    return _cycle_text(e, _nested_yaml(200))


@case("cycle-huge-integer", 3, "cycle.yaml", "not accepted as YAML")
def _(e: Env) -> list[str]:
    return _cycle_text(e, e.cycle.read_text().replace("trials: 1", "trials: " + "9" * 5000))


@case("cycle-oversize", 3, "cycle.yaml", "limit is")
def _(e: Env) -> list[str]:
    return _cycle_text(e, "schema: 1\n" + "#" * (5 * 1024 * 1024))


# cycle file: fields
@case("cycle-schema-missing", 3, "cycle.yaml", "schema")
def _(e: Env) -> list[str]:
    return _cycle_text(e, e.cycle.read_text().replace("schema: 1\n", ""))


@case("cycle-schema-2", 3, "cycle.yaml", "schema must be 1")
def _(e: Env) -> list[str]:
    e.set_cycle(schema=2)
    return e.run_args()


@case("cycle-unknown-key", 3, "cycle.yaml", "retries")
def _(e: Env) -> list[str]:
    e.set_cycle(retries=3)
    return e.run_args()


@case("cycle-bad-name", 3, "cycle.yaml", "name")
def _(e: Env) -> list[str]:
    e.set_cycle(name="../../etc")
    return e.run_args()


@case("cycle-trials-zero", 3, "cycle.yaml", "trials")
def _(e: Env) -> list[str]:
    e.set_cycle(trials=0)
    return e.run_args()


@case("cycle-concurrency-word", 3, "cycle.yaml", "concurrency", "1 to 64 or auto")
def _(e: Env) -> list[str]:
    e.set_cycle(concurrency="fast")
    return e.run_args()


@case("cycle-concurrency-zero", 3, "cycle.yaml", "concurrency", "1 to 64 or auto")
def _(e: Env) -> list[str]:
    e.set_cycle(concurrency=0)
    return e.run_args()


@case("cycle-seeds-mismatch", 3, "cycle.yaml", "seeds")
def _(e: Env) -> list[str]:
    e.set_cycle(seeds=[1, 2])
    return e.run_args()


@case("cycle-budget-inf", 3, "cycle.yaml", "budget.limit_usd", "non-finite")
def _(e: Env) -> list[str]:
    return _cycle_text(e, e.cycle.read_text().replace("limit_usd: 1.0", "limit_usd: .inf"))


@case("cycle-judge-nan", 3, "cycle.yaml", "judge.threshold", "non-finite")
def _(e: Env) -> list[str]:
    return _cycle_text(e, e.cycle.read_text() + "judge: {model: fixture-judge, threshold: .nan}\n")


@case("cycle-quoted-inf", 3, "cycle.yaml", "budget.limit_usd")
def _(e: Env) -> list[str]:
    return _cycle_text(e, e.cycle.read_text().replace("limit_usd: 1.0", 'limit_usd: "inf"'))


@case("cycle-upstream-timeout-inf", 3, "cycle.yaml", "upstreams.target.timeout_s",
      "non-finite")
def _(e: Env) -> list[str]:
    return _cycle_text(e, e.cycle.read_text().replace(
        "max_tokens: 1024\n", "max_tokens: 1024\n    timeout_s: .inf\n", 1))


@case("cycle-entry-empty", 3, "cycle.yaml", "project.entry")
def _(e: Env) -> list[str]:
    e.edit_cycle(lambda d: d["project"].update(entry=[]))
    return e.run_args()


# cycle file: what it refers to
@case("repo-missing", 3, "cycle.yaml", "project.repo")
def _(e: Env) -> list[str]:
    e.edit_cycle(lambda d: d["project"].update(repo=str(e.root / "no-repo")))
    return e.run_args()


@case("repo-not-git", 3, "cycle.yaml", "project.repo", "not a git repository",
      "git init && git add -A && git commit -m init")
def _(e: Env) -> list[str]:
    (e.root / "plain").mkdir()
    e.edit_cycle(lambda d: d["project"].update(repo=str(e.root / "plain"), subdir=None))
    return e.run_args()


@case("repo-inside-another-repo", 3, "cycle.yaml", "project.repo", "not the root",
      "subdir: examples/shop-analyst/project")
def _(e: Env) -> list[str]:
    e.edit_cycle(lambda d: d["project"].update(repo=str(PROJECT_ROOT / "examples/shop-analyst"),
                                               subdir="project"))
    return e.run_args()


@case("repo-without-commit", 3, "cycle.yaml", "project.base_ref", "no commit")
def _(e: Env) -> list[str]:
    (e.root / "fresh").mkdir()
    subprocess.run(["git", "init", "-q", str(e.root / "fresh")], check=True)
    e.edit_cycle(lambda d: d["project"].update(repo=str(e.root / "fresh"), subdir=None))
    return e.run_args()


@case("ref-unknown", 3, "cycle.yaml", "project.base_ref", "no-such-branch")
def _(e: Env) -> list[str]:
    e.edit_cycle(lambda d: d["project"].update(base_ref="no-such-branch"))
    return e.run_args()


@case("ref-option-injection", 3, "cycle.yaml", "project.base_ref", "not a git ref")
def _(e: Env) -> list[str]:
    e.edit_cycle(lambda d: d["project"].update(base_ref="--output=/tmp/x"))
    return e.run_args()


@case("subdir-escapes-repo", 3, "cycle.yaml", "project.subdir", "escapes")
def _(e: Env) -> list[str]:
    e.edit_cycle(lambda d: d["project"].update(subdir="../../etc"))
    return e.run_args()


@case("subdir-absolute", 3, "cycle.yaml", "project.subdir", "absolute")
def _(e: Env) -> list[str]:
    e.edit_cycle(lambda d: d["project"].update(subdir="/etc"))
    return e.run_args()


@case("subdir-not-in-tree", 3, "cycle.yaml", "project.subdir", "not a directory")
def _(e: Env) -> list[str]:
    e.edit_cycle(lambda d: d["project"].update(subdir="examples/no-such-dir"))
    return e.run_args()


@case("scenarios-missing", 3, "cycle.yaml", "scenarios", "does not exist")
def _(e: Env) -> list[str]:
    e.set_cycle(scenarios="nope.json")
    return e.run_args()


@case("data-dir-missing", 3, "cycle.yaml", "data_dir", "does not exist")
def _(e: Env) -> list[str]:
    e.set_cycle(data_dir="no-data")
    return e.run_args()


@case("data-dir-etc", 3, "cycle.yaml", "data_dir", "/etc")
def _(e: Env) -> list[str]:
    e.set_cycle(data_dir="/etc")
    return e.run_args()


@case("data-dir-is-file", 3, "cycle.yaml", "data_dir", "not a directory")
def _(e: Env) -> list[str]:
    e.set_cycle(data_dir="manifest.json")
    return e.run_args()


@case("data-dir-path-past-path-max", 3, "cycle.yaml", "data_dir", "PATH_MAX", LONG_FILE[:40])
def _(e: Env) -> list[str]:
    (e.ex / "data" / "deep").mkdir()
    make_long(e.ex / "data" / "deep")  # "/data/deep/" + 4,090 bytes: past PATH_MAX inside
    return e.run_args()


def _git(repo: Path, *args: str, data: bytes | None = None) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], input=data, capture_output=True,
                          check=True, env={**os.environ, "GIT_AUTHOR_NAME": "t",
                                           "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                                           "GIT_COMMITTER_EMAIL": "t@t"}).stdout.decode().strip()


def _mktree(repo: Path, rows: list[str]) -> str:
    return _git(repo, "mktree", "-z", data="".join(f"{r}\0" for r in rows).encode())


@case("project-tree-path-past-path-max", 3, "cycle.yaml", "project.base_ref", "PATH_MAX",
      LONG_FILE[:40])
def _(e: Env) -> list[str]:
    # the example's agent in its own repository, plus a commit (made with git plumbing,
    # no checkout) holding "deep/" + 4,090 bytes: past PATH_MAX once mounted at /src
    repo = e.root / "agent"
    shutil.copytree(EXAMPLE / "project", repo)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "agent")
    tree = _mktree(repo, [f"100644 blob {_git(repo, 'hash-object', '-w', '--stdin', data=b'x')}"
                          f"\t{LONG_FILE}"])
    for i in reversed(range(LONG_DEPTH)):
        tree = _mktree(repo, [f"040000 tree {tree}\t{i:02d}{'d' * (LONG_PART - 2)}"])
    top = _git(repo, "ls-tree", "-z", "HEAD").split("\0")
    root = _mktree(repo, [*[r for r in top if r], f"040000 tree {tree}\tdeep"])
    commit = _git(repo, "commit-tree", root, "-p", "HEAD", "-m", "deep")
    e.edit_cycle(lambda d: d["project"].update(repo=str(repo), base_ref=commit, subdir=None))
    return e.run_args()


@case("project-tree-control-character-name", 3, "cycle.yaml", "project.base_ref",
      "control character U+001B")
def _(e: Env) -> list[str]:
    # a committed name holding an escape character: the export (runner.untar) refuses it,
    # so the plan does, naming it, before any container starts
    repo = e.root / "agent"
    shutil.copytree(EXAMPLE / "project", repo)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "agent")
    blob = _git(repo, "hash-object", "-w", "--stdin", data=b"x")
    top = _git(repo, "ls-tree", "-z", "HEAD").split("\0")
    root = _mktree(repo, [*[r for r in top if r], f"100644 blob {blob}\tnotes\x1b[2J.txt"])
    commit = _git(repo, "commit-tree", root, "-p", "HEAD", "-m", "escape")
    e.edit_cycle(lambda d: d["project"].update(repo=str(repo), base_ref=commit, subdir=None))
    return e.run_args()


@case("policy-missing", 3, "cycle.yaml", "policy", "does not exist")
def _(e: Env) -> list[str]:
    e.set_cycle(policy="nope.yaml")
    return e.run_args()


@case("roles-missing", 3, "cycle.yaml", "roles", "does not exist")
def _(e: Env) -> list[str]:
    e.set_cycle(roles="nope.yaml")
    return e.run_args()


@case("brief-file-unset", 3, "cycle.yaml", "brief.file")
def _(e: Env) -> list[str]:
    e.set_cycle(brief={"mode": "file"})
    return e.run_args()


@case("brief-file-missing", 3, "cycle.yaml", "brief.file", "does not exist")
def _(e: Env) -> list[str]:
    e.set_cycle(brief={"mode": "file", "file": "brief.md"})
    return e.run_args()


@case("script-missing", 3, "cycle.yaml", "upstreams.target.script", "does not exist")
def _(e: Env) -> list[str]:
    e.edit_cycle(lambda d: d["upstreams"]["target"].update(script="scripts/nope.yaml"))
    return e.run_args()


@case("script-empty", 3, "cycle.yaml", "upstreams.target.script")
def _(e: Env) -> list[str]:
    e.edit_cycle(lambda d: d["upstreams"]["target"].update(script=""))
    return e.run_args()


@case("judge-upstream-undefined", 3, "cycle.yaml", "upstreams.judge", "not defined")
def _(e: Env) -> list[str]:
    def edit(d: dict[str, Any]) -> None:
        del d["upstreams"]["judge"]
        d["judge"] = {"model": "fixture-judge", "threshold": 0.5, "required": False}
    e.edit_cycle(edit)
    return e.run_args()


@case("judge-key-unset-with-judge", 5, "CYCLEBOX_TEST_UNSET_JUDGE_KEY")
def _(e: Env) -> list[str]:
    e.vars["CYCLEBOX_TEST_UNSET_JUDGE_KEY"] = ""

    def edit(d: dict[str, Any]) -> None:
        d["upstreams"]["judge"] = {"provider": "openai", "base_url": "https://j.invalid/v1",
                                   "credential": {"env": "CYCLEBOX_TEST_UNSET_JUDGE_KEY"},
                                   "models": ["fixture-judge"]}
        d["judge"] = {"model": "fixture-judge", "threshold": 0.5, "required": False}
    e.edit_cycle(edit)
    return e.run_args()


@case("worker-model-not-allowed", 3, "cycle.yaml", "worker.model")
def _(e: Env) -> list[str]:
    e.set_cycle(worker={"model": "gpt-unlisted", "max_tokens": 4096})
    return e.run_args()


@case("edit-path-outside-allowlist", 3, "cycle.yaml", "edit.paths")
def _(e: Env) -> list[str]:
    e.set_cycle(edit={"allowlist": ["prompts/*.md"], "paths": ["agent.py"]})
    return e.run_args()


@case("credential-env-unset", 5, "CYCLEBOX_TEST_UNSET_KEY")
def _(e: Env) -> list[str]:
    e.vars["CYCLEBOX_TEST_UNSET_KEY"] = ""
    e.edit_cycle(lambda d: d["upstreams"].update(target={
        "provider": "openai", "base_url": "https://example.invalid/v1",
        "credential": {"env": "CYCLEBOX_TEST_UNSET_KEY"}, "models": ["m"]}))
    return e.run_args()


@case("credential-file-fifo", 5, "key.fifo", "not a regular file")
def _(e: Env) -> list[str]:
    """A FIFO hung freeze, /dev/zero grew until memory ran out, non-UTF-8 bytes were a
    traceback (exit 10); an anthropic upstream's unset key froze with exit 0."""
    fifo = e.root / "key.fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    e.edit_cycle(lambda d: d["upstreams"].update(target={
        "provider": "openai", "base_url": "https://example.invalid/v1",
        "credential": {"file": str(fifo)}, "models": ["m"]}))
    return e.run_args()


@case("credential-file-dev-zero", 5, "/dev/zero", "not a regular file")
def _(e: Env) -> list[str]:
    e.edit_cycle(lambda d: d["upstreams"].update(target={
        "provider": "openai", "base_url": "https://example.invalid/v1",
        "credential": {"file": "/dev/zero"}, "models": ["m"]}))
    return e.run_args()


@case("credential-file-not-utf8", 5, "key.bin", "not UTF-8")
def _(e: Env) -> list[str]:
    key = e.write("key.bin", b"\xff\xfe\n")
    e.edit_cycle(lambda d: d["upstreams"].update(target={
        "provider": "openai", "base_url": "https://example.invalid/v1",
        "credential": {"file": str(key)}, "models": ["m"]}))
    return e.run_args()


@case("credential-env-unset-anthropic", 5, "CYCLEBOX_TEST_UNSET_ANTHROPIC_KEY")
def _(e: Env) -> list[str]:
    e.vars["CYCLEBOX_TEST_UNSET_ANTHROPIC_KEY"] = ""
    e.edit_cycle(lambda d: d["upstreams"].update(target={
        "provider": "anthropic", "base_url": "https://example.invalid",
        "credential": {"env": "CYCLEBOX_TEST_UNSET_ANTHROPIC_KEY"}, "models": ["m"]}))
    return e.run_args()


@case("images-not-built", 5, "cyclebox images build")
def _(e: Env) -> list[str]:
    (e.root / "empty-state").mkdir()
    e.vars["CYCLEBOX_STATE_DIR"] = str(e.root / "empty-state")
    return e.run_args()


@case("engine-unreachable", 5, "Docker engine not reachable", "DOCKER_HOST")
def _(e: Env) -> list[str]:
    # PrerequisiteError raised `from None` inside the docker error: 5, not 6 (issue 21)
    e.vars["DOCKER_HOST"] = f"unix://{e.root}/no-engine.sock"
    return e.run_args()


# images
@case("images-build-unknown-role", 3, "--role", "unknown role 'nosuch'")
def _(e: Env) -> list[str]:
    return ["images", "build", "--role", "nosuch"]


@case("images-lock-corrupt", 3, "images.lock.json", "invalid JSON")
def _(e: Env) -> list[str]:
    (e.root / "state" / "images.lock.json").write_text('{"analyst": [')
    return ["images", "list"]


@case("images-gc-engine-unreachable", 5, "Docker engine not reachable")
def _(e: Env) -> list[str]:
    e.vars["DOCKER_HOST"] = f"unix://{e.root}/no-engine.sock"
    return ["images", "gc"]


# the Ray backend: a mistyped address is bad input (3) naming the flag or the field, before
# Ray is asked (Ray said "Invalid address format" or an int() error, exit 5); a well-formed
# address where no cluster answers is a missing prerequisite (5), named within seconds
def _ray(e: Env, *address: str) -> list[str]:
    return [*e.run_args(), "--backend", "ray", *(["--ray-address", *address] if address
                                                 else [])]


@case("ray-address-without-ray-backend", 3, "--ray-address", "only for the ray backend")
def _(e: Env) -> list[str]:
    return [*e.run_args(), "--ray-address", "10.0.0.1:6379"]


@case("ray-unknown-backend", 3, "--backend", "unknown backend 'nosuch'", "docker, ray")
def _(e: Env) -> list[str]:
    return [*e.run_args(), "--backend", "nosuch"]


@case("ray-address-port-not-a-number", 3, "--ray-address", "'head:notaport'", "65535")
def _(e: Env) -> list[str]:
    return _ray(e, "head:notaport")


@case("ray-address-port-out-of-range", 3, "--ray-address", "'10.0.0.1:99999'", "65535")
def _(e: Env) -> list[str]:
    return _ray(e, "10.0.0.1:99999")


@case("ray-address-without-port", 3, "--ray-address", "not HOST:PORT")
def _(e: Env) -> list[str]:
    return _ray(e, "headnode")


@case("ray-address-with-space", 3, "--ray-address", "space or control character")
def _(e: Env) -> list[str]:
    return _ray(e, "not an address")


@case("ray-address-empty", 3, "--ray-address", "empty Ray address")
def _(e: Env) -> list[str]:
    return _ray(e, "")


@case("ray-cycle-address-malformed", 3, "cycle.yaml", "ray.address", "a URL, not HOST:PORT")
def _(e: Env) -> list[str]:
    e.set_cycle(backend="ray", ray={"address": "http://head"})
    return e.run_args()


@case("ray-cycle-address-unknown-key", 3, "cycle.yaml", "ray.adress")
def _(e: Env) -> list[str]:
    e.set_cycle(backend="ray", ray={"adress": "10.0.0.1:6379"})
    return e.run_args()


@case("ray-cluster-unreachable", 5, "Ray cluster not reachable at 127.0.0.1:1",
      "ray start --head")
def _(e: Env) -> list[str]:
    return _ray(e, "127.0.0.1:1")


@case("ray-gc-cluster-unreachable", 5, "Ray cluster not reachable at 127.0.0.1:1")
def _(e: Env) -> list[str]:
    return ["gc", "--backend", "ray", "--ray-address", "127.0.0.1:1"]


@case("ray-doctor-address-malformed", 3, "--ray-address", "'head:'")
def _(e: Env) -> list[str]:
    return ["doctor", "--backend", "ray", "--ray-address", "head:"]


# the agent's own requirements (project.requirements): resolved offline from a local
# --find-links directory of wheels built here; every refusal is bad input (exit 3) naming
# the field, the file and pip's own reason, and leaves no wheel behind
def _wheel(where: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    import zipfile

    meta = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            + "".join(f"Requires-Dist: {r}\n" for r in requires))
    with zipfile.ZipFile(where / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
        z.writestr(f"{name}-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: t\n"
                   "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{name}-{version}.dist-info/RECORD", "")


def _requirements(e: Env, text: str, *, index: Callable[[Path], None] | None = None
                  ) -> list[str]:
    """The example's agent in a repository of its own whose committed requirements.txt
    holds ``text``; ``index`` fills the --find-links directory pip may use."""
    repo = e.root / "repo"
    shutil.copytree(EXAMPLE / "project", repo)
    (repo / "requirements.txt").write_text(text)
    git_env = {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
               "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
               "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "agent"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True, env=git_env,
                       capture_output=True)
    e.edit_cycle(lambda d: d["project"].update(repo=str(repo), subdir=None,
                                               requirements="requirements.txt"))
    wheels = e.root / "index"
    wheels.mkdir()
    if index is not None:
        index(wheels)
    e.vars["PIP_DOWNLOAD_ARGS"] = f"--no-index --find-links {wheels}"
    e.vars["PIP_FIND_LINKS"] = ""  # only the index built here
    e.vars["PIP_CONFIG_FILE"] = os.devnull
    return [*e.run_args(), "--prepare-only"]


@case("requirements-no-such-package", 3, "cycle.yaml", "project.requirements",
      "requirements.txt", "No matching distribution found for no-such-pkg-cyclebox==1.0")
def _(e: Env) -> list[str]:
    return _requirements(e, "no-such-pkg-cyclebox==1.0\n")


@case("requirements-conflict-in-file", 3, "cycle.yaml", "project.requirements",
      "requirements.txt", "conflicting dependencies", "aa 1.0 depends on bb==1.0")
def _(e: Env) -> list[str]:
    def index(d: Path) -> None:
        _wheel(d, "aa", "1.0", ("bb==1.0",))
        _wheel(d, "bb", "1.0")
        _wheel(d, "bb", "2.0")
    return _requirements(e, "aa==1.0\nbb==2.0\n", index=index)


@case("requirements-sdist-only", 3, "cycle.yaml", "project.requirements", "requirements.txt",
      "No matching distribution found for onlysrc==1.0")
def _(e: Env) -> list[str]:
    def index(d: Path) -> None:
        import tarfile

        src = e.root / "onlysrc-1.0"
        src.mkdir()
        (src / "setup.py").write_text("raise SystemExit('built on the host')\n")
        with tarfile.open(d / "onlysrc-1.0.tar.gz", "w:gz") as tar:
            tar.add(src, arcname="onlysrc-1.0")
    return _requirements(e, "onlysrc==1.0\n", index=index)


@case("requirements-url-line", 3, "cycle.yaml", "project.requirements", "requirements.txt",
      "line 1", "URL, VCS or path requirement")
def _(e: Env) -> list[str]:
    return _requirements(e, "evil @ https://example.invalid/evil-1.0-py3-none-any.whl\n")


@case("requirements-vcs-line", 3, "cycle.yaml", "project.requirements", "requirements.txt",
      "line 2", "URL, VCS or path requirement")
def _(e: Env) -> list[str]:
    return _requirements(e, "aa==1.0\ngit+https://example.invalid/evil.git\n")


@case("requirements-wheel-direct-url", 3, "cycle.yaml", "project.requirements",
      "requirements.txt", "lure-1.0-py3-none-any.whl requires 'evil @ file:///etc/passwd'")
def _(e: Env) -> list[str]:
    return _requirements(e, "lure==1.0\n", index=lambda d: _wheel(
        d, "lure", "1.0", ("evil @ file:///etc/passwd",)))


# the agent's npm and Debian packages (project.npm, project.apt): the lockfile is read
# from the base tree and refused by name before anything is fetched (issue 22)
def _toolchain_repo(e: Env, files: dict[str, str], **project: Any) -> list[str]:
    """The example's agent in a repository of its own with ``files`` committed and the
    cycle's project section updated with ``project``."""
    repo = e.root / "repo"
    shutil.copytree(EXAMPLE / "project", repo)
    for name, text in files.items():
        (repo / name).write_text(text)
    git_env = {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
               "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
               "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "agent"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True, env=git_env,
                       capture_output=True)
    e.edit_cycle(lambda d: d["project"].update(repo=str(repo), subdir=None, **project))
    e.vars["npm_config_registry"] = ""  # the default registry, whatever the host sets
    return [*e.run_args(), "--prepare-only"]


def _lock(entry: dict[str, Any]) -> dict[str, str]:
    deps = {"evil": "1.0.0"}
    return {"package.json": json.dumps({"name": "a", "dependencies": deps}),
            "package-lock.json": json.dumps({"name": "a", "lockfileVersion": 3, "packages": {
                "": {"name": "a", "dependencies": deps},
                "node_modules/evil": {"version": "1.0.0", "integrity": "sha512-" + "A" * 86
                                      + "==", **entry}}})}


@case("npm-git-dependency", 3, "cycle.yaml", "project.npm", "package-lock.json",
      "'node_modules/evil'", "git+ssh: dependency")
def _(e: Env) -> list[str]:
    return _toolchain_repo(e, _lock({"resolved": "git+ssh://git@github.com/e/evil.git#1"}),
                           npm="package-lock.json")


@case("npm-file-dependency", 3, "cycle.yaml", "project.npm", "'node_modules/evil'",
      "file: dependency")
def _(e: Env) -> list[str]:
    return _toolchain_repo(e, _lock({"resolved": "file:../evil"}), npm="package-lock.json")


@case("npm-install-script", 3, "cycle.yaml", "project.npm", "evil@1.0.0 declares an install "
      "script")
def _(e: Env) -> list[str]:
    return _toolchain_repo(e, _lock({"hasInstallScript": True}), npm="package-lock.json")


@case("npm-no-integrity", 3, "cycle.yaml", "project.npm", "'node_modules/evil'",
      "no sha512 integrity")
def _(e: Env) -> list[str]:
    files = _lock({})
    doc = json.loads(files["package-lock.json"])
    del doc["packages"]["node_modules/evil"]["integrity"]
    return _toolchain_repo(e, {**files, "package-lock.json": json.dumps(doc)},
                           npm="package-lock.json")


@case("npm-lockfile-missing", 3, "cycle.yaml", "project.npm", "package-lock.json is not a "
      "file in the base tree")
def _(e: Env) -> list[str]:
    return _toolchain_repo(e, {}, npm="package-lock.json")


@case("npm-ignore-scripts-without-npm", 3, "cycle.yaml", "project.npm_ignore_scripts",
      "without project.npm")
def _(e: Env) -> list[str]:
    return _toolchain_repo(e, {}, npm_ignore_scripts=["esbuild"])


@case("apt-option-as-name", 3, "cycle.yaml", "project.apt", "is not a Debian package name")
def _(e: Env) -> list[str]:
    return _toolchain_repo(e, {}, apt=["-oAPT::Get::AllowUnauthenticated=true"])


# scenario manifest
def _manifest_text(e: Env, text: str | bytes) -> list[str]:
    (e.ex / "manifest.json").write_bytes(text.encode() if isinstance(text, str) else text)
    return e.run_args()


@case("manifest-not-utf8", 3, "manifest.json", "not UTF-8")
def _(e: Env) -> list[str]:
    return _manifest_text(e, b'{"schema": 1, "dataset": "\xc3\x28"}')


@case("manifest-deep-json", 3, "manifest.json", "deeper than 64")
def _(e: Env) -> list[str]:
    return _manifest_text(e, '{"schema": 1, "x": ' + "[" * 5000 + "]" * 5000 + "}")


@case("manifest-duplicate-key", 3, "manifest.json", "duplicate key")
def _(e: Env) -> list[str]:
    return _manifest_text(e, '{"schema": 1, "schema": 1}')


@case("manifest-nan", 3, "manifest.json", "NaN")
def _(e: Env) -> list[str]:
    return _manifest_text(e, '{"schema": 1, "x": NaN}')


@case("manifest-is-a-list", 3, "manifest.json", "expected a mapping")
def _(e: Env) -> list[str]:
    return _manifest_text(e, "[]")


@case("manifest-schema-2", 3, "manifest.json", "schema must be 1")
def _(e: Env) -> list[str]:
    m = e.manifest()
    m["schema"] = 2
    e.set_manifest(m)
    return e.run_args()


@case("manifest-unknown-split", 3, "manifest.json", "scenarios[0].split", "unknown split")
def _(e: Env) -> list[str]:
    m = e.manifest()
    m["scenarios"][0]["split"] = "developement"
    e.set_manifest(m)
    return e.run_args()


@case("manifest-split-dev", 3, "manifest.json", "scenarios[0].split",
      "use one of development, acceptance, reserved, train")
def _(e: Env) -> list[str]:
    m = e.manifest()
    m["scenarios"][0]["split"] = "dev"
    e.set_manifest(m)
    return e.run_args()


@case("manifest-no-development-case", 3, "manifest.json", "no scenario has split 'development'")
def _(e: Env) -> list[str]:
    from runner.cycle.manifest import reference_hash
    from runner.cycle.models import Scenario

    m = e.manifest()
    m["scenarios"] = [s for s in m["scenarios"] if s["split"] != "development"]
    m["split"] = "acceptance"
    m["reference_hash"] = reference_hash([Scenario.model_validate(s) for s in m["scenarios"]])
    e.set_manifest(m)
    pol = yaml.safe_load((e.ex / "policy.yaml").read_text())
    pol["cases"] = [s["id"] for s in m["scenarios"]]
    pol["mandatory"] = [c for c in pol["mandatory"] if c in pol["cases"]]
    (e.ex / "policy.yaml").write_text(yaml.safe_dump(pol))
    return e.run_args()


@case("manifest-split-not-covered", 3, "manifest.json", "scenarios[6].split")
def _(e: Env) -> list[str]:
    m = e.manifest()
    m["split"] = "development"
    e.set_manifest(m)
    return e.run_args()


@case("manifest-absolute-store", 3, "manifest.json", "stores.shop.path", "absolute")
def _(e: Env) -> list[str]:
    m = e.manifest()
    m["stores"]["shop"]["path"] = "/etc/passwd"
    e.set_manifest(m)
    return e.run_args()


@case("manifest-store-dotdot", 3, "manifest.json", "stores.shop.path", "escapes")
def _(e: Env) -> list[str]:
    m = e.manifest()
    m["stores"]["shop"]["path"] = "../../shop.sqlite"
    e.set_manifest(m)
    return e.run_args()


@case("manifest-store-symlink-out", 3, "manifest.json", "stores.shop.path", "outside")
def _(e: Env) -> list[str]:
    m = e.manifest()
    m["stores"]["shop"]["path"] = "link/shop.sqlite"
    e.set_manifest(m)
    (e.ex / "data" / "link").symlink_to(e.root / "ex")
    return e.run_args()


@case("manifest-unknown-store", 3, "manifest.json", "scenarios[0].store")
def _(e: Env) -> list[str]:
    m = e.manifest()
    m["scenarios"][0]["store"] = "warehouse"
    e.set_manifest(m)
    return e.run_args()


@case("manifest-duplicate-id", 3, "manifest.json", "duplicate scenario ids")
def _(e: Env) -> list[str]:
    m = e.manifest()
    m["scenarios"][1]["id"] = m["scenarios"][0]["id"]
    e.set_manifest(m)
    return e.run_args()


@case("manifest-number-reference-text", 3, "manifest.json", "scenarios[0].reference")
def _(e: Env) -> list[str]:
    m = e.manifest()
    m["scenarios"][0]["reference"]["value"] = "lots"
    e.set_manifest(m)
    return e.run_args()


# comparison policy
@case("policy-not-utf8", 3, "policy.yaml", "not UTF-8")
def _(e: Env) -> list[str]:
    (e.ex / "policy.yaml").write_bytes(b"schema: 1\ncases: [\xe9]\n")
    return e.run_args()


@case("policy-duplicate-key", 3, "policy.yaml", "duplicate key")
def _(e: Env) -> list[str]:
    p = e.ex / "policy.yaml"
    p.write_text(p.read_text() + "trials: 2\n")
    return e.run_args()


@case("policy-alias-bomb", 3, "policy.yaml", "anchors")
def _(e: Env) -> list[str]:
    p = e.ex / "policy.yaml"
    p.write_text(BOMB + p.read_text())
    return e.run_args()


@case("policy-trials-differ", 3, "cycle.yaml", "trials")
def _(e: Env) -> list[str]:
    p = e.ex / "policy.yaml"
    p.write_text(p.read_text().replace("trials: 1", "trials: 2"))
    return e.run_args()


@case("policy-require-judge-without-a-judge", 3, "cycle.yaml", "judge", "require_judge")
def _(e: Env) -> list[str]:
    p = e.ex / "policy.yaml"
    p.write_text(p.read_text().replace("require_judge: false", "require_judge: true"))
    e.edit_cycle(lambda d: d.pop("judge", None))
    return e.run_args()


@case("policy-no-criteria", 3, "policy.yaml", "criteria", "at least 1")
def _(e: Env) -> list[str]:
    p = e.ex / "policy.yaml"
    p.write_text(p.read_text().replace("criteria: [correctness, evidence, refusal]",
                                       "criteria: []"))
    return e.run_args()


@case("upstream-base-url-without-scheme", 3, "cycle.yaml", "base_url", "https?://")
def _(e: Env) -> list[str]:
    e.edit_cycle(lambda d: d["upstreams"].update(target={
        "provider": "openai", "base_url": "api.example.com/v1",
        "credential": {"env": "HOME"}, "models": ["m"]}))
    return e.run_args()


@case("upstream-price-for-a-model-not-listed", 3, "cycle.yaml", "prices", "gpt-4o-mini")
def _(e: Env) -> list[str]:
    e.edit_cycle(lambda d: d["upstreams"]["target"].update(
        prices={"gpt-4o-mini": {"input_per_mtok": 0.15, "output_per_mtok": 0.6}}))
    return e.run_args()


@case("policy-unknown-case", 3, "cycle.yaml", "policy.cases", "zz-none")
def _(e: Env) -> list[str]:
    p = e.ex / "policy.yaml"
    p.write_text(p.read_text().replace("cases: [", "cases: [zz-none, "))
    return e.run_args()


@case("policy-wrong-suffix", 3, "policy.txt", "suffix")
def _(e: Env) -> list[str]:
    shutil.copy(e.ex / "policy.yaml", e.ex / "policy.txt")
    e.set_cycle(policy="policy.txt")
    return e.run_args()


@case("policy-json-deep", 3, "policy.json", "deeper than 64")
def _(e: Env) -> list[str]:
    (e.ex / "policy.json").write_text('{"schema": 1, "cases": ' + "[" * 100 + "]" * 100 + "}")
    e.set_cycle(policy="policy.json")
    return e.run_args()


# role policies
@case("roles-memory-zero", 3, "roles.yaml", "roles.analyst.memory", "positive")
def _(e: Env) -> list[str]:
    e.roles_yaml(lambda d: d["roles"]["analyst"].update(memory=0))
    return e.run_args()


@case("roles-memory-zero-string", 3, "roles.yaml", "roles.worker.memory")
def _(e: Env) -> list[str]:
    e.roles_yaml(lambda d: d["roles"]["worker"].update(memory="0m"))
    return e.run_args()


@case("roles-memory-float", 3, "roles.yaml", "roles.analyst.memory")
def _(e: Env) -> list[str]:
    e.roles_yaml(lambda d: d["roles"]["analyst"].update(memory=1.5))
    return e.run_args()


@case("roles-tmpfs-null", 3, "roles.yaml", "roles.analyst.tmpfs")
def _(e: Env) -> list[str]:
    e.roles_yaml(lambda d: d["roles"]["analyst"].update(tmpfs=None))
    return e.run_args()


@case("roles-timeout-inf", 3, "roles.yaml", "roles.analyst.timeout_s", "non-finite")
def _(e: Env) -> list[str]:
    text = ROLES.read_text().replace("timeout_s: 120", "timeout_s: .inf", 1)
    e.write("roles.yaml", text)
    e.set_cycle(roles=str(e.root / "roles.yaml"))
    return e.run_args()


@case("roles-timeout-string-inf", 3, "roles.yaml", "roles.analyst.timeout_s")
def _(e: Env) -> list[str]:
    e.roles_yaml(lambda d: d["roles"]["analyst"].update(timeout_s="inf"))
    return e.run_args()


@case("roles-alias-bomb", 3, "roles.yaml", "anchors")
def _(e: Env) -> list[str]:
    e.write("roles.yaml", BOMB + ROLES.read_text())
    e.set_cycle(roles=str(e.root / "roles.yaml"))
    return e.run_args()


@case("roles-not-utf8", 3, "roles.yaml", "not UTF-8")
def _(e: Env) -> list[str]:
    e.write("roles.yaml", ROLES.read_bytes().replace(b"image: analyst", b"image: an\xffalyst"))
    e.set_cycle(roles=str(e.root / "roles.yaml"))
    return e.run_args()


@case("roles-privileged", 3, "roles.yaml", "roles.analyst.privileged")
def _(e: Env) -> list[str]:
    e.roles_yaml(lambda d: d["roles"]["analyst"].update(privileged=True))
    return e.run_args()


@case("roles-with-upstreams", 3, "roles.yaml", "upstreams", "defined in the cycle file")
def _(e: Env) -> list[str]:
    e.roles_yaml(lambda d: d.update(upstreams={"target": {
        "provider": "scripted", "script": "scripts/default.yaml", "models": ["m"]}}))
    return e.run_args()


@case("roles-missing-apply", 3, "roles.yaml", "roles", "apply")
def _(e: Env) -> list[str]:
    e.roles_yaml(lambda d: d["roles"].pop("apply"))
    return e.run_args()


# scripted-provider scripts
def _script(e: Env, text: str | bytes) -> list[str]:
    (e.ex / "scripts" / "target.yaml").write_bytes(
        text.encode() if isinstance(text, str) else text)
    return e.run_args()


@case("script-not-utf8", 3, "target.yaml", "not UTF-8")
def _(e: Env) -> list[str]:
    return _script(e, b"schema: 1\nrules: []\ndefault: {reply: \"\xff\"}\n")


@case("script-rules-not-mappings", 3, "target.yaml", "rules[0]")
def _(e: Env) -> list[str]:
    return _script(e, "schema: 1\nrules: [1, 2]\n")


@case("script-rule-without-reply", 3, "target.yaml", "rules[0]", "reply")
def _(e: Env) -> list[str]:
    return _script(e, "schema: 1\nrules: [{when: {role: analyst}}]\n")


@case("script-bad-regex", 3, "target.yaml", "rules[0].when.last_user_regex")
def _(e: Env) -> list[str]:
    return _script(e, "schema: 1\nrules: [{when: {last_user_regex: '(('}, reply: x}]\n")


@case("script-unknown-condition", 3, "target.yaml", "rules[0].when.sometimes")
def _(e: Env) -> list[str]:
    return _script(e, "schema: 1\nrules: [{when: {sometimes: true}, reply: x}]\n")


@case("script-schema-missing", 3, "target.yaml", "schema")
def _(e: Env) -> list[str]:
    return _script(e, "rules: []\n")


# a prepared plan
@case("plan-missing", 3, "plan.json", "does not exist")
def _(e: Env) -> list[str]:
    return ["cycle", "run", "--plan", str(e.root / "plan.json")]


@case("plan-not-json", 3, "plan.json", "invalid JSON")
def _(e: Env) -> list[str]:
    return ["cycle", "run", "--plan", str(e.write("plan.json", "plan: yaml\n"))]


@case("plan-is-a-list", 3, "plan.json", "expected a mapping")
def _(e: Env) -> list[str]:
    return ["cycle", "run", "--plan", str(e.write("plan.json", "[]"))]


@case("plan-run-by-another-process", 3, "being run by another process")
def _(e: Env) -> list[str]:
    plan = e.prepare()
    fd = os.open(plan, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as the racing process that got there first
    e.vars["_LOCK_FD"] = str(fd)
    e.untouched.append(plan.parent)
    return ["cycle", "run", "--plan", str(plan)]


@case("freeze-out-exists", 3, "already exists")
def _(e: Env) -> list[str]:
    e.write("out/keep.txt", "evidence")
    e.untouched.append(e.out)
    return ["freeze", str(e.cycle), "--out", str(e.out)]


@case("freeze-replay-from-a-run-that-no-longer-verifies", 8, "run_altered", "calls.jsonl",
      "only from a run that verifies")
def _(e: Env) -> list[str]:
    """helper-45: a replay answered from a call log edited after its receipt."""
    e.write("rec/receipt.json", json.dumps({"schema": 1, "plan_hash": "p",
                                            "files": {"gateway/calls.jsonl": "0" * 64}}))
    e.write("rec/gateway/calls.jsonl", "")
    return ["freeze", str(e.cycle), "--out", str(e.out), "--replay", str(e.root / "rec")]


@case("freeze-bad-replay", 3, "cycle.yaml", "replay_from")
def _(e: Env) -> list[str]:
    (e.root / "not-a-run").mkdir()
    return ["freeze", str(e.cycle), "--out", str(e.out), "--replay", str(e.root / "not-a-run")]


# compare
def _records(e: Env, text: str | bytes) -> list[str]:
    bad = e.write("bad.jsonl", text)
    return ["compare", "--baseline", str(bad), "--candidate", str(bad), "--policy",
            str(e.ex / "policy.yaml"), "--out", str(e.out)]


@case("compare-records-missing", 3, "nope.jsonl", "does not exist")
def _(e: Env) -> list[str]:
    return ["compare", "--baseline", str(e.root / "nope.jsonl"), "--candidate",
            str(e.root / "nope.jsonl"), "--policy", str(e.ex / "policy.yaml"),
            "--out", str(e.out)]


@case("compare-records-deep", 3, "bad.jsonl:1", "deeper than 64")
def _(e: Env) -> list[str]:
    return _records(e, '{"case_id": ' + "[" * 3000 + "]" * 3000 + "}\n")


@case("compare-records-not-utf8", 3, "bad.jsonl", "not UTF-8")
def _(e: Env) -> list[str]:
    return _records(e, b'{"case_id": "\xff"}\n')


@case("compare-records-list-line", 3, "bad.jsonl:2", "expected a mapping")
def _(e: Env) -> list[str]:
    return _records(e, "\n[1, 2]\n")


@case("compare-records-bad-field", 3, "bad.jsonl:1", "trial")
def _(e: Env) -> list[str]:
    return _records(e, json.dumps({"case_id": "a", "trial": -1, "split": "development",
                                   "status": "ok", "identities": {
                                       "data_hash": "x", "reference_hash": "y",
                                       "scorer": "z"}}) + "\n")


@case("compare-policy-missing", 3, "nope.yaml", "does not exist")
def _(e: Env) -> list[str]:
    good = e.write("empty.jsonl", "")
    return ["compare", "--baseline", str(good), "--candidate", str(good), "--policy",
            str(e.root / "nope.yaml"), "--out", str(e.out)]


@case("compare-out-exists", 3, "exists")
def _(e: Env) -> list[str]:
    e.write("out/verdict.json", "{}")
    e.untouched.append(e.out)
    good = e.write("empty.jsonl", "")
    return ["compare", "--baseline", str(good), "--candidate", str(good), "--policy",
            str(e.ex / "policy.yaml"), "--out", str(e.out)]


# receipts
@case("receipt-missing", 3, "receipt.json", "does not exist")
def _(e: Env) -> list[str]:
    (e.root / "run").mkdir()
    return ["receipt", "verify", str(e.root / "run")]


@case("receipt-is-a-list", 3, "receipt.json", "expected a mapping")
def _(e: Env) -> list[str]:
    e.write("run/receipt.json", "[]")
    return ["receipt", "verify", str(e.root / "run")]


@case("receipt-empty-object", 3, "receipt.json", "schema")
def _(e: Env) -> list[str]:
    e.write("run/receipt.json", "{}")
    return ["receipt", "verify", str(e.root / "run")]


@case("receipt-files-not-mapping", 3, "receipt.json", "files")
def _(e: Env) -> list[str]:
    e.write("run/receipt.json", '{"schema": 1, "plan_hash": "x", "files": []}')
    return ["receipt", "verify", str(e.root / "run")]


@case("receipt-dir-missing", 3, "not a directory")
def _(e: Env) -> list[str]:
    return ["receipt", "verify", str(e.root / "no-run")]


@case("keygen-missing-directory", 3, "--out", "no-such-dir does not exist")
def _(e: Env) -> list[str]:
    return ["receipt", "keygen", "--out", str(e.root / "no-such-dir" / "signing.pem")]


@case("attest-run-missing", 3, "RUN", "not a directory")
def _(e: Env) -> list[str]:
    return ["receipt", "attest", str(e.root / "no-run"), "--key", str(e.root / "k")]


@case("attest-key-missing", 3, "no-key.pem", "does not exist")
def _(e: Env) -> list[str]:
    e.write("run/receipt.json", "{}")
    return ["receipt", "attest", str(e.root / "run"), "--key", str(e.root / "no-key.pem")]


@case("attest-key-not-a-key", 3, "key.pem", "cannot read private key")
def _(e: Env) -> list[str]:
    e.write("run/receipt.json", "{}")
    return ["receipt", "attest", str(e.root / "run"), "--key",
            str(e.write("key.pem", "-----BEGIN PRIVATE KEY-----\nnope\n"))]


@case("receipt-compare-list", 3, "receipt.json", "expected a mapping")
def _(e: Env) -> list[str]:
    e.write("a/receipt.json", "[]")
    e.write("b/receipt.json", "[]")
    return ["receipt", "compare", str(e.root / "a"), str(e.root / "b")]


# apply
def _apply(e: Env, proposal: Path, *, repo: Path = PROJECT_ROOT, ref: str = "HEAD",
           subdir: str | None = None) -> list[str]:
    args = ["apply", "--proposal", str(proposal), "--repo", str(repo), "--ref", ref,
            "--paths", "prompts/system.md", "--allowlist", "prompts/*", "--out", str(e.out)]
    return [*args, "--subdir", subdir] if subdir is not None else args


def _good_proposal(e: Env) -> Path:
    return e.write("proposal.json", json.dumps({"files": [
        {"path": "prompts/system.md", "content": "x\n"}], "rationale": "r"}))


@case("apply-proposal-missing", 3, "proposal.json", "does not exist")
def _(e: Env) -> list[str]:
    return _apply(e, e.root / "proposal.json")


@case("apply-proposal-not-json", 3, "proposal.json", "invalid JSON")
def _(e: Env) -> list[str]:
    return _apply(e, e.write("proposal.json", "files: []"))


@case("apply-proposal-files-not-list", 3, "proposal.json", "files")
def _(e: Env) -> list[str]:
    return _apply(e, e.write("proposal.json", '{"files": {"a": 1}}'))


@case("apply-repo-missing", 3, "--repo", "does not exist")
def _(e: Env) -> list[str]:
    return _apply(e, _good_proposal(e), repo=e.root / "nope")


@case("apply-repo-not-git", 3, "--repo", "not a git repository")
def _(e: Env) -> list[str]:
    (e.root / "plain").mkdir()
    return _apply(e, _good_proposal(e), repo=e.root / "plain")


@case("apply-bad-ref", 3, "--ref", "nope-ref")
def _(e: Env) -> list[str]:
    return _apply(e, _good_proposal(e), ref="nope-ref")


@case("apply-subdir-escapes", 3, "--subdir", "escapes")
def _(e: Env) -> list[str]:
    return _apply(e, _good_proposal(e), subdir="../x")


# dream compare (two arms under one --out)
@case("dream-compare-bad-manifest", 3, "manifest.json", "scenarios[0].split")
def _(e: Env) -> list[str]:
    e.set_cycle(dream={"mode": "template"})
    m = e.manifest()
    m["scenarios"][0]["split"] = "holdout"
    e.set_manifest(m)
    return ["dream", "compare", str(e.cycle), "--out", str(e.out)]


# review packet and gateway
@case("review-manifest-deep", 3, "manifest.json", "deeper than 64")
def _(e: Env) -> list[str]:
    good = e.write("empty.jsonl", "")
    man = e.write("manifest.json", "[" * 100 + "]" * 100)
    return ["review", "packet", "--records", str(good), "--manifest", str(man),
            "--out", str(e.out)]


@case("gateway-calls-not-a-run", 3, "calls.jsonl")
def _(e: Env) -> list[str]:
    return ["gateway", "calls", str(e.root)]


@case("gateway-calls-log-the-receipt-recorded-is-gone", 8, "calls.jsonl",
      "the run's receipt recorded it")
def _(e: Env) -> list[str]:
    run = e.root / "run"
    e.write("run/receipt.json", json.dumps({"schema": 1, "plan_hash": "p",
                                            "files": {"gateway/calls.jsonl": "0" * 64}}))
    return ["gateway", "calls", str(run)]


@case("gateway-calls-log-blanked-after-the-receipt", 8, "calls.jsonl", "run_altered",
      "receipt binds")
def _(e: Env) -> list[str]:
    """helper-45: an emptied call log was listed as "no model calls", exit 0."""
    run = e.root / "run"
    e.write("run/receipt.json", json.dumps({"schema": 1, "plan_hash": "p",
                                            "files": {"gateway/calls.jsonl": "0" * 64}}))
    e.write("run/gateway/calls.jsonl", "")
    return ["gateway", "calls", str(run)]


@case("gateway-calls-receipt-is-a-dangling-link", 8, "receipt.json", "never followed")
def _(e: Env) -> list[str]:
    """helper-47 #6: a receipt.json replaced by a dangling link read as "no receipt", and
    an edited call log was listed with no word of it."""
    run = e.root / "run"
    e.write("run/gateway/calls.jsonl", "")
    (run / "receipt.json").symlink_to(e.root / "nowhere")
    return ["gateway", "calls", str(run)]


@case("receipt-compare-a-receipt-that-is-a-link", 8, "receipt.json", "never followed")
def _(e: Env) -> list[str]:
    """helper-45: compare followed a receipt.json link (and called it bad input, 3)."""
    for name in ("a", "b"):
        (e.root / name).mkdir()
        (e.root / name / "receipt.json").symlink_to("/etc/passwd")
    return ["receipt", "compare", str(e.root / "a"), str(e.root / "b")]


@case("gateway-calls-log-is-a-directory", 8, "calls.jsonl", "not a regular file")
def _(e: Env) -> list[str]:
    e.write("run/plan.json", "{}")
    (e.root / "run" / "gateway" / "calls.jsonl").mkdir(parents=True)
    return ["gateway", "calls", str(e.root / "run")]


@case("receipt-sign-a-run-without-receipt", 3, "receipt.json", "does not exist",
      "a finished run")
def _(e: Env) -> list[str]:
    from runner.cycle.keys import keygen

    keygen(e.root / "k")
    (e.root / "prepared").mkdir()
    return ["receipt", "sign", str(e.root / "prepared"), "--key", str(e.root / "k")]


@case("receipt-verify-pubkey-mistyped", 3, "k.pubb", "does not exist")
def _(e: Env) -> list[str]:
    e.write("run/receipt.json", "{}")
    return ["receipt", "verify", str(e.root / "run"), "--pubkey", str(e.root / "k.pubb")]


@case("review-calibrate-wrong-packet-dir", 3, "--packet", "holds no packet.json")
def _(e: Env) -> list[str]:
    labels = e.write("l.json", "{}")
    return ["review", "calibrate", "--packet", str(e.root / "pkk"), "--labels", str(labels),
            "--judges", str(labels), "--out", str(e.root / "c.json")]


@case("sandbox-exec-mount-unknown-user-home", 3, "--mount", "~nosuchuser/x",
      "not a usable host path")
def _(e: Env) -> list[str]:
    return ["sandbox", "exec", "--role", "analyst", "--mount", "~nosuchuser/x:/x", "--",
            "true"]


@case("sandbox-exec-mount-name-too-long", 3, "--mount", "not a usable host path")
def _(e: Env) -> list[str]:
    return ["sandbox", "exec", "--role", "analyst", "--mount",
            f"{e.root}/{'a' * 300}:/x", "--", "true"]


@case("export-run-missing-named-before-calibration", 3, "--run", "not a directory")
def _(e: Env) -> list[str]:
    return ["export", "--run", str(e.root / "no-such-run"), "--out", str(e.out)]


# init and the manifest tools
@case("init-under-read-only-dir", 3, "DIR", "ro/new", "Read-only")
def _(e: Env) -> list[str]:
    return ["init", str(e.read_only(e.root / "ro") / "new")]


@case("init-into-read-only-dir", 3, "DIR", "ro", "Read-only")
def _(e: Env) -> list[str]:
    return ["init", str(e.read_only(e.root / "ro"))]


@case("init-into-non-empty-dir", 3, "DIR", "not empty")
def _(e: Env) -> list[str]:
    e.write("full/keep.txt", "mine")
    e.untouched.append(e.root / "full")
    return ["init", str(e.root / "full")]


def _manifest_copy(e: Env) -> Path:
    """The example's manifest and data under root/m (the manifest's default --data)."""
    m = e.root / "m"
    (m / "data").mkdir(parents=True)
    shutil.copy2(e.ex / "manifest.json", m / "manifest.json")
    shutil.copy2(e.ex / "data" / "shop.sqlite", m / "data" / "shop.sqlite")
    return m


@case("manifest-rehash-read-only", 3, "manifest.json", "Read-only")
def _(e: Env) -> list[str]:
    m = _manifest_copy(e)
    with (m / "data" / "shop.sqlite").open("ab") as f:
        f.write(b"\0")  # a changed store: rehash has something to write
    e.untouched.append(m)
    e.read_only(m)
    return ["manifest", "rehash", str(m / "manifest.json")]


@case("manifest-build-out-read-only", 3, "--out", "ro/manifest.json", "Read-only")
def _(e: Env) -> list[str]:
    scen = e.write("proj/scenarios.yaml", (PROJECT_ROOT / "runner/project/template/"
                                           "scenarios.yaml").read_text()
                   .replace("__NAME__", "proj"))
    shutil.copytree(PROJECT_ROOT / "runner/project/template/data", e.root / "proj/data")
    return ["manifest", "build", "--scenarios", str(scen), "--data",
            str(e.root / "proj/data"), "--out", str(e.read_only(e.root / "ro") / "manifest.json")]


# report
@case("report-markdown-read-only", 3, "--markdown", "ro/r.md")
def _(e: Env) -> list[str]:
    (e.root / "run").mkdir()
    return ["report", str(e.root / "run"), "--markdown",
            str(e.read_only(e.root / "ro") / "r.md")]


@case("report-run-not-a-directory", 3, "RUN_DIR", "not a directory")
def _(e: Env) -> list[str]:
    return ["report", str(e.root / "nope"), "--markdown", str(e.root / "r.md")]


@case("manifest-check-data-missing", 3, "manifest.json", "--data", "does not exist")
def _(e: Env) -> list[str]:
    return ["manifest", "check", str(e.ex / "manifest.json"), "--data", str(e.root / "nope")]


# export (a hand-built finished run with a calibration bound to its receipt)
def _export(e: Env, damage: Callable[[Path], object]) -> list[str]:
    from tests.faults.test_export_faults import make_run
    from tests.unit.test_export import _calibration

    run = make_run(e.root / "run")
    cal = _calibration(e.root, "table", lambda v: v, run)
    damage(run)
    return ["export", "--run", str(run), "--out", str(e.out), "--calibration", str(cal)]


@case("export-records-gone", 8, "stages/candidate/records.jsonl: missing", "receipt")
def _(e: Env) -> list[str]:
    return _export(e, lambda run: (run / "stages/candidate/records.jsonl").unlink())


@case("export-records-cut-mid-line", 8, "stages/baseline/records.jsonl", "receipt")
def _(e: Env) -> list[str]:
    def cut(run: Path) -> None:
        f = run / "stages/baseline/records.jsonl"
        f.write_bytes(f.read_bytes()[:-30])
    return _export(e, cut)


@case("export-no-calibration", 3, "--calibration", "calibration_missing")
def _(e: Env) -> list[str]:
    from tests.faults.test_export_faults import make_run

    run = make_run(e.root / "run")
    return ["export", "--run", str(run), "--out", str(e.out)]


# dream compare
@case("dream-compare-mode-off", 3, "cycle.yaml", "dream.mode")
def _(e: Env) -> list[str]:
    e.set_cycle(dream={"mode": "off"})
    return ["dream", "compare", str(e.cycle), "--out", str(e.out)]


@case("dream-compare-out-exists", 3, "--out", "already exists")
def _(e: Env) -> list[str]:
    e.set_cycle(dream={"mode": "template"})
    e.out.mkdir()
    (e.out / "keep").write_text("evidence")
    e.untouched.append(e.out)
    return ["dream", "compare", str(e.cycle), "--out", str(e.out)]


# -- the test ------------------------------------------------------------------------------------
@dataclass
class Outcome:
    code: int | str
    stderr: str
    first_line: str
    written: list[str]
    seconds: float


def _snapshot(p: Path) -> dict[str, bytes]:
    if p.is_file():
        return {"": p.read_bytes()}
    return {str(q.relative_to(p)): (q.read_bytes() if q.is_file() else b"<dir>")
            for q in sorted(p.rglob("*"))}


def run_case(c: Case, root: Path) -> Outcome:
    e = make_env(root)
    args = c.build(e)
    lock_fd = e.vars.pop("_LOCK_FD", None)
    before = {str(p): _snapshot(p) for p in e.untouched}
    t0 = time.monotonic()
    try:
        code, _, err = run_cli(args, e.vars)
    finally:
        if lock_fd is not None:
            os.close(int(lock_fd))
        for undo in reversed(e.cleanups):
            undo()
    seconds = time.monotonic() - t0
    written = []
    if e.out.exists() and str(e.out) not in before:
        written.append(str(e.out.relative_to(root)))
    for p, snap in before.items():
        if _snapshot(Path(p)) != snap:
            written.append(f"{Path(p).relative_to(root)} (changed)")
    prepared = root / "prepared"
    for extra in ("stages", "containers.jsonl", "gateway"):
        if (prepared / extra).exists():
            written.append(f"prepared/{extra}")
    # the case's own directory is taken out, so that no expectation matches by the path
    # (progress lines a step prints before it fails, e.g. "downloading wheels", come first)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    first = next((ln for ln in lines if ln.startswith("error:")), lines[0] if lines else ""
                 ).replace(str(root), "…")
    return Outcome(code, err, first, written, seconds)


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input(c: Case, tmp_path: Path) -> None:
    o = run_case(c, tmp_path)
    assert "Traceback" not in o.stderr, o.stderr
    assert o.code == c.code, o.stderr
    for s in c.expect:
        assert s in o.first_line, f"{s!r} not in first line {o.first_line!r}"
    assert o.first_line.startswith("error:"), o.first_line
    assert o.written == [], o.written


def test_table_has_at_least_sixty_cases() -> None:
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


SAMPLE = ("cycle-not-utf8", "roles-memory-zero", "receipt-is-a-list", "manifest-absolute-store")


@pytest.mark.parametrize("name", SAMPLE)
def test_same_answers_from_the_installed_command(name: str, tmp_path: Path) -> None:
    """The in-process runs above answer exactly as the installed executable does."""
    c = next(c for c in CASES if c.id == name)
    e = make_env(tmp_path)
    args = c.build(e)
    res = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120,
                         check=False, env={**os.environ, **e.vars})
    assert "Traceback" not in res.stderr
    assert res.returncode == c.code, res.stderr
    first = next(ln for ln in res.stderr.splitlines() if ln.strip()).replace(str(tmp_path), "…")
    assert all(s in first for s in c.expect), first
    assert not e.out.exists()


def test_the_judge_key_is_not_demanded_without_a_judge(tmp_path: Path) -> None:
    """The judge upstream needs a key nobody set, but no judge is configured: the cycle
    prepares (exit 0), and its plan freezes neither the judge upstream nor an evaluator
    socket."""
    e = make_env(tmp_path)
    e.vars["CYCLEBOX_TEST_UNSET_JUDGE_KEY"] = ""
    e.edit_cycle(lambda d: d["upstreams"].update(judge={
        "provider": "openai", "base_url": "https://j.invalid/v1",
        "credential": {"env": "CYCLEBOX_TEST_UNSET_JUDGE_KEY"}, "models": ["fixture-judge"]}))
    plan = json.loads(e.prepare().read_text())["plan"]
    assert set(plan["upstreams"]) == {"target", "optimizer"}
    assert plan["roles"]["evaluator"]["upstream"] is None


def test_racing_freezes_get_one_run_and_one_refusal(tmp_path: Path) -> None:
    """Two processes freezing into the same --out: one plan, one clear refusal (exit 3)."""
    e = make_env(tmp_path)
    args = [CLI, "cycle", "run", str(e.cycle), "--out", str(e.out), "--prepare-only"]
    env = {**os.environ, **e.vars}
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    results = [(p.wait(timeout=120), p.stderr.read() if p.stderr else "") for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 3], results
    loser = next(err for code, err in results if code == 3)
    assert "Traceback" not in loser and "FileExistsError" not in loser
    assert str(e.out) in loser and "already exists" in loser
    assert (e.out / "plan.json").is_file()
