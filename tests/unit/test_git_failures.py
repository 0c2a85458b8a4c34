"""Issue 20 item 6: a transient ``git archive … failed:`` with an empty message.

Cause: :func:`runner.gitops.export_tree` streamed ``git archive`` into ``tarfile`` and
closed the pipe as soon as tarfile reached the end-of-archive marker. git writes its tar
in 10 KiB blocks; when fewer than two 512-byte records are left in the last block, its
``write_trailer()`` writes one more whole block in a second ``write()``. tarfile stops
at the first zero record, which lies in the earlier block; if the reader closed the pipe
before git's second write, git died of SIGPIPE: a negative exit status, nothing on
stderr, although the archive had been extracted whole. A race (git usually wins it), so
it was seen once in a loaded cycle. The fake ``git`` below makes it certain by waiting
before that last block."""

from __future__ import annotations

import io
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from runner import gitops
from runner.errors import ConfigError

SLOW_LAST_BLOCK = r'''
import os, signal, subprocess, sys, time
signal.signal(signal.SIGPIPE, signal.SIG_DFL)   # as git: a write to a closed pipe kills
real = {real!r}
args = sys.argv[1:]
if "archive" not in args:
    os.execv(real, [real, *args])
data = subprocess.run([real, *args], capture_output=True, check=True).stdout
out = sys.stdout.buffer
out.write(data[:{cut}]); out.flush()
time.sleep(0.5)                                   # the reader has stopped reading by now
out.write(data[{cut}:]); out.flush()
'''
BLOCK = 10240
"""git's tar output block (archive-tar.c BLOCKSIZE)."""


def _split_point(data: bytes) -> int | None:
    """Where git writes the end marker's second block separately, if it does."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
    end = max(m.offset_data + -(-m.size // 512) * 512 for m in members)
    tail = BLOCK - end % BLOCK
    return end + tail if 512 <= tail < 1024 and end + tail < len(data) else None


def _repo(root: Path, size: int = 3000) -> Path:
    repo = root / "repo"
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir()
    (repo / "a.txt").write_text("hello\n")
    (repo / "b.bin").write_bytes(os.urandom(size))
    gitops.init_fixed(repo, "base")
    return repo


def test_export_reads_git_archive_to_its_end(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cut = None
    for size in range(7000, 20000, 97):  # b.bin sized for the racy layout
        repo = _repo(tmp_path, size)
        tree = gitops.head_tree(repo)
        data = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", tree],
                              capture_output=True, check=True).stdout
        cut = _split_point(data)
        if cut is not None:
            break
    assert cut is not None
    real = shutil.which("git")
    assert real is not None
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "git"
    fake.write_text(f"#!{sys.executable}\n" + SLOW_LAST_BLOCK.format(real=real, cut=cut))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    gitops.close_readers()
    # main: ConfigError "git archive <tree> failed: " (SIGPIPE, empty stderr)
    gitops.export_tree(repo, tree, tmp_path / "out")
    assert (tmp_path / "out" / "a.txt").read_text() == "hello\n"


def test_every_git_failure_names_its_status_and_stderr(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    with pytest.raises(ConfigError) as caught:
        gitops.diff(repo, "no-such-rev", "HEAD")
    text = str(caught.value)
    assert "git diff --binary --no-color failed (exit 128)" in text, text
    assert "no-such-rev" in text, text
    quiet = gitops.git_failure("archive 0123", -signal.SIGPIPE, b"")
    assert quiet == ("git archive 0123 failed (killed by SIGPIPE): "
                     "(git printed nothing on stderr)")
    hostile = gitops.git_failure("x", 1, b"fatal: \x1b]0;title\x07" + b"y" * 10_000)
    assert "\x1b" not in hostile and "\x07" not in hostile
    assert len(hostile) < gitops.MAX_GIT_STDERR + 100
