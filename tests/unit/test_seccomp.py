"""The seccomp profile as the engine receives it per runtime (runner/isolation/seccomp.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from runner.errors import ConfigError
from runner.isolation.seccomp import MAX_BYTES, for_runtime, load_profile


def test_under_gvisor_only_clone3_is_passed_to_the_sentry() -> None:
    """runc gets the profile as shipped; runsc the same but for clone3's ENOSYS rule, now
    an allow (the sentry answers ENOSYS itself; see for_runtime)."""
    text = load_profile().text
    assert for_runtime(text, None) is text and for_runtime(text, "runc") is text
    before, after = json.loads(text), json.loads(for_runtime(text, "runsc"))
    changed = [(a, b) for a, b in zip(before["syscalls"], after["syscalls"], strict=True)
               if a != b]
    assert len(changed) == 1
    old, new = changed[0]
    assert old["names"] == new["names"] == ["clone3"]
    assert old["action"] == "SCMP_ACT_ERRNO" and old["errnoRet"] == 38
    assert new["action"] == "SCMP_ACT_ALLOW" and "errnoRet" not in new
    assert {k: v for k, v in before.items() if k != "syscalls"} == {
        k: v for k, v in after.items() if k != "syscalls"}


def test_a_profile_that_is_a_fifo_or_a_device_is_refused_unread(tmp_path: Path) -> None:
    """A FIFO named as a role's seccomp profile held freeze, doctor and sandbox exec
    forever (a blocking open); /dev/zero read to the cap and was called a big profile."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for p, why in ((fifo, "is not a regular file"), (Path("/dev/zero"), "is not a regular"),
                   (tmp_path, "is a directory")):
        with pytest.raises(ConfigError, match=why) as info:
            load_profile(p, field="roles.worker.seccomp")
        assert info.value.field == "roles.worker.seccomp"
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (MAX_BYTES + 1))
    with pytest.raises(ConfigError, match=f"the limit is {MAX_BYTES}"):
        load_profile(big)
