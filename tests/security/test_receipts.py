"""`cyclebox receipt verify` against a tampered run directory.

A run directory is made with the receipt writer's own file walk (so writer and verifier
agree on what is bound), then attacked: names that climb out (`../../x`), absolute names,
a symlinked file, a symlinked directory component, a receipt naming only files outside
the run, an extra unlisted file, a missing file, a FIFO. Each attack keeps every hash
*correct* for what it points at, so only the path/link/file-set checks can catch it;
each must exit 8 naming the problem. A good receipt, signed or not, still verifies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.cycle.receipt import _files
from runner.hashing import sha256_bytes, sha256_json

CLI = [str(Path(sys.executable).with_name("cyclebox"))]
if not Path(CLI[0]).exists():  # pragma: no cover - fallback when not installed as a script
    CLI = [sys.executable, "-m", "runner.cli"]

OUT_TXT = b"stage output\n"


def verify(run: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "receipt", "verify", str(run), *extra], capture_output=True,
                          text=True, timeout=60, check=False, env={**os.environ,
                                                                   "COLUMNS": "300"})


def write_receipt(run: Path, files: dict[str, str]) -> None:
    (run / "receipt.json").write_text(json.dumps(
        {"schema": 1, "plan_hash": sha256_json({"name": "t"}), "files": files,
         "external": {}}, sort_keys=True))


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run directory with nested files, git internals, and a receipt over all of it."""
    d = tmp_path / "case" / "run"
    (d / "stages" / "a").mkdir(parents=True)
    (d / "plan.json").write_text(json.dumps({"plan": {"name": "t"},
                                             "plan_hash": sha256_json({"name": "t"})}))
    (d / "stages" / "a" / "out.txt").write_bytes(OUT_TXT)
    (d / "stages" / "a" / "records.jsonl").write_text("{}\n")
    git = d / "stages" / "apply" / "candidate.git" / "objects"
    git.mkdir(parents=True)
    (git / "pack").write_bytes(b"bound through the commit id, not listed")
    write_receipt(d, _files(d))
    res = verify(d)
    assert res.returncode == 0, res.stdout + res.stderr  # positive control
    return d


def test_good_receipt_verifies_signed_and_unsigned(run: Path, tmp_path: Path) -> None:
    assert set(json.loads((run / "receipt.json").read_text())["files"]) == {
        "plan.json", "stages/a/out.txt", "stages/a/records.jsonl"}
    key = tmp_path / "k"
    subprocess.run([*CLI, "receipt", "keygen", "--out", str(key)], check=True,
                   capture_output=True)
    subprocess.run([*CLI, "receipt", "sign", str(run), "--key", str(key)], check=True,
                   capture_output=True)
    assert (run / "receipt.dsse.json").is_file()
    res = verify(run, "--pubkey", str(key) + ".pub")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "receipt verified" in res.stdout


def test_dotdot_name_refused(run: Path) -> None:
    outside = run.parent.parent / "x"
    outside.write_bytes(b"outside the run\n")
    files = json.loads((run / "receipt.json").read_text())["files"]
    write_receipt(run, {**files, "../../x": sha256_bytes(outside.read_bytes())})
    res = verify(run)
    assert res.returncode == 8, res.stdout + res.stderr
    assert "../../x: '..' component refused" in res.stderr


def test_absolute_name_refused(run: Path, tmp_path: Path) -> None:
    target = tmp_path / "abs.txt"
    target.write_bytes(b"absolute\n")
    files = json.loads((run / "receipt.json").read_text())["files"]
    write_receipt(run, {**files, str(target): sha256_bytes(target.read_bytes())})
    res = verify(run)
    assert res.returncode == 8
    assert f"{target}: absolute name refused" in res.stderr


def test_symlinked_file_refused(run: Path, tmp_path: Path) -> None:
    twin = tmp_path / "twin.txt"
    twin.write_bytes(OUT_TXT)  # same bytes: only the link check can catch it
    (run / "stages" / "a" / "out.txt").unlink()
    os.symlink(twin, run / "stages" / "a" / "out.txt")
    res = verify(run)
    assert res.returncode == 8
    assert "stages/a/out.txt: symlink refused" in res.stderr


def test_symlinked_directory_component_refused(run: Path, tmp_path: Path) -> None:
    # stages/a moved outside the run and replaced by a link: every hash still matches.
    moved = tmp_path / "elsewhere"
    (run / "stages" / "a").rename(moved)
    os.symlink(moved, run / "stages" / "a")
    assert (run / "stages" / "a" / "out.txt").read_bytes() == OUT_TXT
    res = verify(run)
    assert res.returncode == 8
    assert "stages/a/out.txt: symlinked directory component 'stages/a' refused" in res.stderr
    assert "stages/a/records.jsonl: symlinked directory component" in res.stderr


def test_receipt_naming_only_files_outside_the_run(run: Path) -> None:
    outside = run.parent / "decoy"
    outside.mkdir()
    (outside / "plan.json").write_bytes((run / "plan.json").read_bytes())
    write_receipt(run, {"../decoy/plan.json": sha256_bytes((outside / "plan.json")
                                                           .read_bytes())})
    res = verify(run)
    assert res.returncode == 8
    assert "../decoy/plan.json: '..' component refused" in res.stderr
    for rel in ("plan.json", "stages/a/out.txt", "stages/a/records.jsonl"):
        assert f"{rel}: present in the run directory but not named by the receipt" in res.stderr


def test_extra_unlisted_file_fails(run: Path) -> None:
    (run / "stages" / "a" / "planted.py").write_text("print('not in the receipt')\n")
    res = verify(run)
    assert res.returncode == 8
    assert "stages/a/planted.py: present in the run directory but not named by the receipt" \
        in res.stderr


def test_missing_listed_file_fails(run: Path) -> None:
    (run / "stages" / "a" / "records.jsonl").unlink()
    res = verify(run)
    assert res.returncode == 8
    assert "stages/a/records.jsonl: missing" in res.stderr


def test_fifo_named_in_receipt_refused_without_blocking(run: Path) -> None:
    os.mkfifo(run / "stages" / "a" / "pipe")
    files = json.loads((run / "receipt.json").read_text())["files"]
    write_receipt(run, {**files, "stages/a/pipe": sha256_bytes(b"")})
    res = verify(run)  # a blocking open would hit the subprocess timeout
    assert res.returncode == 8
    assert "stages/a/pipe: not a regular file" in res.stderr


def test_symlinked_receipt_refused(run: Path, tmp_path: Path) -> None:
    real = tmp_path / "receipt-elsewhere.json"
    (run / "receipt.json").rename(real)
    os.symlink(real, run / "receipt.json")
    res = verify(run)
    assert res.returncode == 8
    assert "receipt.json: unreadable (symlink refused" in res.stderr


def test_json_output_lists_problems(run: Path) -> None:
    (run / "stages" / "a" / "planted.txt").write_text("x")
    res = verify(run, "--json")
    assert res.returncode == 8
    doc = json.loads(res.stdout)
    assert doc["ok"] is False
    assert doc["problems"] == [
        "stages/a/planted.txt: present in the run directory but not named by the receipt"]
