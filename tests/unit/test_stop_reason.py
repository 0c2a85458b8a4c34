"""Stop-reason classification on the flag combinations the backend observes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runner.isolation.gc import judge
from runner.isolation.owner import Owner, parse_stat_start
from runner.isolation.sandbox import RunFlags, StopReason, classify_stop


@pytest.mark.parametrize(("flags", "reason"), [
    (RunFlags(exit_code=0), StopReason.OK),
    (RunFlags(exit_code=3), StopReason.PROCESS_FAILED),
    (RunFlags(exit_code=None), StopReason.PROCESS_FAILED),
    (RunFlags(exit_code=137, oom_killed=True), StopReason.OOM),
    (RunFlags(exit_code=137), StopReason.PROCESS_FAILED),
    # our own kills arrive as 137 too, and must not read as OOM
    (RunFlags(exit_code=137, timed_out=True), StopReason.TIMEOUT),
    (RunFlags(exit_code=137, stream_exceeded=True), StopReason.OUTPUT_LIMIT),
    (RunFlags(exit_code=137, output_dir_exceeded=True), StopReason.OUTPUT_LIMIT),
    (RunFlags(exit_code=0, cleanup_confirmed=False), StopReason.CLEANUP_UNCONFIRMED),
    (RunFlags(exit_code=137, timed_out=True, cleanup_confirmed=False),
     StopReason.CLEANUP_UNCONFIRMED),
])
def test_classify(flags: RunFlags, reason: StopReason) -> None:
    got, detail = classify_stop(flags)
    assert got is reason
    assert (detail == "") == (reason is StopReason.OK)


def test_stat_start_survives_hostile_comm() -> None:
    # comm may contain spaces and ')' ; field 22 is the start time
    fields = ["S"] + [str(i) for i in range(4, 22)] + ["987654"] + ["0"] * 20
    line = "123 (evil) name) ) " + " ".join(fields)
    assert parse_stat_start(line) == 987654


HERE = Owner(pid=1, start=10, boot_id="b", host="h")
LABELS = {"io.cyclebox.owner_pid": "99", "io.cyclebox.owner_start": "5",
          "io.cyclebox.owner_boot": "b", "io.cyclebox.owner_host": "h"}


def test_gc_judgement() -> None:
    assert judge(LABELS, HERE, only_orphans=True, alive=False)[0] is True
    assert judge(LABELS, HERE, only_orphans=True, alive=True)[0] is False
    assert judge({}, HERE, only_orphans=True)[0] is True
    assert judge(LABELS, HERE, only_orphans=False, alive=True)[0] is True
    other_boot = {**LABELS, "io.cyclebox.owner_boot": "old"}
    assert judge(other_boot, HERE, only_orphans=True)[0] is True
    other_host = {**LABELS, "io.cyclebox.owner_host": "elsewhere"}
    assert judge(other_host, HERE, only_orphans=True)[0] is False


def test_gc_sweeps_staging_copies_of_a_dead_controller(tmp_path: Path) -> None:
    import json
    from dataclasses import asdict, replace

    from runner.isolation.gc import sweep_staging_dirs
    from runner.isolation.owner import current_owner

    me = current_owner()
    dead = replace(me, start=me.start + 1)  # same pid, another start time: gone
    for name, owner in (("live", me), ("dead", dead)):
        (tmp_path / name / "m0").mkdir(parents=True)
        (tmp_path / name / "m0" / "input.txt").write_text("x")
        (tmp_path / name / "owner.json").write_text(json.dumps(asdict(owner)))
    (tmp_path / "not-ours").mkdir()  # no owner record: never touched
    (tmp_path / f"{dead.pid}-{dead.start}-abc").mkdir()  # killed before its record
    (tmp_path / f"{me.pid}-{me.start}-abd").mkdir()  # ours, still running

    dry = {r.name.rsplit("/", 1)[-1]: r for r in sweep_staging_dirs(tmp_path, dry_run=True)}
    assert dry["dead"].would_remove and not dry["dead"].removed
    assert not dry["live"].would_remove and "not-ours" not in dry
    assert (tmp_path / "dead").exists()

    done = {r.name.rsplit("/", 1)[-1]: r for r in sweep_staging_dirs(tmp_path)}
    assert done["dead"].removed and not (tmp_path / "dead").exists()
    assert (tmp_path / "live" / "m0" / "input.txt").exists()
    assert (tmp_path / "not-ours").exists()
    assert not (tmp_path / f"{dead.pid}-{dead.start}-abc").exists()
    assert (tmp_path / f"{me.pid}-{me.start}-abd").exists()


def test_gc_sweeps_random_named_staging_copies_by_their_owner_record(tmp_path: Path) -> None:
    """Copies are ``cbx-in-<random>`` (nothing about the controller in the mounted path)
    with the owner record inside; one still ``cbx-in-new-<pid>-<start>-`` (killed before
    the rename) is judged by its name; nothing without the prefix is touched."""
    import json
    from dataclasses import asdict, replace

    from runner.isolation.gc import sweep_staging_dirs
    from runner.isolation.owner import current_owner

    me = current_owner()
    dead = replace(me, start=me.start + 1)
    for name, owner in (("cbx-in-" + "a" * 32, me), ("cbx-in-" + "b" * 32, dead),
                        ("cbx-gw-other", dead)):
        (tmp_path / name / "m0").mkdir(parents=True)
        (tmp_path / name / "owner.json").write_text(json.dumps(asdict(owner)))
    (tmp_path / f"cbx-in-new-{dead.pid}-{dead.start}-xyz").mkdir()
    (tmp_path / f"cbx-in-new-{me.pid}-{me.start}-xyz").mkdir()
    done = {r.name.rsplit("/", 1)[-1]: r
            for r in sweep_staging_dirs(tmp_path, prefix="cbx-in-", remove_base=False)}
    assert done["cbx-in-" + "b" * 32].removed
    assert done[f"cbx-in-new-{dead.pid}-{dead.start}-xyz"].removed
    assert not done["cbx-in-" + "a" * 32].removed
    assert not done[f"cbx-in-new-{me.pid}-{me.start}-xyz"].removed
    assert "cbx-gw-other" not in done and (tmp_path / "cbx-gw-other").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["cbx-in-" + "a" * 32, f"cbx-in-new-{me.pid}-{me.start}-xyz", "cbx-gw-other"])


def test_staging_sweep_of_a_base_another_sweeper_just_removed(tmp_path: Path,
                                                              monkeypatch: Any) -> None:
    # Ray nodes on one host sweep the same scratch bases at once; one removes a base once
    # it is empty, between another's check and its listing (gc exited 6 "No such file").
    from runner.isolation.gc import sweep_staging_dirs

    base = tmp_path / "runs"
    base.mkdir()
    real = Path.iterdir

    def vanished(self: Path) -> Any:
        if self == base:
            base.rmdir()
        return real(self)

    monkeypatch.setattr(Path, "iterdir", vanished)
    assert sweep_staging_dirs(base) == []
