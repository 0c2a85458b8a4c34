"""Pure parts of "no crash without a receipt": failure classification, JSON writing
that never raises on hostile strings, collect's name rules and iterative walks, the
receipt writer's walk, and the CLI's one error boundary."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.cycle.receipt import _files
from runner.errors import (
    EXIT_ENGINE,
    EXIT_ENVIRONMENT,
    EXIT_INTERRUPTED,
    EXIT_OUTPUT_REFUSED,
    EXIT_UNEXPECTED,
    IntegrityError,
    OutputRejected,
    SandboxError,
)
from runner.failures import classify, one_line
from runner.hashing import canonical_bytes, write_json
from runner.isolation.collect import collect, dir_usage
from tests.fixtures.deep import remove_deep

CLI = str(Path(sys.executable).with_name("cyclebox"))


def test_classify_names_reason_and_exit_code() -> None:
    assert classify(KeyboardInterrupt()).exit_code == EXIT_INTERRUPTED
    assert classify(KeyboardInterrupt()).reason == "interrupted"
    disk = classify(OSError(errno.ENOSPC, "No space left on device"))
    assert (disk.reason, disk.exit_code) == ("environment_failure", EXIT_ENVIRONMENT)
    assert classify(SandboxError("gone")).exit_code == EXIT_ENGINE
    bug = classify(RecursionError("deep"))
    assert (bug.reason, bug.exit_code) == ("unexpected_error", EXIT_UNEXPECTED)
    assert classify(OutputRejected("x")).exit_code == EXIT_OUTPUT_REFUSED
    # an engine error wrapped by another error is still an engine error
    import requests.exceptions

    try:
        try:
            raise requests.exceptions.ConnectionError("refused")
        except requests.exceptions.ConnectionError as exc:
            raise RuntimeError("while checking leftovers") from exc
    except RuntimeError as wrapped:
        assert classify(wrapped).reason == "engine_error"


def test_an_explicit_cyclebox_error_wins_over_the_engine_error_it_was_raised_in() -> None:
    """Issue 21 fault 1: ``raise ConfigError(...) from None`` inside ``except SandboxError``
    (an unsatisfiable project.requirements) exited 6, and "engine not reachable"
    (PrerequisiteError from None over a docker error) exited 6: classify followed
    ``__context__`` and checked engine errors before the class raised on purpose."""
    import requests.exceptions

    from runner.errors import EXIT_BAD_INPUT, EXIT_PREREQUISITE, ConfigError, PrerequisiteError

    try:
        try:
            raise SandboxError("image build failed: returned a non-zero code: 1")
        except SandboxError:
            raise ConfigError("requirements conflict", field="project.requirements") from None
    except ConfigError as bad:
        got = classify(bad)
        assert (got.reason, got.exit_code) == ("cyclebox_error", EXIT_BAD_INPUT)
    try:
        try:
            raise requests.exceptions.ConnectionError("refused")
        except requests.exceptions.ConnectionError:
            raise PrerequisiteError("Docker engine not reachable") from None
    except PrerequisiteError as missing:
        assert classify(missing).exit_code == EXIT_PREREQUISITE
    try:
        try:
            raise requests.exceptions.ConnectionError("refused")
        except requests.exceptions.ConnectionError as exc:
            raise SandboxError("engine lost") from exc
    except SandboxError as lost:
        assert (classify(lost).reason, classify(lost).exit_code) == ("engine_error",
                                                                    EXIT_ENGINE)


def test_one_line_escapes_controls_and_surrogates() -> None:
    text = one_line("a\nb\x1b[31m\ud800" + "x" * 600)
    assert "\n" not in text and "\x1b" not in text and len(text) < 520
    text.encode("utf-8")


def test_json_writing_never_raises_on_hostile_strings(tmp_path: Path) -> None:
    hostile = {"detail": "stderr \ud800 tail", "k\udcff": ["\ud83d"]}
    write_json(tmp_path / "v.json", hostile)
    back = json.loads((tmp_path / "v.json").read_text())
    assert back["detail"] == "stderr \\ud800 tail"
    canonical_bytes(hostile).decode("utf-8")
    deep: list[object] = []
    node = deep
    for _ in range(5000):
        node.append([])
        node = node[0]  # type: ignore[assignment]
    assert b"nested deeper" in canonical_bytes({"d": deep})
    # valid text is written unchanged
    assert canonical_bytes({"a": "\u00e9\U0001f600"}) == '{"a":"\u00e9\U0001f600"}'.encode()


def _mk(root: Path, name: bytes, data: bytes = b"{}") -> None:
    with open(os.path.join(bytes(root), name), "wb") as f:
        f.write(data)


@pytest.mark.parametrize(("name", "words"), [
    (b"\xff\xfe.json", "not UTF-8"),
    (b"\xed\xa0\x80.txt", "not UTF-8"),
    (b"evil\x1b[31m.json", "control character"),
    (b"new\nline.json", "control character"),
])
def test_collect_refuses_names_by_name(tmp_path: Path, name: bytes, words: str) -> None:
    _mk(tmp_path, b"answer.json")
    _mk(tmp_path, name)
    with pytest.raises(OutputRejected, match=words) as exc:
        collect(tmp_path)
    str(exc.value).encode("utf-8")  # printable: the name is escaped
    assert "\x1b" not in str(exc.value) and "\n" not in str(exc.value)


def _deep(root: Path, depth: int) -> Path:
    fd = os.open(root, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
            f.write("x")
    finally:
        os.close(fd)
    return root


def test_deep_trees_are_walked_iteratively(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    try:
        _deep(out, 1500)
        with pytest.raises(OutputRejected, match="nested deeper than 16"):
            collect(out)
        _used, entries = dir_usage(out)
        assert entries == 1501
        # the receipt's walk is bounded (64 levels; copy-out lets 32 through): refused by
        # name, never a RecursionError
        with pytest.raises(IntegrityError, match="nested deeper than 64"):
            _files(tmp_path)
    finally:
        remove_deep(out)


def test_receipt_walk_keeps_non_utf8_names_apart(tmp_path: Path) -> None:
    _mk(tmp_path, b"ok.json")
    _mk(tmp_path, b"\xff.bin", b"data")
    files, escaped = _files(tmp_path)
    assert list(files) == ["ok.json"]
    assert list(escaped) == ["\\xff.bin"]
    canonical_bytes({"files": files, "files_not_utf8": escaped})


def test_cli_unexpected_error_is_one_line_naming_a_log(tmp_path: Path) -> None:
    # A bug inside a command (here: `version` made to raise) goes through main()'s boundary.
    env = dict(os.environ, CYCLEBOX_STATE_DIR=str(tmp_path / "state"))
    code = ("import sys, runner.cli as c\n"
            "def boom(): raise FileNotFoundError(2, 'planted bug', '/nowhere')\n"
            "cmd = next(x for x in c.app.registered_commands if x.callback.__name__ == 'version')\n"
            "cmd.name, cmd.callback = 'version', boom\n"
            "sys.argv = ['cyclebox', 'version']\n"
            "c.main()\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=False, timeout=60)
    assert res.returncode == EXIT_UNEXPECTED, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    logs = list((tmp_path / "state" / "logs").glob("error-*.log"))
    assert len(logs) == 1 and "Traceback" in logs[0].read_text()
    assert logs[0].name in "".join(lines)
    assert res.stderr.startswith("error: unexpected_error: FileNotFoundError")


def test_cli_usage_error_is_bad_input_not_a_verdict_code() -> None:
    res = subprocess.run([CLI, "cycle", "run", "--no-such-flag"], capture_output=True,
                         text=True, check=False, timeout=60)
    assert res.returncode == 3, res.stderr


def test_a_signal_inside_deferred_unwinds_right_after_it() -> None:
    """A first signal while a staging copy is made is held, then unwinds as
    KeyboardInterrupt once the copy is handed over (so its ``finally`` removes it)."""
    import signal

    from runner import interrupts

    state = interrupts._state
    saved = (state.signals, state.shield, state.pending)
    steps: list[str] = []
    try:
        state.signals, state.shield, state.pending = 0, 0, False
        with pytest.raises(KeyboardInterrupt), interrupts.deferred():
            interrupts._handler(signal.SIGTERM, None)  # held, not raised here
            steps.append("copy made and handed over")
        assert steps == ["copy made and handed over"]
        assert state.pending is False
    finally:
        state.signals, state.shield, state.pending = saved
