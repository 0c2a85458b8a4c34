"""Every tar the host or a Ray node unpacks is written by directory descriptor
(:mod:`runner.untar`): ``git archive`` of the base tree (the baseline's ``src``, the
apply stage's throwaway repository, the candidate's export) and the Ray node's input
cache and output seed.

The old code used ``tarfile.extractall``, which writes by absolute path: a committed path
that fits under ``/src`` (the container mount) but not under the longer host directory
``RUN/stages/baseline/src/...`` raised a raw ``OSError [Errno 36]``. It also wrote a
hard link, a device or a second entry of the same name, took ``/name`` as ``name`` and
wrote a file through a symlink an earlier entry had made, as long as the link's target
stayed inside the destination. Each of those is now refused by name.
"""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from runner import gitops, untar
from runner.errors import ConfigError, IntegrityError, SandboxError
from runner.isolation.ray.archive import (
    ENTRY,
    digest,
    pack_input,
    pack_output,
    unpack_input,
    unpack_seed,
)
from tests.fixtures.deep import LONG_DEPTH, LONG_FILE, LONG_PART, make_long, read_at

DIRS = [f"{i:02d}" + "d" * (LONG_PART - 2) for i in range(LONG_DEPTH)]
NAME_4099 = "f" * (4099 - LONG_DEPTH * (LONG_PART + 1))
REL_4099 = "/".join([*DIRS, NAME_4099])
REL_4090 = "/".join([*DIRS, LONG_FILE])


def _git(repo: Path, *args: str, data: bytes | None = None) -> str:
    return subprocess.run(["git", *args], cwd=repo, input=data, capture_output=True,
                          check=True, env={**gitops._env(), "HOME": str(repo)}
                          ).stdout.decode().strip()


def _mktree(repo: Path, rows: list[str]) -> str:
    return _git(repo, "mktree", "-z", data="".join(f"{r}\0" for r in rows).encode())


def _repo_with(tmp: Path, leaf: str) -> tuple[Path, str]:
    """A repository whose tree holds ``DIRS/<leaf>`` ("deep\\n"), ``run.sh`` (executable)
    and ``link`` -> ``run.sh``, made with plumbing (no checkout: the path may be too long
    for any work tree); returns it and the tree id."""
    repo = tmp / "repo"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    blob = _git(repo, "hash-object", "-w", "--stdin", data=b"deep\n")
    script = _git(repo, "hash-object", "-w", "--stdin", data=b"#!/bin/sh\n")
    target = _git(repo, "hash-object", "-w", "--stdin", data=b"run.sh")
    tree = _mktree(repo, [f"100644 blob {blob}\t{leaf}"])
    for d in reversed(DIRS[1:]):
        tree = _mktree(repo, [f"040000 tree {tree}\t{d}"])
    root = _mktree(repo, [f"040000 tree {tree}\t{DIRS[0]}", f"100755 blob {script}\trun.sh",
                          f"120000 blob {target}\tlink"])
    commit = _git(repo, "commit-tree", root, "-m", "deep")
    _git(repo, "update-ref", "refs/heads/main", commit)
    return repo, root


def _long_dir(tmp: Path) -> Path:
    """A run-like destination whose absolute path is ~200 bytes longer than ``/src``."""
    return tmp / ("L" * 180) / "stages" / "baseline" / "src"


@pytest.mark.parametrize("leaf", [LONG_FILE, NAME_4099], ids=["4090", "4099"])
def test_export_tree_writes_a_long_committed_path_into_a_long_run_dir(
        tmp_path: Path, leaf: str) -> None:
    repo, tree = _repo_with(tmp_path, leaf)
    dest = _long_dir(tmp_path)
    rel = f"{'/'.join(DIRS)}/{leaf}"
    assert len(os.fsencode(str(dest / rel))) > 4096
    gitops.export_tree(repo, tree, dest)  # main: OSError [Errno 36] File name too long
    data, st = read_at(dest, rel)
    assert data == b"deep\n" and stat.S_IMODE(st.st_mode) == 0o644
    assert os.readlink(dest / "link") == "run.sh"
    assert stat.S_IMODE(os.stat(dest / "run.sh").st_mode) == 0o755
    assert sorted(os.listdir(dest)) == [DIRS[0], "link", "run.sh"]


def test_throwaway_repo_takes_a_path_that_fits_under_src(tmp_path: Path) -> None:
    """The apply stage's throwaway repository goes through the same export: a path of
    4,090 bytes fits under /src (4,095 bytes), not under the stage directory."""
    repo, tree = _repo_with(tmp_path, LONG_FILE)
    dest = tmp_path / ("L" * 180) / "apply" / "work" / "repo"
    dest.parent.mkdir(parents=True)
    gitops.throwaway_repo(repo, tree, dest)
    assert gitops.head_tree(dest) == tree


def test_unexportable_names_a_path_src_cannot_open_and_a_control_character(
        tmp_path: Path) -> None:
    """What the plan refuses up front (exit 3, project.base_ref): a path of PATH_MAX bytes
    or more once mounted at /src, or a name the export would refuse."""
    repo, tree = _repo_with(tmp_path / "a", LONG_FILE)
    assert gitops.unexportable(repo, tree, "/src") is None  # "/src/" + 4,090 < 4,096
    repo, tree = _repo_with(tmp_path / "b", NAME_4099)
    path, why = gitops.unexportable(repo, tree, "/src") or ("", "")
    assert path.endswith(NAME_4099) and "PATH_MAX" in why
    (tmp_path / "c").mkdir()
    repo = tmp_path / "c" / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    blob = _git(repo, "hash-object", "-w", "--stdin", data=b"x")
    tree = _mktree(repo, [f"100644 blob {blob}\tbad\x1bname"])
    path, why = gitops.unexportable(repo, tree, "/src") or ("", "")
    assert path == "bad\x1bname" and "control character U+001B" in why


def test_export_refuses_a_tree_holding_a_name_twice(tmp_path: Path) -> None:
    """A hand-made tree object naming ``a`` twice, a symlink to ``.`` and a directory
    with ``f``: git archive writes the link, then ``a/f``. The old extractall wrote
    ``f`` through the link into the export's root."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    f = _git(repo, "hash-object", "-w", "--stdin", data=b"planted\n")
    dot = _git(repo, "hash-object", "-w", "--stdin", data=b".")
    sub = _mktree(repo, [f"100644 blob {f}\tf"])
    raw = (b"120000 a\0" + bytes.fromhex(dot) + b"40000 a\0" + bytes.fromhex(sub))
    tree = _git(repo, "hash-object", "-t", "tree", "-w", "--literally", "--stdin", data=raw)
    dest = tmp_path / "export"
    with pytest.raises(IntegrityError, match=r"refused: a: duplicate name"):
        gitops.export_tree(repo, tree, dest)
    assert not (dest / "f").exists()


# -- Ray: the node's input cache and output seed -----------------------------------------------
def _long_cache(tmp: Path) -> Path:
    return tmp / ("N" * 180) / "inputs"


def test_ray_unpack_input_takes_a_path_past_path_max(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    rel = make_long(src)
    os.symlink("/etc/passwd", src / "abs-link")  # a link is shipped as a link
    data = pack_input(src)
    got = unpack_input(data, digest(data), _long_cache(tmp_path))  # main: Errno 36
    assert got.name == ENTRY
    assert read_at(got, rel)[0] == b"deep\n"
    assert os.readlink(got / "abs-link") == "/etc/passwd"


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti, content in members:
            if content is not None:
                ti.size = len(content)
            tf.addfile(ti, io.BytesIO(content) if content is not None else None)
    return buf.getvalue()


def _ti(name: str, kind: bytes = tarfile.REGTYPE, *, link: str = "",
        mode: int = 0o644) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.mode = kind, link, mode
    return ti


def test_ray_unpack_input_and_seed_take_a_4099_byte_name(tmp_path: Path) -> None:
    data = _tar((_ti(f"{ENTRY}/{REL_4099}"), b"deep\n"))
    got = unpack_input(data, digest(data), _long_cache(tmp_path))
    assert read_at(got, REL_4099)[0] == b"deep\n"
    out = tmp_path / ("O" * 180) / "out"
    out.mkdir(parents=True)
    unpack_seed(_tar((_ti(REL_4099), b"seed\n")), out)
    assert read_at(out, REL_4099)[0] == b"seed\n"


def test_ray_seed_round_trip_of_a_checkout_with_links(tmp_path: Path) -> None:
    head = tmp_path / "head-out"
    head.mkdir()
    rel = make_long(head)
    os.symlink("../../outside", head / "rel-link")
    (head / "tool.sh").write_text("#!/bin/sh\n")
    os.chmod(head / "tool.sh", 0o755)
    node = tmp_path / ("N" * 180) / "out"
    node.mkdir(parents=True)
    unpack_seed(pack_output(head, 1 << 20), node, 1 << 20)
    assert read_at(node, rel)[0] == b"deep\n"
    assert os.readlink(node / "rel-link") == "../../outside"
    assert stat.S_IMODE(os.stat(node / "tool.sh").st_mode) == 0o755


HOSTILE: dict[str, tuple[Callable[[], bytes], str]] = {
    "absolute": (lambda: _tar((_ti("/cbx-abs-evil"), b"x")), r"/cbx-abs-evil: absolute name"),
    "dotdot": (lambda: _tar((_ti("../cbx-evil"), b"x")), r"\.\./cbx-evil: empty, '\.' or '\.\.'"),
    "inner-dotdot": (lambda: _tar((_ti("a/../../cbx-evil"), b"x")), r"a/\.\./\.\./cbx-evil"),
    "link-then-file": (lambda: _tar((_ti("l", tarfile.SYMTYPE, link="."), None),
                                    (_ti("l/planted"), b"x")),
                       r"l/planted: parent l is not a directory"),
    "link-out-then-file": (lambda: _tar((_ti("l", tarfile.SYMTYPE, link="/tmp"), None),
                                        (_ti("l/cbx-planted"), b"x")),
                           r"l/cbx-planted: parent l is not a directory"),
    "link-then-dir": (lambda: _tar((_ti("l", tarfile.SYMTYPE, link="."), None),
                                   (_ti("l/d", tarfile.DIRTYPE, mode=0o755), None)),
                      r"l/d: parent l is not a directory"),
    "hardlink": (lambda: _tar((_ti("a"), b"x"), (_ti("h", tarfile.LNKTYPE, link="a"), None)),
                 r"h: hard link refused"),
    "chardev": (lambda: _tar((_ti("null", tarfile.CHRTYPE), None)),
                r"null: character device refused"),
    "blockdev": (lambda: _tar((_ti("sda", tarfile.BLKTYPE), None)),
                 r"sda: block device refused"),
    "fifo": (lambda: _tar((_ti("p", tarfile.FIFOTYPE), None)), r"p: fifo refused"),
    "duplicate-file": (lambda: _tar((_ti("a"), b"one"), (_ti("a"), b"two")),
                       r"a: duplicate name refused"),
    "dir-over-file": (lambda: _tar((_ti("a"), b"one"), (_ti("a", tarfile.DIRTYPE), None)),
                      r"a: duplicate name refused"),
    "file-over-dir": (lambda: _tar((_ti("a", tarfile.DIRTYPE, mode=0o755), None),
                                   (_ti("a"), b"two")), r"a: duplicate name refused"),
    "duplicate-dir": (lambda: _tar((_ti("a", tarfile.DIRTYPE, mode=0o755), None),
                                   (_ti("a", tarfile.DIRTYPE, mode=0o700), None)),
                      r"a: duplicate name refused"),
    "control-char": (lambda: _tar((_ti("a\x1b[2Jb"), b"x")),
                     r"a\\x1b\[2Jb: control character U\+001B"),
    "c1-char": (lambda: _tar((_ti("a\x85b"), b"x")), r"a\\x85b: control character U\+0085"),
    "empty-part": (lambda: _tar((_ti("a//b"), b"x")), r"a//b: empty"),
    "part-too-long": (lambda: _tar((_ti("p" * 256), b"x")),
                      r"p{256}: a path part is longer than 255 bytes"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_ray_unpack_seed_refuses_a_hostile_tar_by_name(tmp_path: Path, case: str) -> None:
    make, match = HOSTILE[case]
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(SandboxError, match=r"output seed refused on this node: " + match):
        unpack_seed(make(), out)
    assert not os.path.lexists(out / "planted") and not os.path.lexists(tmp_path / "cbx-evil")
    assert not os.path.lexists("/cbx-abs-evil") and not os.path.lexists("/tmp/cbx-planted")


@pytest.mark.parametrize("case", ["absolute", "dotdot", "link-then-file", "hardlink", "chardev",
                                  "duplicate-file", "control-char"])
def test_ray_unpack_input_refuses_a_hostile_tar_by_name(tmp_path: Path, case: str) -> None:
    make, match = HOSTILE[case]
    data = make()
    cache = tmp_path / "cache"
    with pytest.raises(SandboxError, match=r"input archive [0-9a-f]{12} refused on this node: "
                       + match):
        unpack_input(data, digest(data), cache)
    assert os.listdir(cache) == []  # the half-unpacked copy is gone, nothing is cached
    assert not os.path.lexists(tmp_path / "cbx-evil")


def test_unpack_seed_refuses_past_its_bounds(tmp_path: Path) -> None:
    big = _tar((_ti("a"), b"x" * 1000), (_ti("b"), b"y" * 1000))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(SandboxError, match=r"b: file bytes past the bound of 1500"):
        unpack_seed(big, out, 1500)
    assert not os.path.lexists(out / "b")  # refused before a byte of it was written
    deep = tmp_path / "deep"
    deep.mkdir()
    with pytest.raises(SandboxError, match="nested deeper than 4097 levels"):
        unpack_seed(_tar((_ti("/".join(["d"] * 4098)), b"x")), deep)


def test_extract_bounds_entries_and_metadata(tmp_path: Path) -> None:
    lim = untar.Limits(max_entries=3, max_bytes=1 << 20, max_depth=8)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(untar.UntarError, match=r"more than 3 entries") as info:
            untar.extract(io.BytesIO(_tar(*[(_ti(f"f{i}"), b"") for i in range(4)])), fd, lim)
        assert info.value.limit
        (tmp_path / "d").mkdir()
        dfd = os.open(tmp_path / "d", os.O_RDONLY | os.O_DIRECTORY)
        try:  # a parent made for an entry counts as an entry
            with pytest.raises(untar.UntarError, match=r"more than 3 entries"):
                untar.extract(io.BytesIO(_tar((_ti("a/b/c/f"), b""))), dfd, lim)
        finally:
            os.close(dfd)
        ti = _ti("x")
        ti.pax_headers = {"comment": "c" * (untar.MAX_META_BYTES + 10)}
        (tmp_path / "m").mkdir()
        mfd = os.open(tmp_path / "m", os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(untar.UntarError, match=r"metadata record of \d+ bytes"):
                untar.extract(io.BytesIO(_tar((ti, b""))), mfd, lim)
        finally:
            os.close(mfd)
        with pytest.raises(untar.UntarError, match=r"not a readable tar"):
            untar.extract(io.BytesIO(b"\x01" * 1024), fd, lim)
    finally:
        os.close(fd)


def test_extract_modes_without_high_bits_and_late_for_closed_directories(
        tmp_path: Path) -> None:
    data = _tar((_ti("ro", tarfile.DIRTYPE, mode=0o555), None), (_ti("ro/f", mode=0o4777), b"x"),
                (_ti("w", tarfile.DIRTYPE, mode=0o2777), None))
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = untar.extract(io.BytesIO(data), fd,
                            untar.Limits(max_entries=10, max_bytes=10, max_depth=4))
    finally:
        os.close(fd)
    assert (got.files, got.dirs, got.bytes) == (1, 2, 1)
    assert stat.S_IMODE(os.stat(tmp_path / "ro").st_mode) == 0o555
    assert stat.S_IMODE(os.stat(tmp_path / "ro/f").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(tmp_path / "w").st_mode) == 0o755
    os.chmod(tmp_path / "ro", 0o755)  # so pytest can remove it


def test_entries_below_the_cached_levels_land_in_their_own_directories(
        tmp_path: Path) -> None:
    """Past ``_CACHED_LEVELS`` the last deep parent is kept for the entries after it
    (files deep down cost one walk each directory, not one each, so depth x files is
    no longer quadratic): entries that go back and forth between two deep directories,
    and one deep directory refused as a file, still land where their names say."""
    deep = ["d"] * (untar._CACHED_LEVELS + 5)
    a, b = "/".join([*deep, "a"]), "/".join([*deep, "b"])
    rows = [(_ti(f"{a}/f{i}"), b"a") for i in range(3)] + [(_ti(f"{b}/g"), b"b"),
                                                          (_ti(f"{a}/f3"), b"A"),
                                                          (_ti(f"{b}/h"), b"B")]
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = untar.extract(io.BytesIO(_tar(*rows)), fd,
                            untar.Limits(max_entries=1000, max_bytes=100, max_depth=200))
        assert (got.files, got.dirs) == (6, len(deep) + 2)
        deep_fd = os.open(tmp_path / "/".join(deep), os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert sorted(os.listdir(deep_fd)) == ["a", "b"]
        finally:
            os.close(deep_fd)
        (tmp_path / "x").mkdir()
        xfd = os.open(tmp_path / "x", os.O_RDONLY | os.O_DIRECTORY)
        try:  # a deep directory made a file by an earlier entry is refused, not entered
            bad = [(_ti(f"{a}/f"), b"1"), (_ti(f"{a}/f/g"), b"2")]
            with pytest.raises(untar.UntarError, match="is not a directory"):
                untar.extract(io.BytesIO(_tar(*bad)), xfd,
                              untar.Limits(max_entries=1000, max_bytes=100, max_depth=200))
        finally:
            os.close(xfd)
    finally:
        os.close(fd)
    where = tmp_path / "/".join(deep)
    assert {p.name: p.read_bytes() for p in (where / "a").iterdir()} == {
        "f0": b"a", "f1": b"a", "f2": b"a", "f3": b"A"}
    assert {p.name: p.read_bytes() for p in (where / "b").iterdir()} == {"g": b"b", "h": b"B"}


def test_pack_input_refuses_a_name_the_node_would_refuse(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "bad\nname").write_text("x")
    with pytest.raises(ConfigError, match=r"bad\\nname: control character U\+000A"):
        pack_input(src)


@pytest.fixture(autouse=True)
def _no_strays() -> Iterator[None]:
    yield
    for p in ("/cbx-abs-evil", "/tmp/cbx-planted"):
        if os.path.lexists(p):
            os.unlink(p)



@pytest.mark.docker
def test_cycle_with_a_committed_path_that_fits_under_src_runs_and_verifies(
        tmp_path: Path) -> None:
    """The agent's tree holds a 4,084-byte path: it fits under /src and under the apply
    container's /work/repo (4,095 bytes), not under ``RUN/stages/baseline/src``. main: the
    baseline export raised ``OSError [Errno 36]`` (exit 10, no receipt). (4,085 to 4,090
    bytes still fit /src but not /work/repo, where the in-container seed writes by path.)"""
    from tests.fixtures.cycle_project import cli_env, example_agent, project_with_agent, run_cli

    cycle = project_with_agent(tmp_path / "cyc", example_agent())
    repo = tmp_path / "cyc" / "repo"
    blob = _git(repo, "hash-object", "-w", "--stdin", data=b"deep\n")
    leaf = "f" * (4084 - LONG_DEPTH * (LONG_PART + 1))
    tree = _mktree(repo, [f"100644 blob {blob}\t{leaf}"])
    for d in reversed(DIRS[1:]):
        tree = _mktree(repo, [f"040000 tree {tree}\t{d}"])
    top = [r for r in _git(repo, "ls-tree", "-z", "HEAD").split("\0") if r]
    root = _mktree(repo, [*top, f"040000 tree {tree}\t{DIRS[0]}"])
    commit = _git(repo, "commit-tree", root, "-p", "HEAD", "-m", "deep")
    _git(repo, "update-ref", "HEAD", commit)
    out = tmp_path / ("R" * 60) / "run"
    out.parent.mkdir()
    env = cli_env(tmp_path)
    res = run_cli("cycle", "run", str(cycle), "--out", str(out), env=env, timeout=900)
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert (out / "receipt.json").is_file(), (res.returncode, res.stderr[-3000:])
    assert res.returncode in (0, 1), res.stderr[-3000:]
    rel = "/".join([*DIRS, leaf])
    assert len(rel) == 4084
    assert read_at(out / "stages" / "baseline" / "src", rel)[0] == b"deep\n"
    ver = run_cli("receipt", "verify", str(out), env=env)
    assert ver.returncode == 0, ver.stdout + ver.stderr


_ITN: Any = getattr(tarfile, "itn")  # noqa: B009 - untyped in the stubs


def _raw_header(name: str, kind: bytes, size: int) -> bytes:
    """A ustar header block written by hand (tarfile would not write a negative size)."""
    b = bytearray(512)
    b[0:len(name)] = name.encode()
    b[100:108] = _ITN(0o644, 8)
    b[108:116] = _ITN(0, 8)
    b[116:124] = _ITN(0, 8)
    b[124:136] = (bytes([0o377]) + (256 ** 11 + size).to_bytes(11, "big") if size < 0
                  else _ITN(size, 12, tarfile.GNU_FORMAT))
    b[136:148] = _ITN(0, 12)
    b[156:157] = kind
    b[257:265] = b"ustar\x0000"
    b[148:156] = b" " * 8
    b[148:156] = b"%06o\x00 " % sum(b)
    return bytes(b)


def _padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 512)


def _pax(key: str, value: str) -> bytes:
    body = f" {key}={value}\n".encode()
    n = len(body) + len(str(len(body)))
    n = len(body) + len(str(n))
    return str(n).encode() + body


def _refused(dest: Path, data: bytes, match: str) -> None:
    """``data`` extracted into ``dest`` is refused (UntarError matching ``match``), and
    nothing is written."""
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(untar.UntarError, match=match):
            untar.extract(io.BytesIO(data), fd, untar.Limits(100, 1 << 20, 8))
    finally:
        os.close(fd)
    assert list(dest.iterdir()) == []


_END = b"\0" * 1024
_FILE = _raw_header("a", tarfile.REGTYPE, 2) + _padded(b"hi")


@pytest.mark.parametrize(("case", "data", "why"), [
    ("negative-size", _raw_header("neg", b"x", -(2 ** 80)) + _FILE + _END, "negative size"),
    ("global-header", _raw_header("g", tarfile.XGLTYPE, len(_pax("k", "v")))
     + _padded(_pax("k", "v")) + _FILE + _END, "global header refused"),
    ("gnu-sparse", _raw_header("s", tarfile.GNUTYPE_SPARSE, 0) + _END, "a tar sparse file"),
    ("pax-sparse-size", _raw_header("p", tarfile.XHDTYPE, len(_pax("GNU.sparse.size", "zz")))
     + _padded(_pax("GNU.sparse.size", "zz")) + _FILE + _END, "PAX sparse file"),
    ("pax-sparse-map", _raw_header("p", tarfile.XHDTYPE, len(_pax("GNU.sparse.map", "a,b")))
     + _padded(_pax("GNU.sparse.map", "a,b")) + _FILE + _END, "PAX sparse file"),
])
def test_headers_that_cost_without_bound_are_refused_before_tarfile_reads_on(
        tmp_path: Path, case: str, data: bytes, why: str) -> None:
    """A review of the metadata bounds: a negative size subtracted from the archive's
    metadata total (160 MB read against 64 MB), global PAX headers are applied to every
    later member (0.7 s each, 800 MB), old GNU sparse extension blocks were all read
    before the sparse member was refused (1.1 GB from an 893 KB gzip), and PAX sparse
    keys raised ValueError (exit 10). Each is refused by name before any of that."""
    _refused(tmp_path, data, why)


@pytest.mark.parametrize(("case", "record"), [
    ("hdrcharset-digits", b"9" * 20_000),  # 3.11.7's hdrcharset search: quadratic time
    ("keyword-to-a-far-equals", b"3 a" * 7_000 + b"=\n"),  # its keyword regex: memory
])
def test_a_pax_record_is_parsed_in_one_linear_pass(tmp_path: Path, case: str,
                                                   record: bytes) -> None:
    """CVE-2024-6232 in this Python's tarfile: one PAX record under the 4 MB cap took
    time or memory growing with its square (a 4 KB .tgz ran for hours; a 372-byte one
    ended in MemoryError). untar parses the records itself: a malformed one is refused
    at once, an honest one (tested across this file) reads as before."""
    data = (_raw_header("p", tarfile.XHDTYPE, len(record)) + _padded(record) + _FILE + _END)
    _refused(tmp_path, data, "invalid PAX record")


def test_a_negative_pax_size_is_refused(tmp_path: Path) -> None:
    rec = _pax("size", "-600")
    data = _raw_header("p", tarfile.XHDTYPE, len(rec)) + _padded(rec) + _FILE + _END
    _refused(tmp_path, data, "PAX size of -600")


def test_honest_pax_records_still_read(tmp_path: Path) -> None:
    """Long names, a path with '=' and spaces, a mtime and a uname through PAX."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("d/" + "x" * 150, "a b=c/é.txt"):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.uname = 2, 1_700_000_000.5, "ü" * 40
            tar.addfile(info, io.BytesIO(b"ok"))
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = untar.extract(io.BytesIO(out.getvalue()), fd, untar.Limits(100, 1 << 20, 8))
    finally:
        os.close(fd)
    assert got.files == 2
    assert (tmp_path / "d" / ("x" * 150)).read_bytes() == b"ok"
    assert (tmp_path / "a b=c" / "é.txt").read_bytes() == b"ok"
