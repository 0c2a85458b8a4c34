"""Output caps enforced by the kernel and a hostile-stream extractor, not by polling.

Container tests (real engine): fast writers, many-file writers, deep-path and sparse
writers against a 1 MiB output tmpfs. Each fails if the host ever holds more than
the cap or the run ends ``ok`` although the writer hit it. Each prints one JSON
line of figures (host bytes, stop reason, wall time) for the report (``-s``).

Stream tests (no engine): forged tar streams fed straight to the extractor, each
failing if a link, device, traversal, oversize or endless stream gets through.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.isolation.copyout import CopyLimits, CopyRefused, extract, limits_for
from runner.isolation.sandbox import RunRecord, StopReason
from sandbox.holder import READY
from tests.conftest import RunFn

CAP = 1 << 20
ENTRIES = 1000


def _host_usage(root: Path) -> tuple[int, int, int]:
    """(file bytes, allocated bytes, entries) under root, never following links."""
    size = blocks = entries = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, n))
            entries += 1
            if not stat.S_ISDIR(st.st_mode):
                size += st.st_size
                blocks += st.st_blocks * 512
    return size, blocks, entries


def _run_writer(run_role: RunFn, script: str, name: str, **kw: object) -> tuple[RunRecord, int]:
    rec = run_role(["sh", "-c", script], output_cap=CAP, timeout_s=kw.pop("timeout_s", 60),
                   **kw)
    out = rec.__dict__["output_dir"]
    size, blocks, entries = _host_usage(out)
    print(json.dumps({"attack": name, "host_bytes": size, "host_allocated": blocks,
                      "host_entries": entries, "stop_reason": rec.stop_reason.value,
                      "detail": rec.detail, "wall_s": rec.wall_s}))
    assert size <= CAP, f"{name}: {size} bytes on the host, cap {CAP}"
    assert blocks <= CAP + 64 * 4096, f"{name}: {blocks} bytes allocated on the host"
    assert rec.cleanup_confirmed
    return rec, entries


@pytest.mark.docker
def test_fallocate_10g_never_reaches_host(run_role: RunFn) -> None:
    # file_size raised so that the tmpfs, not RLIMIT_FSIZE, refuses the reservation
    rec, _ = _run_writer(run_role, "fallocate -l 10G /out/big", "fallocate",
                         file_size="16g")
    assert "No space left on device" in rec.stderr_tail, rec
    assert rec.stop_reason is StopReason.PROCESS_FAILED, rec


@pytest.mark.docker
def test_fallocate_10g_hits_file_size_limit(run_role: RunFn) -> None:
    rec, _ = _run_writer(run_role, "fallocate -l 10G /out/big", "fallocate (fsize)")
    assert rec.stop_reason is StopReason.PROCESS_FAILED, rec
    assert rec.exit_code == 128 + 25  # SIGXFSZ


@pytest.mark.docker
def test_fallocate_then_fill_ends_output_limit(run_role: RunFn) -> None:
    rec, _ = _run_writer(run_role, "fallocate -l 10G /out/big; "
                         "head -c 100000000 /dev/zero > /out/fill; exit 0", "fallocate+fill")
    assert rec.stop_reason is StopReason.OUTPUT_LIMIT, rec
    assert "output tmpfs full" in rec.detail


@pytest.mark.docker
def test_parallel_dd_writers(run_role: RunFn) -> None:
    rec, _ = _run_writer(run_role, "for i in 1 2 3 4; do dd if=/dev/zero of=/out/d$i bs=1M "
                         "count=256 2>/dev/null & done; wait; exit 0", "4x dd")
    assert rec.stop_reason is StopReason.OUTPUT_LIMIT, rec


@pytest.mark.docker
def test_200k_empty_files(run_role: RunFn) -> None:
    rec, entries = _run_writer(
        run_role, "python3 -c \"\nimport os\nn=0\ntry:\n    for i in range(200000):\n"
        "        os.close(os.open(f'/out/f{i}', os.O_CREAT|os.O_WRONLY)); n+=1\n"
        "except OSError as e: print('stopped', n, e.strerror)\n\"", "200k files")
    assert rec.stop_reason is StopReason.OUTPUT_LIMIT, rec
    assert "stopped" in rec.stdout_tail and "No space left" in rec.stdout_tail
    assert entries <= 10_000  # the tmpfs inode cap (output_max_entries)


@pytest.mark.docker
def test_path_longer_than_path_max(run_role: RunFn) -> None:
    # 30 levels of 200-byte names: 6 KB paths, past PATH_MAX (4096), written via chdir
    rec, _ = _run_writer(
        run_role, "python3 -c \"\nimport os\nos.chdir('/out')\nfor i in range(30):\n"
        "    os.mkdir('d'*200); os.chdir('d'*200)\n"
        "open('deep', 'wb').write(b'x'*(1<<19))\n\"", "deep path")
    assert rec.stop_reason is StopReason.OUTPUT_LIMIT, rec
    assert "longer than 4096" in rec.detail


@pytest.mark.docker
@pytest.mark.parametrize("char", ["\u0085", "\u009b", "\u0080", "\u009f"])
def test_c1_control_character_name_never_reaches_host(run_role: RunFn, char: str) -> None:
    """A file name holding a C1 control character (U+0080-U+009F; U+009B is CSI on
    terminals that honour 8-bit controls) is refused by copy-out with a named reason
    and never lands on the host."""
    script = ("import os; os.makedirs('/out/sub', exist_ok=True); "
              f"open('/out/sub/x' + chr({ord(char)}) + 'y', 'w').write('z')")
    rec, _ = _run_writer(run_role, f"python3 -c \"{script}\"", "c1 name")
    assert rec.stop_reason is not StopReason.OK, rec
    assert f"control character U+{ord(char):04X}" in rec.detail, rec.detail
    out = rec.__dict__["output_dir"]
    landed = [n for _, ds, fs in os.walk(out) for n in ds + fs]
    assert not any(0x80 <= ord(c) < 0xA0 for n in landed for c in n), landed


@pytest.mark.docker
def test_sparse_file_bigger_than_cap(run_role: RunFn) -> None:
    # 200 MB apparent size in no pages: the tmpfs holds it; the copy refuses it unwritten
    rec, _ = _run_writer(run_role, "truncate -s 200M /out/sparse", "sparse 200M")
    assert rec.stop_reason is StopReason.OUTPUT_LIMIT, rec
    assert "output cap" in rec.detail


@pytest.mark.docker
def test_sparse_file_of_9g_not_streamed(run_role: RunFn) -> None:
    # past an octal size field (8 GiB): once a 513-byte header and gigabytes of zeros
    rec, _ = _run_writer(run_role, "echo hi > /out/a; truncate -s 9G /out/sparse",
                         "sparse 9G", file_size="16g")
    assert rec.stop_reason is StopReason.OUTPUT_LIMIT, rec
    assert "output cap" in rec.detail and rec.wall_s < 30, rec


@pytest.mark.docker
def test_writes_within_cap_arrive_intact(run_role: RunFn) -> None:
    rec, entries = _run_writer(run_role, "mkdir -p /out/a/b && printf hello > /out/a/b/x && "
                               "head -c 500000 /dev/urandom > /out/r", "ok writer")
    assert rec.stop_reason is StopReason.OK, rec
    out = rec.__dict__["output_dir"]
    assert (out / "a" / "b" / "x").read_bytes() == b"hello"
    assert (out / "r").stat().st_size == 500000
    assert entries == 4


@pytest.mark.docker
def test_background_writer_stopped_before_copy(run_role: RunFn) -> None:
    # the role command exits at once; a child it left keeps writing: it is killed first
    rec, _ = _run_writer(run_role, "(sleep 0.5; while :; do echo x >> /out/late; done) "
                         ">/dev/null 2>&1 </dev/null & echo started", "background writer")
    assert rec.stop_reason is StopReason.OK, rec
    assert rec.wall_s < 30


@pytest.mark.docker
def test_oom_by_exec_is_oom(run_role: RunFn) -> None:
    # the role command is not PID 1: the engine's OOMKilled flag does not see it; the
    # kernel's oom_kill counter of the container's memory cgroup does
    rec = run_role(["python", "-c", "x=[]\nwhile True: x.append(bytearray(16<<20))"],
                   memory="128m")
    assert rec.stop_reason is StopReason.OOM, rec
    assert rec.exit_code == 137


# -- forged streams --------------------------------------------------------------------
LIM = CopyLimits(max_bytes=CAP, max_entries=ENTRIES)


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", mode: int = 0o644,
            link: str = "") -> tuple[tarfile.TarInfo, bytes | None]:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.linkname = kind, mode, link
    if kind == tarfile.REGTYPE:
        ti.size = len(data)
        return ti, data
    return ti, None


def _chunks(data: bytes, n: int = 4096) -> Iterator[bytes]:
    for i in range(0, len(data), n):
        yield data[i:i + n]


def test_stream_regular_files_and_dirs(tmp_path: Path) -> None:
    got = extract(_chunks(_tar(_member("d/", tarfile.DIRTYPE, mode=0o7777),
                               _member("d/f", data=b"abc", mode=0o6777))), tmp_path, LIM)
    assert (got.files, got.dirs, got.bytes) == (1, 1, 3)
    assert (tmp_path / "d" / "f").read_bytes() == b"abc"
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "d" / "f").stat().st_mode) == 0o644


@pytest.mark.parametrize(("member", "why"), [
    (_member("evil", tarfile.SYMTYPE, link="/etc/passwd"), "symlink refused"),
    (_member("hl", tarfile.LNKTYPE, link="/etc/shadow"), "hard link refused"),
    (_member("dev", tarfile.CHRTYPE), "character device refused"),
    (_member("blk", tarfile.BLKTYPE), "block device refused"),
    (_member("fifo", tarfile.FIFOTYPE), "fifo refused"),
    (_member("../escape", data=b"x"), "'..' path part refused"),
    (_member("a/../../escape", data=b"x"), "'..' path part refused"),
    (_member("/abs", data=b"x"), "absolute name refused"),
    (_member("ctl\x1b[31m", data=b"x"), "control character"),
    (_member("c1\u0085name", data=b"x"), "control character U+0085"),
    (_member("d/c1\u009b31m", data=b"x"), "control character U+009B"),
    (_member("x" * 300, data=b"x"), "longer than 255"),
    (_member("/".join(["d"] * 40), data=b"x"), "deeper than 32"),
    (_member("big", data=b"x" * (CAP + 1)), "output cap"),
])
def test_stream_refusals(tmp_path: Path, member: tuple[tarfile.TarInfo, bytes | None],
                         why: str) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(CopyRefused, match=re.escape(why)):
        extract(_chunks(_tar(_member("ok", data=b"fine"), member)), dest, LIM)
    assert sorted(p.name for p in dest.iterdir()) == ["ok"]
    assert not (tmp_path / "escape").exists()


@pytest.mark.parametrize("name", [".git/config", "sub/.git/hooks/pre-commit", ".git",
                                  ".GIT/config", ".Git./HEAD", "repo/.git /config",
                                  "out/.git", ".g\u200cit/config", ".git\ufeff/config",
                                  "GIT~1/config", ".git::$INDEX_ALLOCATION/config",
                                  "x\\.git"])
@pytest.mark.parametrize("role", ["analyst", "apply"])
def test_stream_a_git_directory_is_never_written_to_the_host(tmp_path: Path, name: str,
                                                             role: str) -> None:
    """A repository a container wrote, kept in the operator's run directory, would run
    its ``core.fsmonitor`` at the first ``git status`` there (a shell prompt, an editor):
    a ``.git`` path part is refused in every spelling a filesystem takes for it, but for
    the apply container's own work repository (``repo/.git``), read and not written."""
    dest = tmp_path / "dest"
    dest.mkdir()
    lim = limits_for(role, max_bytes=CAP, max_entries=ENTRIES)
    with pytest.raises(CopyRefused, match=r"path part refused \(a git repository"):
        extract(_chunks(_tar(_member("ok", data=b"fine"),
                             _member(name, data=b"[core]\n\tfsmonitor = id\n"))), dest, lim)
    assert sorted(p.name for p in dest.iterdir()) == ["ok"]


@pytest.mark.parametrize("layout", [
    ["notes/HEAD", "notes/objects/", "notes/refs/", "notes/config"],
    ["HEAD", "config", "objects/ab/cd", "refs/heads/main"],  # at the root, parents implied
    ["d/Refs/x", "d/OBJECTS/", "d/head"],
    ["d/HEAD", "d/objects/", "d/refs./"],  # "refs." is "refs" on Windows (libgit2)
    ["d./HEAD", "D/objects/", "d/re\u200cfs/"],
])
def test_stream_a_bare_repository_layout_is_refused(tmp_path: Path, layout: list[str]) -> None:
    """No part named .git, yet git takes a directory holding HEAD, objects and refs for a
    (bare) repository and obeys its config: a reviewer's ``notes/`` ran its
    ``core.pager`` at ``git branch`` there as the operator."""
    members = [_member(n, tarfile.DIRTYPE) if n.endswith("/") else
               _member(n, data=b"[core]\n\tpager = id\n") for n in layout]
    with pytest.raises(CopyRefused, match="holds HEAD, objects and refs"):
        extract(_chunks(_tar(*members)), tmp_path, LIM)


def test_stream_names_that_only_look_like_a_repository_pass(tmp_path: Path) -> None:
    got = extract(_chunks(_tar(_member("a/HEAD", data=b"x"), _member("b/objects/o", data=b"x"),
                               _member("a/refs/r", data=b"x"), _member(".gitmodules"),
                               _member("git", data=b"x"), _member("a.git/f"))), tmp_path, LIM)
    assert got.files == 6


@pytest.mark.parametrize(("name", "tool"), [
    (".hg/hgrc", "Mercurial"), ("out/.HG./hgrc", "Mercurial"), ("HG~1/hgrc", "Mercurial"),
    (".h\u200cg/hgrc", "Mercurial"), (".sl/config", "Sapling"),
    (".jj/repo/config.toml", "jj"), (".bzr/branch/branch.conf", "Bazaar")])
def test_stream_another_version_control_repository_is_refused(tmp_path: Path, name: str,
                                                              tool: str) -> None:
    """helper-38: ``.hg/requires`` and ``.hg/hgrc`` (a ``pre-status`` hook) in an output
    made a Mercurial repository whose hook ran as the operator at ``hg status`` below
    it (an hgrc the user owns is trusted, and copied-out files are the operator's)."""
    with pytest.raises(CopyRefused, match=f"path part refused \\(a {tool} repository"):
        extract(_chunks(_tar(_member("ok", data=b"fine"),
                             _member(name, data=b"[hooks]\npre-status = id\n"))),
                tmp_path, LIM)
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["ok"]


COMMONDIR_LAYOUT = [  # helper-36: HEAD and commondir here, objects, refs and config in y/
    ("HEAD", b"ref: refs/heads/main\n"), ("commondir", b"y\n"), ("y/objects/", None),
    ("y/refs/heads/", None), ("y/config", b"[core]\n\tpager = id\n"),
    ("answers/a.json", b"{}")]


def _layout(members: list[tuple[str, bytes | None]]) -> bytes:
    return _tar(*(_member(n, tarfile.DIRTYPE) if data is None else _member(n, data=data)
                  for n, data in members))


def test_stream_a_repository_split_across_directories_is_refused(tmp_path: Path) -> None:
    """No directory held HEAD, objects and refs, yet git took the output for a bare
    repository: its HEAD here, a ``commondir`` naming ``y``, where objects, refs and the
    config were (its pager ran at ``git branch`` below the output, as the operator). Real
    git says the layout is a repository; the copy-out refuses it."""
    import subprocess

    laid = tmp_path / "laid"
    for name, data in COMMONDIR_LAYOUT:
        (laid / name).parent.mkdir(parents=True, exist_ok=True)
        if data is None:
            (laid / name).mkdir(parents=True, exist_ok=True)
        else:
            (laid / name).write_bytes(data)
    git = subprocess.run(["git", "rev-parse", "--git-dir"], cwd=laid / "answers",
                         capture_output=True, text=True, check=False,
                         env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)})
    assert git.returncode == 0 and Path(git.stdout.strip()) == laid, git  # the threat
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(CopyRefused, match=r"HEAD git would take|points git"):
        extract(_chunks(_layout(COMMONDIR_LAYOUT)), dest, LIM)
    without = [m for m in COMMONDIR_LAYOUT if m[0] != "commondir"]  # the HEAD alone
    (tmp_path / "dest2").mkdir()
    with pytest.raises(CopyRefused, match="a HEAD git would take for a repository"):
        extract(_chunks(_layout(without)), tmp_path / "dest2", LIM)


@pytest.mark.parametrize("name", ["HEAD", "sub/HEAD", "head", "HEAD.", "HE\u200cAD",
                                  "HEAD::$DATA"])
@pytest.mark.parametrize("data", [b"ref: refs/heads/main\n", b"ref:refs/x", b"a" * 40,
                                  b"0123456789ABCDEF" * 4 + b"\n"])
def test_stream_a_head_git_takes_for_one_is_refused(tmp_path: Path, name: str,
                                                    data: bytes) -> None:
    """git takes a directory for a repository only beside a valid HEAD (wherever its
    objects and refs are): such a HEAD is refused under any spelling of its name, even
    when the stream hands its bytes over a few at a time; nothing of it is left."""
    with pytest.raises(CopyRefused, match="a HEAD git would take for a repository"):
        extract(_chunks(_tar(_member("ok", data=b"fine"), _member(name, data=data)), 3),
                tmp_path, LIM)
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["ok"]


@pytest.mark.parametrize("name", ["commondir", "x/CommonDir", "gitdir ", "commondir::$DATA"])
def test_stream_a_git_pointer_file_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(CopyRefused, match="points git at another directory"):
        extract(_chunks(_tar(_member(name, data=b"../y\n"))), tmp_path, LIM)


def test_stream_heads_that_git_would_not_take_pass(tmp_path: Path) -> None:
    got = extract(_chunks(_tar(_member("HEAD", data=b"the top of the page\n"),
                               _member("a/HEAD", data=b"a" * 39), _member("b/HEAD"),
                               _member("c/HEADS", data=b"ref: refs/heads/main\n"),
                               _member("d/commondirs", data=b"y"))), tmp_path, LIM)
    assert got.files == 5


def test_stream_the_apply_containers_repository_is_read_not_written(tmp_path: Path) -> None:
    data = _tar(_member("repo/", tarfile.DIRTYPE), _member("repo/f.py", data=b"x = 1\n"),
                _member("repo/.git/", tarfile.DIRTYPE),
                _member("repo/.git/config", data=b"[core]\n\tfsmonitor = id\n"),
                _member("repo/.git/hooks/x", tarfile.SYMTYPE, link="/etc/passwd"),
                _member("out/result.json", data=b"{}"))
    got = extract(_chunks(data), tmp_path, limits_for("apply", max_bytes=CAP,
                                                      max_entries=ENTRIES))
    assert (got.files, got.scratch) == (2, 3)
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["f.py"]
    assert (tmp_path / "out" / "result.json").read_bytes() == b"{}"
    (tmp_path / "x").mkdir()
    with pytest.raises(CopyRefused, match="path part refused"):  # the analyst has none
        extract(_chunks(data), tmp_path / "x", limits_for("analyst", max_bytes=CAP,
                                                          max_entries=ENTRIES))


def test_stream_duplicate_name_refused(tmp_path: Path) -> None:
    with pytest.raises(CopyRefused, match="duplicate"):
        extract(_chunks(_tar(_member("a", data=b"1"), _member("a", data=b"2"))), tmp_path, LIM)
    assert (tmp_path / "a").read_bytes() == b"1"


def test_stream_entry_count_capped(tmp_path: Path) -> None:
    data = _tar(*[_member(f"f{i}") for i in range(ENTRIES + 1)])
    with pytest.raises(CopyRefused, match=f"more than {ENTRIES} entries"):
        extract(_chunks(data), tmp_path, LIM)
    assert len(list(tmp_path.iterdir())) == ENTRIES


def test_stream_bad_checksum_and_truncation(tmp_path: Path) -> None:
    data = bytearray(_tar(_member("a", data=b"x" * 1000)))
    bad = bytes(data[:100]) + b"Z" + bytes(data[101:])
    with pytest.raises(CopyRefused, match="checksum"):
        extract(_chunks(bad), tmp_path, LIM)
    # cut inside the file's data: refused and the partial file removed
    hdr_end = data.index(b"x" * 1000)
    with pytest.raises(CopyRefused, match="truncated"):
        extract(_chunks(bytes(data[:hdr_end + 10])), tmp_path, LIM)
    assert not (tmp_path / "a").exists()


def _header(name: bytes, kind: bytes, size: int) -> bytes:
    h = bytearray(512)
    h[:len(name)] = name
    h[100:108] = b"0000644\0"
    h[124:136] = b"%011o\0" % size
    h[148:156] = b" " * 8
    h[156:157] = kind
    h[257:263] = b"ustar\0"
    h[263:265] = b"00"
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def test_stream_huge_metadata_refused_unread(tmp_path: Path) -> None:
    def forged() -> Iterator[bytes]:
        yield _header(b"././@PaxHeader", b"x", 1 << 40)
        while True:  # would never end if read
            yield b"9" * 65536

    with pytest.raises(CopyRefused, match="metadata record"):
        extract(forged(), tmp_path, LIM)


def test_stream_endless_global_headers_hit_stream_cap(tmp_path: Path) -> None:
    body = b"x" * 65536  # a whole number of blocks: no padding

    def forged() -> Iterator[bytes]:
        while True:  # global headers never count as entries: only the stream cap stops it
            yield _header(b"g", b"g", len(body)) + body

    with pytest.raises(CopyRefused, match="output stream exceeds"):
        extract(forged(), tmp_path, LIM)


def test_stream_file_size_lie_refused_before_write(tmp_path: Path) -> None:
    def forged() -> Iterator[bytes]:
        yield _header(b"huge", b"0", 10 << 30)
        while True:
            yield b"\0" * 65536

    with pytest.raises(CopyRefused, match="output cap"):
        extract(forged(), tmp_path, LIM)
    assert not (tmp_path / "huge").exists()


def test_stream_only_seeded_symlinks_come_back(tmp_path: Path) -> None:
    seeded = {"repo/link": "prompts"}
    same = _tar(_member("repo/", tarfile.DIRTYPE),
                _member("repo/link", tarfile.SYMTYPE, link="prompts"))
    a = tmp_path / "a"
    a.mkdir()
    extract(_chunks(same), a, LIM, seed_links=seeded)
    assert os.readlink(a / "repo" / "link") == "prompts"
    for changed in (_member("repo/link", tarfile.SYMTYPE, link="/etc/shadow"),
                    _member("repo/other", tarfile.SYMTYPE, link="prompts")):
        b = tmp_path / f"b{changed[0].name[-4:]}"
        b.mkdir()
        with pytest.raises(CopyRefused, match="symlink refused"):
            extract(_chunks(_tar(changed)), b, LIM, seed_links=seeded)
        assert not any(p.is_symlink() for p in b.rglob("*"))


def _pax_header(records: dict[bytes, bytes]) -> bytes:
    body = b""
    for k, v in records.items():
        rec = b" " + k + b"=" + v + b"\n"
        n = len(rec) + 1
        while len(str(n)) + len(rec) != n:
            n = len(str(n)) + len(rec)
        body += str(n).encode() + rec
    return _header(b"././@PaxHeader", b"x", len(body)) + body + bytes(-len(body) % 512)


def _with_size_field(h: bytes, field: bytes) -> bytes:
    b = bytearray(h)
    b[124:136] = field
    b[148:156] = b" " * 8
    b[148:156] = b"%06o\0 " % sum(b)
    return bytes(b)


@pytest.mark.parametrize("value", [b"-1000000000000", b"-1", b"+5", b" 5", b"1_0", b"0x10"])
def test_stream_pax_size_must_be_digits(tmp_path: Path, value: bytes) -> None:
    # a negative size on a directory once rewound the stream counter: 50x the cap got in
    sent = 0

    def forged() -> Iterator[bytes]:
        nonlocal sent
        yield _pax_header({b"size": value}) + _header(b"d/", b"5", 0)
        while True:
            sent += 65536
            yield _header(b"g", b"g", 65536 - 512) + b"x" * (65536 - 512)

    with pytest.raises(CopyRefused, match="bad PAX size"):
        extract(forged(), tmp_path, LIM)
    assert sent <= LIM.stream_cap + (2 << 20)


@pytest.mark.parametrize("field", [
    bytes([0xFF]) * 12,  # base-256 with the sign bit: -1
    bytes([0xC0]) + bytes(11),
    b"-0000000001\0", b"+0000000001\0", b"0000000_001\0",
])
def test_stream_negative_or_odd_header_size_refused(tmp_path: Path, field: bytes) -> None:
    with pytest.raises(CopyRefused, match="size field"):
        extract(_chunks(_with_size_field(_header(b"d/", b"5", 0), field) + bytes(1024)),
                tmp_path, LIM)


def test_stream_cap_holds_for_big_directory_data(tmp_path: Path) -> None:
    # /tmp/rev/tar2.py: negative PAX size, then a directory claiming 300 MiB (base-256)
    base256 = bytes([0x80]) + (300 << 20).to_bytes(11, "big")
    sent = 0

    def forged() -> Iterator[bytes]:
        nonlocal sent
        yield _with_size_field(_header(b"e/", b"5", 0), base256)
        for _ in range(300):
            sent += 1 << 20
            yield bytes(1 << 20)

    with pytest.raises(CopyRefused, match="output stream exceeds"):
        extract(forged(), tmp_path, LIM)
    assert sent <= LIM.stream_cap + (2 << 20)


def test_stream_negative_read_refused() -> None:
    from runner.isolation.copyout import _Stream

    st = _Stream(iter([b"x" * 1024]), 2048)
    with pytest.raises(CopyRefused, match="negative"):
        st.read(-512, what="directory data")
    assert st.taken == 0


def test_stream_implicit_parents_count_as_entries(tmp_path: Path) -> None:
    # each file names 31 undeclared parents: they count, as they would in the tmpfs
    deep = "/".join(f"p{i}" for i in range(30))
    lim = CopyLimits(max_bytes=CAP, max_entries=100)
    data = _tar(*[_member(f"t{j}/{deep}/f") for j in range(10)])
    with pytest.raises(CopyRefused, match="more than 100 entries"):
        extract(_chunks(data), tmp_path, lim)
    _, _, entries = _host_usage(tmp_path)
    assert entries <= 100
    (tmp_path / "fresh").mkdir()
    got = extract(_chunks(_tar(_member("a/b/c/f", data=b"x"))), tmp_path / "fresh", lim)
    assert (got.files, got.dirs) == (1, 3)


# -- the holder's side of the stream (sandbox/holder.py, run in-process) ------------------
def test_holder_header_for_8gib_and_more_stays_one_block(tmp_path: Path) -> None:
    from sandbox import holder

    st = os.stat(tmp_path)
    for size in (8**11 - 1, 8**11, 9 << 30, 1 << 40):
        h = holder._header(b"f", b"0", size, st)
        assert len(h) % 512 == 0, size
        # the host parser reads the real size (refused at the cap before any data)
        with pytest.raises(CopyRefused, match=rf"\(0 \+ {size}\)"):
            extract(_chunks(h + bytes(1024)), tmp_path, LIM)


def test_holder_leaves_out_sparse_file_bigger_than_output(tmp_path: Path) -> None:
    from sandbox import holder

    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"kept")
    with (src / "huge").open("wb") as f:
        f.truncate(9 << 30)  # sparse: `truncate -s 9G /out/huge` on the tmpfs
    (src / "z").write_bytes(b"also kept")
    out = io.BytesIO()
    errors: list[str] = []
    budget = holder._Budget(CAP)
    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    holder._add_dir(out, fd, b"", errors, budget)
    out.write(bytes(1024))
    assert len(out.getvalue()) < 8 * 512, "sparse holes were streamed"
    assert "huge" in budget.over and not errors
    dest = tmp_path / "dest"
    dest.mkdir()
    got = extract(_chunks(out.getvalue()), dest, LIM)
    assert sorted(p.name for p in dest.iterdir()) == ["a", "z"]
    assert got.bytes == 13


def test_holder_limit_report_ends_output_limit(tmp_path: Path) -> None:
    from runner.isolation.docker.backend import _CopyOut
    from runner.isolation.sandbox import Resources, RunSpec

    spec = RunSpec.model_validate({
        "run_id": "r1", "role": "analyst", "image": "sha256:abc", "command": ("true",),
        "user": "10001:10001", "resources": Resources(memory_bytes=1 << 28, cpus=1, pids=9),
        "timeout_s": 5, "output_dir": tmp_path, "output_cap_bytes": CAP})
    pre = {"phase": "pre", "others_left": 0, "oom_kill": 0, "dumpable": 0,
           "df": {"bsize": 4096, "blocks": 256, "bfree": 200, "files": 100, "ffree": 90}}
    post = {"phase": "post", "errors": [], "limit": "'huge': 9663676416 bytes (sparse)"}
    stream = [(READY, None), (None, (json.dumps(pre) + "\n").encode()), (bytes(1024), None),
              (None, (json.dumps(post) + "\n").encode())]
    copy = _CopyOut(spec, {}, iter(stream))
    copy.start()
    assert copy.done.wait(10)
    fin = copy.result()
    assert fin.limit and not fin.invalid, fin
    assert "huge" in fin.detail


def test_the_hosts_full_disk_during_copy_out_is_an_environment_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An attack review: with the host's output directory on a full disk, the copy-out's
    ENOSPC was charged to the container (invalid_output, exit 7; at times named "stopped
    before its output could be copied out"), where the Ray backend ended the run as an
    environment failure. Both raise the host's error now (exit 9)."""
    import errno

    from runner.isolation.docker import channel
    from runner.isolation.docker.backend import _CopyOut

    def full(*_a: object, **_k: object) -> object:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(channel, "extract", full)
    pre = {"phase": "pre", "others_left": 0, "oom_kill": 0, "dumpable": 0}
    copy = _CopyOut(_spec(tmp_path), {}, iter([(READY, None), (bytes(1024), None)]))  # type: ignore[arg-type]
    copy.errs.add((json.dumps(pre) + "\n").encode())
    copy.start()
    assert copy.done.wait(10)
    with pytest.raises(OSError) as exc:
        copy.result()
    assert exc.value.errno == errno.ENOSPC


def _spec(tmp_path: Path) -> object:
    from runner.isolation.sandbox import Resources, RunSpec

    return RunSpec.model_validate({
        "run_id": "r1", "role": "analyst", "image": "sha256:abc", "command": ("true",),
        "user": "10001:10001", "resources": Resources(memory_bytes=1 << 28, cpus=1, pids=9),
        "timeout_s": 5, "output_dir": tmp_path, "output_cap_bytes": CAP})


def test_copyout_waits_for_the_holder_ready_marker(tmp_path: Path) -> None:
    import threading

    from runner.isolation.docker.backend import _CopyOut

    gate = threading.Event()
    tar = _tar(_member("f", data=b"x"))

    def stream() -> Iterator[tuple[bytes | None, bytes | None]]:
        yield READY[:5], None
        gate.wait(10)
        yield READY[5:] + tar[:700], None  # the marker split, the tar right behind it
        yield tar[700:], None

    copy = _CopyOut(_spec(tmp_path), {}, stream())  # type: ignore[arg-type]
    copy.start()
    assert not copy.ready.wait(0.2), "ready before the whole marker arrived"
    gate.set()
    assert copy.ready.wait(10) and copy.ready_ok
    assert copy.done.wait(10)
    assert (tmp_path / "f").read_bytes() == b"x"

    bad = _CopyOut(_spec(tmp_path / "f"), {}, iter([(b"x" * 600, None)]))  # type: ignore[arg-type]
    bad.start()
    assert bad.ready.wait(10) and not bad.ready_ok
    ended = _CopyOut(_spec(tmp_path / "f"), {}, iter([]))  # type: ignore[arg-type]
    ended.start()
    assert ended.ready.wait(10) and not ended.ready_ok


def test_holder_ready_only_once_undumpable(holder_dir: Path) -> None:
    import select
    import signal
    import subprocess

    from runner.isolation.docker.hardening import holder_argv

    uid = 65534 if os.getuid() == 0 else os.getuid()  # as a role: not root
    proc = subprocess.Popen(holder_argv("hold", "-", where=str(holder_dir)), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            user=uid if uid != os.getuid() else None,
                            group=uid if uid != os.getuid() else None)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 10)
        assert ready, "no readiness marker"
        assert os.read(proc.stdout.fileno(), len(READY)) == READY
        # non-dumpable by then: its /proc entries belong to root, not to the role's uid,
        # which so cannot open /proc/1/fd/1
        assert os.stat(f"/proc/{proc.pid}/fd").st_uid != uid
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # never SIGUSR1: finish would kill(-1)
        proc.wait(10)
