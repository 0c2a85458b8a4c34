"""Walks over a run directory or an input tree work by directory descriptor.

A path of 4,090 bytes, 16 directories deep, is inside every output cap, but its
absolute form on the host is past PATH_MAX: anything that opens it by absolute path
fails (ENAMETOOLONG). And no walk leaves an unreadable directory out silently: the
receipt names it (the old walk skipped it under ``except OSError: continue``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from runner.cycle.receipt import _files, _present, _sha256_in
from runner.errors import IntegrityError
from runner.paths import PROJECT_ROOT
from tests.fixtures.cycle_project import cli_env, example_agent, project_with_agent, run_cli
from tests.fixtures.deep import LONG_DEPTH, LONG_FILE, LONG_PART, make_long

# 16 directories of 240 bytes + "/" each, and a 234-byte file name: 4,090 bytes
DEPTH, PART, FILE = LONG_DEPTH, LONG_PART, LONG_FILE


def _make_deep(root: Path, data: bytes = b"deep\n") -> str:
    rel = make_long(root, data)
    assert len(rel.encode()) == 4090
    return rel


def test_receipt_hashes_a_path_past_path_max_and_verifies(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "stages/baseline/c1/out").mkdir(parents=True)
    rel = "stages/baseline/c1/out/" + _make_deep(run / "stages/baseline/c1/out")
    assert len(str(run / rel)) > 4096
    files, escaped = _files(run)
    assert files[rel] == hashlib.sha256(b"deep\n").hexdigest()
    assert not escaped
    # verify's side: the walk finds it and re-hashes it, relative to the run dir's fd
    fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY)
    try:
        present, problems = _present(fd)
        assert rel in present and not problems
        assert _sha256_in(fd, rel) == files[rel]
    finally:
        os.close(fd)


_AS_NOBODY = """
import os, sys
from pathlib import Path
from runner.cycle.receipt import _files, _present
from runner.errors import IntegrityError
"x".encode("unicode_escape"); b"x".decode("utf-8", "backslashreplace")
os.setgid(65534); os.setuid(65534)  # after the imports: the interpreter's files stay ours
run = Path(sys.argv[1])
try:
    _files(run)
    print("BUILT")
except IntegrityError as exc:
    print("REFUSED", exc)
fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY)
print("PRESENT", _present(fd)[1])
"""


@pytest.mark.skipif(os.getuid() != 0, reason="drops to uid 65534 to make a directory unreadable")
def test_unreadable_directory_in_a_run_dir_is_named_not_skipped() -> None:
    base = Path(tempfile.mkdtemp(prefix="cbx-unreadable-"))
    try:
        os.chmod(base, 0o755)
        run = base / "run"
        (run / "stages/baseline/c1/out/locked").mkdir(parents=True)
        (run / "stages/baseline/c1/out/locked/answer.json").write_text("{}")
        (run / "plan.json").write_text("{}")
        for p in [run, *run.rglob("*")]:
            os.chown(p, 65534, 65534)
        os.chmod(run / "stages/baseline/c1/out/locked", 0)
        res = subprocess.run([sys.executable, "-c", _AS_NOBODY, str(run)], capture_output=True,
                             text=True, timeout=60, check=False, cwd=PROJECT_ROOT,
                             env=dict(os.environ, PYTHONPATH=str(PROJECT_ROOT)))
        assert res.returncode == 0, res.stderr
        assert "BUILT" not in res.stdout, res.stdout
        assert "REFUSED" in res.stdout and "stages/baseline/c1/out/locked" in res.stdout
        assert "Permission denied" in res.stdout, res.stdout
        assert "PRESENT ['stages/baseline/c1/out/locked: cannot open" in res.stdout
    finally:
        shutil.rmtree(base)


def test_integrity_error_class_is_what_build_raises(tmp_path: Path) -> None:
    """A run directory holding something the walk cannot pass is a named IntegrityError."""
    run = tmp_path / "run"
    d = run / "a"
    d.mkdir(parents=True)
    for _ in range(70):  # past the walk's depth bound
        d = d / "d"
    d.mkdir(parents=True)
    with pytest.raises(IntegrityError, match="nested deeper than"):
        _files(run)


_DEEP_AGENT = f'''
import os as _os


def _deep_output():
    fd = _os.open("/out", _os.O_RDONLY | _os.O_DIRECTORY)
    for i in range({DEPTH}):
        name = "%02d" % i + "d" * {PART - 2}
        _os.mkdir(name, dir_fd=fd)
        nfd = _os.open(name, _os.O_RDONLY | _os.O_DIRECTORY, dir_fd=fd)
        _os.close(fd)
        fd = nfd
    w = _os.open("{FILE}", _os.O_WRONLY | _os.O_CREAT, 0o644, dir_fd=fd)
    _os.write(w, b"deep output\\n")
    _os.close(w)
    _os.close(fd)


_deep_output()
'''


def _with_deep_output(agent: str) -> str:
    head, sep, tail = agent.partition("\ndef main()")
    return head + _DEEP_AGENT + sep + tail


@pytest.mark.docker
def test_container_writing_a_4090_byte_path_gets_a_verified_receipt(tmp_path: Path) -> None:
    cycle = project_with_agent(tmp_path / "cyc", _with_deep_output(example_agent()))
    out = tmp_path / "run"
    env = cli_env(tmp_path)
    res = run_cli("cycle", "run", str(cycle), "--out", str(out), env=env, timeout=900)
    assert (out / "receipt.json").is_file(), (res.returncode, res.stderr[-3000:])
    assert res.returncode in (0, 1), res.stderr[-3000:]
    records = [json.loads(line) for arm in ("baseline", "candidate")
               for line in (out / "stages" / arm / "records.jsonl").read_text().splitlines()]
    assert records and all(r["status"] == "ok" for r in records), records
    receipt = json.loads((out / "receipt.json").read_text())
    deep = [f for f in receipt["files"] if f.endswith(FILE)]
    assert deep and all(len(f.encode()) > 4090 for f in deep), list(receipt["files"])[:5]
    ver = run_cli("receipt", "verify", str(out), env=env)
    assert ver.returncode == 0, ver.stdout + ver.stderr


@pytest.mark.docker
def test_input_tree_with_a_path_past_path_max_is_bad_input(tmp_path: Path) -> None:
    cycle = project_with_agent(tmp_path / "cyc", example_agent())
    data = tmp_path / "cyc" / "data"
    (data / "deep").mkdir()
    rel = _make_deep(data / "deep")
    out = tmp_path / "run"
    res = run_cli("cycle", "run", str(cycle), "--out", str(out), env=cli_env(tmp_path),
                  timeout=900)
    assert res.returncode == 3, (res.returncode, res.stderr[-3000:])
    assert FILE[:50] in res.stderr and "PATH_MAX" in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert rel  # the refused path is the one made above
