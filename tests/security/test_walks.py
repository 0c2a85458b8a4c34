"""Every walk over a run directory or an input tree works by directory descriptor and
never skips silently: output seeding (Docker and Ray), Ray input packing and its cache
signature, the apply stage's hand-over, collect and dir_usage, the report's reads, the
trainer's hand-over and adapter check.

Each tree holds a path of 4,090 bytes, 16 directories deep (inside every cap), so its
absolute form on the host is past PATH_MAX: any step that opens it by absolute path
fails with ENAMETOOLONG (the old rglob/os.walk code did, or left it out).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from runner.errors import OutputRejected, SandboxError
from runner.isolation.collect import collect, dir_usage
from runner.isolation.sandbox import Resources, RunSpec
from runner.paths import PROJECT_ROOT
from tests.fixtures.deep import LONG_FILE, make_long, read_at


def _spec(out: Path) -> RunSpec:
    return RunSpec(run_id="r1", role="apply", image="sha256:" + "0" * 64, command=("true",),
                   user="1000:1000", output_dir=out,
                   resources=Resources(memory_bytes=1 << 28, cpus=1, pids=64),
                   timeout_s=10, output_cap_bytes=1 << 20, output_max_entries=100)


def _members(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return {m.name: m for m in tf.getmembers()}


def _content(data: bytes, name: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        f = tf.extractfile(name)
        assert f is not None
        return f.read()


def _long_tree(root: Path) -> str:
    root.mkdir(parents=True)
    (root / "top.txt").write_text("top")
    os.symlink("top.txt", root / "link")
    rel = make_long(root)
    assert len(str(root / rel)) > 4096
    return rel


def test_docker_seed_tar_seeds_a_path_past_path_max(tmp_path: Path) -> None:
    from runner.isolation.docker.backend import _seed_tar

    out = tmp_path / "out"
    rel = _long_tree(out)
    links: dict[str, str] = {}
    data = _seed_tar(_spec(out), links)
    assert data is not None
    got = _members(data)
    assert rel in got and got[rel].uid == 1000 and got[rel].gid == 1000
    assert _content(data, rel) == b"deep\n"
    assert links == {"link": "top.txt"}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _seed_tar(_spec(empty), {}) is None


def test_docker_seed_tar_refuses_a_fifo_by_name(tmp_path: Path) -> None:
    from runner.isolation.docker.backend import _seed_tar

    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "pipe")
    with pytest.raises(SandboxError, match=r"pipe: not a regular file, directory or symlink"):
        _seed_tar(_spec(out), {})


def test_ray_input_pack_and_signature_take_a_path_past_path_max(tmp_path: Path) -> None:
    from runner.isolation.ray.archive import ENTRY, pack_input
    from runner.isolation.ray.backend import _signature

    src = tmp_path / "src"
    rel = _long_tree(src)
    data = pack_input(src)
    assert pack_input(src) == data  # still reproducible
    assert _content(data, f"{ENTRY}/{rel}") == b"deep\n"
    assert _members(data)[f"{ENTRY}/link"].linkname == "top.txt"
    sig = _signature(src)
    assert any(row[0] == rel for row in sig)
    # a changed deep file changes the signature (the cache cannot serve a stale input)
    _, st = read_at(src, rel)
    fd = _parent_fd(src, rel)
    try:
        os.utime(LONG_FILE, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9), dir_fd=fd)
    finally:
        os.close(fd)
    assert _signature(src) != sig


def _parent_fd(root: Path, rel: str) -> int:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for d in rel.split("/")[:-1]:
        nfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    return fd


def test_ray_input_pack_of_a_single_file_and_a_link_root(tmp_path: Path) -> None:
    from runner.isolation.ray.archive import ENTRY, pack_input
    from runner.isolation.ray.backend import _signature

    f = tmp_path / "f"
    f.write_text("one")
    data = pack_input(f)
    assert list(_members(data)) == [ENTRY] and _content(data, ENTRY) == b"one"
    assert len(_signature(f)) == 1


def test_ray_output_pack_takes_a_path_past_path_max_and_skips_nothing(tmp_path: Path) -> None:
    from runner.isolation.ray.archive import pack_output

    out = tmp_path / "node-out"
    rel = _long_tree(out)
    data = pack_output(out, 1 << 20)
    assert _content(data, rel) == b"deep\n"
    os.mkfifo(out / "pipe")  # the old pack_output left it out without a word
    with pytest.raises(SandboxError, match=r"pipe: not a regular file, directory or symlink"):
        pack_output(out, 1 << 20)


@pytest.mark.skipif(os.getuid() != 0, reason="hands the work directory to another uid")
def test_apply_hands_over_a_work_dir_with_a_path_past_path_max(tmp_path: Path) -> None:
    from runner.cycle.apply import _give

    work = tmp_path / "work"
    rel = _long_tree(work / "repo")
    _give(work, 65534)
    _, st = read_at(work / "repo", rel)
    assert st.st_uid == 65534 and st.st_gid == 65534
    assert os.lstat(work / "repo" / "link").st_uid == 65534  # the link itself, not followed
    assert os.stat(work / "repo" / "top.txt").st_uid == 65534


def test_collect_reads_a_path_past_path_max(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    rel = make_long(out)
    got = collect(out)
    assert got.files == {rel: b"deep\n"}


def test_dir_usage_counts_a_path_past_path_max(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    make_long(out)
    used, entries = dir_usage(out)
    assert entries == 17  # 16 directories and the file: the old walk lost the deep ones
    assert used >= 5


_AS_NOBODY = """
import os, sys
from pathlib import Path
from runner.isolation.collect import dir_usage
from runner.errors import OutputRejected
"x".encode("unicode_escape"); b"x".decode("utf-8", "backslashreplace")
os.setgid(65534); os.setuid(65534)
try:
    print("COUNTED", dir_usage(Path(sys.argv[1])))
except OutputRejected as exc:
    print("REFUSED", exc)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="drops to uid 65534 to make a directory unreadable")
def test_dir_usage_names_an_unreadable_directory() -> None:
    base = Path(tempfile.mkdtemp(prefix="cbx-unreadable-"))
    try:
        os.chmod(base, 0o755)
        (base / "out/locked").mkdir(parents=True)
        (base / "out/locked/big").write_bytes(b"x" * 100_000)
        for p in [base / "out", base / "out/locked", base / "out/locked/big"]:
            os.chown(p, 65534, 65534)
        os.chmod(base / "out/locked", 0)
        res = subprocess.run([sys.executable, "-c", _AS_NOBODY, str(base / "out")],
                             capture_output=True, text=True, timeout=60, check=False,
                             cwd=PROJECT_ROOT, env=dict(os.environ, PYTHONPATH=str(PROJECT_ROOT)))
        assert res.returncode == 0, res.stderr
        assert "COUNTED" not in res.stdout, res.stdout
        assert "REFUSED" in res.stdout and "locked: cannot open the directory" in res.stdout
    finally:
        shutil.rmtree(base)


def test_report_names_what_it_cannot_read_instead_of_leaving_it_out(tmp_path: Path) -> None:
    from runner.report import build_report, readfs

    run = tmp_path / "run"
    case = run / "stages/baseline/cases/c1__t0"
    (case / "logs").mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"plan": {"name": "x", "trials": 1}}))
    row = {"case_id": "c1", "trial": 0, "split": "development", "status": "ok",
           "reason": None, "answer": {"answer": "1"}, "grades": None, "latency_s": 1.0,
           "usage": {}, "identities": {"data_hash": "d", "reference_hash": "r",
                                       "scorer": "s", "judge": None}}
    (run / "stages/baseline/records.jsonl").write_text(json.dumps(row) + "\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "answer.json").write_text("{}")
    (case / "out").symlink_to(outside)  # the old is_file said "absent" and moved on
    with pytest.raises(OutputRejected, match="symlink"):
        readfs.is_file(run, "stages/baseline/cases/c1__t0/out/answer.json")
    assert readfs.is_file(run, "stages/baseline/cases/c1__t0/logs/nope") is False
    r = build_report(run)
    assert any("c1__t0/out" in p and "symlink" in p for p in r.problems), r.problems
    # a path past PATH_MAX is read like any other (component by component)
    deep = make_long(run)
    assert readfs.is_file(run, deep)
    assert readfs.read_bytes(run, deep) == b"deep\n"


def test_report_names_a_plan_it_cannot_read(tmp_path: Path) -> None:
    from runner.report import build_report

    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "plan.json").write_text("{}")
    (run / "plan.json").symlink_to(tmp_path / "plan.json")
    with pytest.raises(OutputRejected, match=r"plan\.json.*symlink"):
        build_report(run)


def test_trainer_hand_over_takes_a_path_past_path_max(tmp_path: Path) -> None:
    from runner.train.host import hand_over

    out = tmp_path / "out"
    rel = _long_tree(out / "adapter")
    os.chmod(out / "adapter" / "top.txt", 0o600)
    hand_over(out)
    _, st = read_at(out / "adapter", rel)
    assert st.st_mode & 0o777 == 0o644
    assert os.stat(out / "adapter" / "top.txt").st_mode & 0o777 == 0o644
