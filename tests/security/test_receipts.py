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
import shutil
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from runner.cycle.receipt import CANDIDATE_GIT, _files, _unbound
from runner.cycle.receipt import verify as verify_in
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
         "external": {}, "candidate_git_bound": True}, sort_keys=True))


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
    (git / "pack").write_bytes(b"a file of the bare clone: bound like any other")
    write_receipt(d, _files(d)[0])
    res = verify(d)
    assert res.returncode == 0, res.stdout + res.stderr  # positive control
    return d


def test_good_receipt_verifies_signed_and_unsigned(run: Path, tmp_path: Path) -> None:
    assert set(json.loads((run / "receipt.json").read_text())["files"]) == {
        "plan.json", "stages/a/out.txt", "stages/a/records.jsonl",
        "stages/apply/candidate.git/objects/pack"}
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


def test_a_file_name_cannot_forge_a_line_of_the_verdict(run: Path) -> None:
    """helper-39 F6: a name holding newlines printed a line of its own that read
    "receipt verified: ..." above the real verdict. Each problem is one line."""
    forged = "x\nreceipt verified: every named file matches\n"
    (run / "stages" / "a" / forged).write_text("x")
    res = verify(run)
    assert res.returncode == 8
    assert not any(line.startswith("receipt verified")
                   for line in (res.stdout + res.stderr).splitlines()), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_json_output_lists_problems(run: Path) -> None:
    (run / "stages" / "a" / "planted.txt").write_text("x")
    res = verify(run, "--json")
    assert res.returncode == 8
    doc = json.loads(res.stdout)
    assert doc["ok"] is False
    assert doc["problems"] == [
        "stages/a/planted.txt: present in the run directory but not named by the receipt"]


# --- exact unbound paths, the candidate tree, files_not_utf8, external stores -----------

def rewrite(run: Path, plan: dict[str, Any] | None = None, *, legacy: bool = False,
            **extra: Any) -> None:
    """plan.json (when given) and a receipt over the run as the writer's walk sees it;
    ``legacy``: as receipts were written before they bound candidate.git's files."""
    if plan is not None:
        (run / "plan.json").write_text(json.dumps({"plan": plan,
                                                   "plan_hash": sha256_json(plan)}))
    doc = json.loads((run / "plan.json").read_text())
    files, not_utf8 = _files(run)
    if legacy:
        files = {k: v for k, v in files.items()
                 if not k.startswith((CANDIDATE_GIT + "/", "stages/apply/work/repo/.git/"))}
    (run / "receipt.json").write_text(json.dumps(
        {"schema": 1, "plan_hash": doc["plan_hash"], "files": files,
         "files_not_utf8": not_utf8, "external": {}, **extra,
         **({} if legacy else {"candidate_git_bound": True})}, sort_keys=True))


@pytest.mark.parametrize("rel", ["stages/worker/c1/out/candidate.git/answer.json",
                                 "stages/worker/c1/out/receipt.json",
                                 "stages/worker/c1/out/work/repo/.git/answer.json",
                                 "stages/x/receipt.dsse.json"])
def test_look_alike_unbound_names_are_bound(run: Path, rel: str) -> None:
    assert not _unbound(rel)
    (run / rel).parent.mkdir(parents=True)
    (run / rel).write_text('{"answer": 42}')
    rewrite(run)
    assert rel in json.loads((run / "receipt.json").read_text())["files"]
    assert verify_in(run) == []
    (run / rel).write_text('{"answer": 41}')  # evidence edited after the run
    assert verify_in(run) == [f"{rel}: sha256 differs from the receipt"]


def test_only_the_exact_apply_git_dirs_and_receipt_are_unbound() -> None:
    assert _unbound("receipt.json") and _unbound("receipt.dsse.json")
    assert not _unbound("stages/apply/candidate.git/objects/pack/x.pack")
    assert _unbound("stages/apply/candidate.git/objects/pack/x.pack", legacy_git=True)
    assert not _unbound("stages/apply/work/repo/.git/config")
    assert _unbound("stages/apply/work/repo/.git/config", legacy_git=True)
    assert not _unbound("stages/apply/candidate.git")  # a file of that name is bound
    assert not _unbound("x/stages/apply/candidate.git/HEAD")
    assert not _unbound("stages/apply/work/repo/README.md")


def _git(*args: str, cwd: Path | None = None) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture(params=[False, True], ids=["bound", "legacy"])
def applied(run: Path, tmp_path: Path, request: pytest.FixtureRequest
            ) -> tuple[Path, str, str]:
    """A run whose apply stage left a bare clone and result.json; the receipt binds the
    candidate tree, and the clone's files (or, ``legacy``, as receipts written before
    that: only its commit and tree)."""
    shutil.rmtree(run / "stages" / "apply")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("x = 1\n")
    _git("init", "-q", "-b", "main", cwd=src)
    _git("add", "-A", cwd=src)
    _git("commit", "-q", "-m", "c", cwd=src)
    commit, tree = _git("rev-parse", "HEAD", cwd=src), _git("rev-parse", "HEAD^{tree}", cwd=src)
    (run / "stages" / "apply").mkdir()
    _git("clone", "-q", "--bare", str(src), str(run / "stages" / "apply" / "candidate.git"))
    (run / "stages" / "apply" / "result.json").write_text(json.dumps(
        {"status": "applied", "commit": commit, "tree": tree}))
    rewrite(run, outcome={"candidate_tree": tree}, legacy=request.param)
    assert verify_in(run) == []  # positive control: the tree recomputes
    return run, commit, tree


NOT_REGULAR = "not a regular file or directory (a git directory of the apply stage holds none)"


def _legacy(run: Path) -> bool:
    return "candidate_git_bound" not in json.loads((run / "receipt.json").read_text())


def test_candidate_tree_differs_from_the_bare_clone(applied: tuple[Path, str, str]) -> None:
    run, commit, tree = applied
    rewrite(run, outcome={"candidate_tree": "0" * 40}, legacy=_legacy(run))
    problems = verify_in(run)
    assert len(problems) == 1 and f"tree of commit {commit} is {tree}" in problems[0]


def test_candidate_git_removed_or_edited_is_reported(applied: tuple[Path, str, str]) -> None:
    run, commit, _ = applied
    bare = run / "stages" / "apply" / "candidate.git"
    # the commit object rewritten in place (same id, other tree): it no longer hashes
    obj = bare / "objects" / commit[:2] / commit[2:]
    assert obj.is_file()  # a local clone copies loose objects
    obj.unlink()
    obj.write_bytes(zlib.compress(b"commit 12\0tree 0000000"))
    problems = verify_in(run)
    rel = f"{CANDIDATE_GIT}/objects/{commit[:2]}/{commit[2:]}"
    assert "cannot recompute the tree" in problems[-1], problems
    assert problems[:-1] == ([] if _legacy(run) else [f"{rel}: sha256 differs from the receipt"])
    shutil.rmtree(bare)
    problems = verify_in(run)
    assert problems[-1].startswith("stages/apply/candidate.git (outcome.candidate_tree): ")
    assert len(problems) == 1 if _legacy(run) else f"{rel}: missing" in problems


@pytest.mark.parametrize("attack", ["include-fifo", "include-dev-zero", "alternates",
                                    "commondir", "commondir-link", "fifo-head",
                                    "worktree-config"])
def test_candidate_git_config_and_pointers_are_never_obeyed(
        applied: tuple[Path, str, str], attack: str) -> None:
    """Verify reads the commit object itself and runs no git there, so nothing in the
    directory is obeyed: an [include] of a FIFO (which blocked a git-based verify), of
    /dev/zero, alternates or commondir sending git elsewhere, a FIFO HEAD. The candidate
    still recomputes. Each is reported (the receipt binds every file of the clone, so a
    third-party verifier that runs git there learns first that it was edited), but under
    a receipt written before it did, which bound the clone by its commit and tree only."""
    run, _, _ = applied
    bare = run / "stages" / "apply" / "candidate.git"
    g = CANDIDATE_GIT
    if attack.startswith("include"):
        target = "fifo" if attack == "include-fifo" else "/dev/zero"
        if target == "fifo":
            os.mkfifo(bare / "fifo")
        with (bare / "config").open("a") as f:
            f.write(f"[include]\n\tpath = {target}\n")
        want = [f"{g}/config: sha256 differs from the receipt"] + (
            [f"{g}/fifo: {NOT_REGULAR}"] if target == "fifo" else [])
    elif attack == "alternates":
        (bare / "objects" / "info").mkdir(parents=True, exist_ok=True)
        (bare / "objects" / "info" / "alternates").write_text("/tmp\n")
        want = [f"{g}/objects/info/alternates: present in the run directory but not named "
                "by the receipt"]
    elif attack == "commondir":
        (bare / "commondir").write_text("/tmp\n")
        want = [f"{g}/commondir: present in the run directory but not named by the receipt"]
    elif attack == "commondir-link":
        (run.parent / "x").write_text("/tmp\n")
        (bare / "commondir").symlink_to(run.parent / "x")
        want = [f"{g}/commondir: {NOT_REGULAR}"]
    elif attack == "fifo-head":
        (bare / "HEAD").unlink()
        os.mkfifo(bare / "HEAD")
        want = [f"{g}/HEAD: not a regular file (refused without reading)",
                f"{g}/HEAD: {NOT_REGULAR}"]
    else:
        (bare / "config.worktree").write_text("[include]\n\tpath = /dev/zero\n")
        with (bare / "config").open("a") as f:
            f.write("[extensions]\n\tworktreeConfig = true\n")
        want = [f"{g}/config: sha256 differs from the receipt",
                f"{g}/config.worktree: present in the run directory but not named by the "
                "receipt"]
    got = verify_in(run)
    assert got == ([] if _legacy(run) else want), got


def test_a_promisor_remote_in_candidate_git_runs_nothing(
        applied: tuple[Path, str, str], tmp_path: Path) -> None:
    """An attack review's reproducer: the commit object moved aside and a config naming a
    promisor remote whose ``ext::`` url runs a script (which puts the object back), so
    git fetching the missing object ran the directory author's command as the verifying
    user, and verify then passed, signature and all. Verify reads the object file
    itself: the missing object is named, and nothing runs."""
    run, commit, _ = applied
    bare = run / "stages" / "apply" / "candidate.git"
    obj = bare / "objects" / commit[:2] / commit[2:]
    marker = tmp_path / "ran"
    saved = bare / "saved_obj"
    shutil.move(str(obj), str(saved))
    (bare / "payload.sh").write_text(f"#!/bin/sh\nid > {marker}\ncp {saved} {obj}\n")
    with (bare / "config").open("a") as f:
        f.write('[protocol "ext"]\n\tallow = always\n[remote "origin"]\n'
                "\turl = ext::sh payload.sh\n\tpromisor = true\n")
    problems = verify_in(run)
    assert not marker.exists(), "verify ran a command the run directory named"
    assert "cannot recompute the tree" in problems[-1] and "missing" in problems[-1], problems
    if _legacy(run):
        assert len(problems) == 1, problems
    else:  # and the edits are named: a verifier that runs git there is warned first
        assert f"{CANDIDATE_GIT}/config: sha256 differs from the receipt" in problems


def test_a_linked_objects_directory_is_refused(applied: tuple[Path, str, str]) -> None:
    run, _, _ = applied
    bare = run / "stages" / "apply" / "candidate.git"
    elsewhere = run.parent / "elsewhere"  # outside the run directory
    shutil.move(str(bare / "objects"), str(elsewhere))
    (bare / "objects").symlink_to(elsewhere)
    problems = verify_in(run)
    assert "symlinked directory component" in problems[-1], problems
    if _legacy(run):
        assert len(problems) == 1, problems
    else:
        assert f"{CANDIDATE_GIT}/objects: {NOT_REGULAR}" in problems


def test_a_remote_url_naming_include_or_worktree_is_not_a_refusal(
        applied: tuple[Path, str, str]) -> None:
    """The vetting reads section names and keys, not values: the clone's remote url holds
    the run directory's path, which may say include or worktree."""
    run, _, _ = applied
    with (run / "stages" / "apply" / "candidate.git" / "config").open("a") as f:
        f.write('[remote "x"]\n\turl = file:///srv/include/worktrees/run/repo\n')
    assert verify_in(run) == ([] if _legacy(run) else [
        f"{CANDIDATE_GIT}/config: sha256 differs from the receipt"])


def test_missing_not_utf8_file_is_reported(run: Path) -> None:
    odd = os.path.join(bytes(run / "stages" / "a"), b"caf\xe9.txt")
    with open(odd, "wb") as f:
        f.write(b"latin-1 name\n")
    rewrite(run)
    not_utf8 = json.loads((run / "receipt.json").read_text())["files_not_utf8"]
    assert list(not_utf8) == ["stages/a/caf\\xe9.txt"]
    assert verify_in(run) == []
    os.unlink(odd)
    assert verify_in(run) == ["stages/a/caf\\xe9.txt: missing"]
    # a UTF-8 file whose name is the escaped spelling does not stand in for it
    (run / "stages" / "a" / "caf\\xe9.txt").write_bytes(b"latin-1 name\n")
    problems = verify_in(run)
    assert "stages/a/caf\\xe9.txt: missing" in problems, problems


@pytest.fixture
def stores(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    data = tmp_path / "data"
    data.mkdir()
    (data / "s.csv").write_text("a,b\n")
    plan = {"name": "t", "data_dir": str(data)}
    rewrite(run, plan, external={"store:s": {"path": str(data / "s.csv"),
                                             "sha256": sha256_bytes(b"a,b\n")}})
    assert verify_in(run) == []
    return run, data


def test_external_outside_data_dir_is_not_read(stores: tuple[Path, Path],
                                               tmp_path: Path) -> None:
    run, data = stores
    secret = tmp_path / "secret"
    secret.write_bytes(b"host file\n")
    for path in (str(secret), f"{data}/../secret", f"{data}-x/s.csv"):
        rewrite(run, external={"e": {"path": path, "sha256": sha256_bytes(b"host file\n")}})
        problems = verify_in(run)
        assert len(problems) == 1 and problems[0].startswith(f"e ({path}): "), problems
        assert "outside the plan's data_dir" in problems[0] or "'..'" in problems[0]


def test_external_symlink_in_data_dir_refused(stores: tuple[Path, Path],
                                              tmp_path: Path) -> None:
    run, data = stores
    secret = tmp_path / "secret"
    secret.write_bytes(b"host file\n")
    (data / "link.csv").symlink_to(secret)
    rewrite(run, external={"e": {"path": str(data / "link.csv"),
                                 "sha256": sha256_bytes(b"host file\n")}})
    assert verify_in(run) == [f"e ({data}/link.csv): symlink refused (never followed)"]


def test_external_changed_store_fails(stores: tuple[Path, Path]) -> None:
    run, data = stores
    (data / "s.csv").write_text("a,c\n")
    assert verify_in(run) == [f"store:s ({data}/s.csv): sha256 differs from the receipt"]



def test_records_digest_reads_a_line_at_a_time(tmp_path: Path) -> None:
    """helper-39 F3: verify kept every parsed line of a records file (100 MiB of
    ``[[],[],...]`` lines took 2.9 GB). The digest is now made a line at a time, with
    the same value as the list's canonical JSON, and a line of more objects and arrays
    than a record holds is refused unparsed."""
    from runner.cycle.receipt import RECORD_MAX_CONTAINERS, _records_digest
    from runner.errors import OutputRejected

    rows = [{"case_id": "c\u2028", "trial": 0, "status": "ok", "reason": None,
             "answer": {"a": [1, "\\ud800"]}, "grades": None, "identities": {"x": "y"},
             "latency_s": 1.5},
            {"case_id": "d", "trial": 1, "status": "infra_invalid", "reason": "r"}]
    p = tmp_path / "records.jsonl"
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + "\n")
    keys = ("case_id", "trial", "status", "reason", "answer", "grades", "identities")
    assert _records_digest(p) == sha256_json([{k: r.get(k) for k in keys} for r in rows])
    p.write_bytes(b"[" + b"[]," * RECORD_MAX_CONTAINERS + b"[]]\n")
    with pytest.raises(OutputRejected, match=r"records\.jsonl:1"):
        _records_digest(p)


def test_the_apply_containers_old_repository_is_bound_too(run: Path, tmp_path: Path) -> None:
    """helper-42 #5: stages/apply/work/repo/.git stayed unbound in new receipts: a
    ``core.fsmonitor`` command added there passed verify, and `git status` in the
    candidate's files ran it. New receipts bind it; legacy ones are checked as before."""
    repo = run / "stages" / "apply" / "work" / "repo"
    repo.mkdir(parents=True)
    _git("init", "-q", str(repo))
    rewrite(run)
    assert verify_in(run) == []
    marker = tmp_path / "ran"
    with (repo / ".git" / "config").open("a") as f:
        f.write(f"[core]\n\tfsmonitor = touch {marker}; false\n")
    assert verify_in(run) == [
        "stages/apply/work/repo/.git/config: sha256 differs from the receipt"]
    rewrite(run, legacy=True)
    assert verify_in(run) == []


def test_a_temporary_file_a_killed_sign_left_is_named_with_its_fix(run: Path) -> None:
    """helper-42 #7: a `receipt sign` killed inside its write left
    ``.receipt.dsse.json.<hex>.tmp``; verify named it as any unknown file, with no fix."""
    (run / ".receipt.dsse.json.47e3359b5d81.tmp").write_text("{}")
    (problem,) = verify_in(run)
    assert problem.startswith(".receipt.dsse.json.47e3359b5d81.tmp: present in the run")
    assert "killed `receipt sign` or `receipt attest` left: delete it" in problem


def test_a_candidate_commit_kept_in_a_pack_is_read_and_checked(
        applied: tuple[Path, str, str]) -> None:
    """helper-47 #4: runs before 2026-12-05 kept the candidate clone's commit in a pack;
    verify read loose objects only, so those runs (and a --replay from one) failed with
    "missing". The pack is read without git: found, inflated, hashed to its id; a pack
    whose commit bytes are edited fails."""
    run, commit, tree = applied
    bare = run / "stages" / "apply" / "candidate.git"
    _git("repack", "-a", "-d", "-q", cwd=bare)
    _git("prune-packed", cwd=bare)
    assert not (bare / "objects" / commit[:2] / commit[2:]).exists()
    pack = next((bare / "objects" / "pack").glob("*.pack"))
    rewrite(run, outcome={"candidate_tree": tree}, legacy=_legacy(run))
    assert verify_in(run) == []
    data = bytearray(pack.read_bytes())
    body = _git("cat-file", "commit", commit, cwd=bare).encode()
    # flip the commit's message in the pack: the object no longer hashes to its id
    at = data.find(zlib.compress(body)[2:12])
    if at < 0:  # compressed at another level: recompress the commit in place instead
        pytest.skip("commit not found compressed as zlib's default in the pack")
    pack.chmod(0o644)
    blob = zlib.compress(body.replace(b"\nc\n", b"\nd\n"))
    data[at - 2: at - 2 + len(blob)] = blob
    pack.write_bytes(bytes(data))
    rewrite(run, outcome={"candidate_tree": tree}, legacy=_legacy(run))
    problems = verify_in(run)
    assert problems and "cannot recompute the tree" in problems[-1], problems


@pytest.mark.parametrize("offset", [(1 << 64) - 1, (1 << 63) - 1, 1 << 62, 5])
def test_a_pack_offset_out_of_its_pack_is_named_not_a_crash(
        applied: tuple[Path, str, str], offset: int) -> None:
    """helper-48 #1: the index's (large) offset was sought unchecked: ValueError or
    EINVAL ended `receipt verify` with exit 10. A one-object index whose offset lies
    outside the pack is now a named problem."""
    import struct

    run, commit, tree = applied
    bare = run / "stages" / "apply" / "candidate.git"
    _git("repack", "-a", "-d", "-q", cwd=bare)
    _git("prune-packed", cwd=bare)
    idx = next((bare / "objects" / "pack").glob("*.idx"))
    want = bytes.fromhex(commit)
    fan = b"".join(struct.pack(">I", 0 if i < want[0] else 1) for i in range(256))
    large = offset >= 1 << 31
    body = (b"\xfftOc" + struct.pack(">I", 2) + fan + want + b"\0" * 4
            + struct.pack(">I", 0x80000000 if large else offset)
            + (struct.pack(">Q", offset) if large else b""))
    idx.chmod(0o644)
    idx.write_bytes(body)
    rewrite(run, outcome={"candidate_tree": tree}, legacy=_legacy(run))
    problems = verify_in(run)
    assert problems and "cannot recompute the tree" in problems[-1], problems
    assert "outside its pack" in problems[-1], problems
