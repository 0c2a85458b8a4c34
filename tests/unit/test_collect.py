"""Reading role output: links, special files and caps are refused; JSON is strict."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runner.errors import OutputRejected
from runner.isolation.collect import Limits, collect, loads_strict


def test_reads_regular_tree(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"x": 1}')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes(b"hi")
    got = collect(tmp_path)
    assert set(got.files) == {"a.json", "sub/b.txt"}
    assert got.json("a.json") == {"x": 1}
    assert got.total_bytes == 10


def test_symlink_refused_and_target_untouched(tmp_path: Path) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text("do not read")
    out = tmp_path / "out"
    out.mkdir()
    (out / "leak").symlink_to(secret)
    with pytest.raises(OutputRejected, match="symlink"):
        collect(out)
    assert secret.read_text() == "do not read"


def test_symlinked_dir_and_root_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "d").symlink_to(tmp_path)
    with pytest.raises(OutputRejected, match="symlink"):
        collect(out)
    link_root = tmp_path / "linkroot"
    link_root.symlink_to(out)
    with pytest.raises(OutputRejected, match="cannot be opened safely"):
        collect(link_root)


def test_hard_link_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("x")
    out = tmp_path / "out"
    out.mkdir()
    os.link(outside, out / "alias")
    with pytest.raises(OutputRejected, match="hard link"):
        collect(out)


def test_fifo_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(OutputRejected, match="fifo"):
        collect(tmp_path)


def test_caps(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(OutputRejected, match="file size cap"):
        collect(tmp_path, Limits(max_file_bytes=100))
    (tmp_path / "big").write_bytes(b"x" * 60)
    (tmp_path / "big2").write_bytes(b"x" * 60)
    with pytest.raises(OutputRejected, match="total size cap"):
        collect(tmp_path, Limits(max_file_bytes=100, max_total_bytes=100))
    with pytest.raises(OutputRejected, match="more than 1 files"):
        collect(tmp_path, Limits(max_files=1))


@pytest.mark.parametrize("text", ['{"a": NaN}', '{"a": Infinity}', '[-Infinity]',
                                  '{"a": 1, "a": 2}', "not json", b"\xff\xfe", '{"a": 1e400}'])
def test_strict_json(text: str | bytes) -> None:
    with pytest.raises(OutputRejected, match="invalid JSON"):
        loads_strict(text, source="f.json")
