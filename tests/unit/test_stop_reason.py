"""Stop-reason classification on the flag combinations the backend observes."""

from __future__ import annotations

import pytest

from runner.gc import judge
from runner.owner import Owner, parse_stat_start
from runner.sandbox import RunFlags, StopReason, classify_stop


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
