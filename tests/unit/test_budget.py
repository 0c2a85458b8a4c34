"""RunBudget: admission under a lock, reservations, unknown and over-reservation charges."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from runner.gateway.budget import BudgetPolicy, BudgetRefused, RunBudget


def _hammer(budget: RunBudget, role: str, n: int, cost: float | None, out: list[str]) -> None:
    for _ in range(n):
        try:
            res = budget.admit(role)
        except BudgetRefused as exc:
            out.append(exc.reason)
            continue
        budget.settle(res, cost if cost is not None else None)


def test_concurrent_calls_never_exceed_limit_or_max_calls() -> None:
    b = RunBudget(BudgetPolicy(limit_usd=1.0, max_calls=500, reservation_usd=0.01))
    refusals: list[str] = []
    rng = random.Random(7)
    threads = [threading.Thread(target=_hammer,
                                args=(b, r, 200, rng.uniform(0.001, 0.01), refusals))
               for r in ("analyst", "worker", "evaluator") for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tot = b.totals()["total"]
    assert tot["spent_usd"] <= 1.0  # type: ignore[operator]
    assert tot["calls"] <= 500  # type: ignore[operator]
    assert refusals, "the limits should have been reached"
    assert tot["complete"] is True
    assert b.halted is None


def test_max_calls_exact() -> None:
    b = RunBudget(BudgetPolicy(max_calls=3, reservation_usd=0.0))
    for _ in range(3):
        b.settle(b.admit("analyst"), 0.0)
    with pytest.raises(BudgetRefused, match="max_calls 3"):
        b.admit("worker")


def test_unknown_cost_halts_and_marks_incomplete() -> None:
    b = RunBudget(BudgetPolicy(limit_usd=10, reservation_usd=0.1))
    b.settle(b.admit("analyst"), 0.05)
    b.settle(b.admit("analyst"), None)
    with pytest.raises(BudgetRefused, match="unknown cost"):
        b.admit("worker")
    t = b.totals()
    assert t["total"]["complete"] is False  # type: ignore[index]
    assert t["per_role"]["analyst"]["unknown_cost_calls"] == 1  # type: ignore[index]


def test_charge_above_reservation_halts() -> None:
    b = RunBudget(BudgetPolicy(limit_usd=10, reservation_usd=0.1))
    b.settle(b.admit("worker"), 0.5)
    assert b.halted and "above its reservation" in b.halted
    with pytest.raises(BudgetRefused):
        b.admit("analyst")


def test_per_role_caps_do_not_touch_other_roles() -> None:
    b = RunBudget(BudgetPolicy(limit_usd=10, reservation_usd=0.1,
                               per_role_usd={"worker": 0.2}, per_role_calls={"analyst": 1}))
    b.settle(b.admit("worker"), 0.1)
    b.settle(b.admit("worker"), 0.1)
    with pytest.raises(BudgetRefused, match=r"per-role limit_usd 0\.2"):
        b.admit("worker")
    b.settle(b.admit("analyst"), 0.0)
    with pytest.raises(BudgetRefused, match="per-role max_calls 1"):
        b.admit("analyst")
    b.settle(b.admit("evaluator"), 0.1)
    per = b.totals()["per_role"]
    assert per["worker"]["calls"] == 2 and per["evaluator"]["calls"] == 1  # type: ignore[index]


def test_reservation_counts_while_open() -> None:
    b = RunBudget(BudgetPolicy(limit_usd=0.25, reservation_usd=0.1))
    r1, r2 = b.admit("a"), b.admit("a")
    with pytest.raises(BudgetRefused, match="limit_usd"):
        b.admit("a")
    b.settle(r1, 0.01)
    b.admit("a")
    b.release(r2)
    with pytest.raises(ValueError, match="settled twice"):
        b.settle(r1, 0.0)


@pytest.mark.parametrize("locked", [True, False])
def test_budget_race_is_caught_without_the_lock(locked: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight threads race for a limit that fits two worst cases. The check is slowed so
    threads interleave between check and reservation; with the lock no overshoot, and
    without it the same test sees one (so the assertion can fail)."""
    import contextlib
    import time

    b = RunBudget(BudgetPolicy(limit_usd=1.0, reservation_usd=0.0))
    if not locked:
        monkeypatch.setattr(b, "_lock", contextlib.nullcontext())
    check = RunBudget._check

    def slow_check(*a: object) -> None:
        check(*a)  # type: ignore[arg-type]
        time.sleep(0.01)  # let the other threads run between check and reserve

    monkeypatch.setattr(RunBudget, "_check", staticmethod(slow_check))
    admitted: list[float] = []
    barrier = threading.Barrier(8)

    def racer() -> None:
        barrier.wait()
        with contextlib.suppress(BudgetRefused):
            admitted.append(b.admit("analyst", 0.5).amount)

    threads = [threading.Thread(target=racer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    overshoot = sum(admitted) > 1.0 + 1e-12
    assert overshoot is not locked


def test_worst_case_reservation_and_unknown_price() -> None:
    b = RunBudget(BudgetPolicy(limit_usd=1.0, reservation_usd=0.01))
    assert b.admit("a", 0.001).amount == 0.01  # the floor
    assert b.admit("a", 0.6).amount == 0.6
    with pytest.raises(BudgetRefused, match="worst case"):
        b.admit("a", 0.6)
    with pytest.raises(BudgetRefused, match="no price"):
        b.admit("a", None)
    assert RunBudget(BudgetPolicy()).admit("a", None).amount == 0.05  # no limit: counted only


@pytest.mark.parametrize(("field", "value", "why"), [
    ("per_role_usd", {"analist": 0.0001}, "'analist', not a role that calls a model"),
    ("per_role_calls", {"wrker": 1}, "'wrker', not a role that calls a model"),
    ("per_role_calls", {"analyst": -5}, "caps must be 0 or more"),
    ("per_role_usd", {"worker": float("nan")}, "caps must be 0 or more, and finite"),
])
def test_a_per_role_cap_names_a_real_role_and_a_real_cap(field: str, value: object,
                                                         why: str) -> None:
    """A misspelt role's cap was frozen as written and never applied (admission looks
    caps up by the calling role's name); a negative count was accepted."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=why):
        BudgetPolicy(**{field: value})
    BudgetPolicy(per_role_usd={"analyst": 0.5}, per_role_calls={"worker": 1, "evaluator": 0})


def test_export_policy_and_script_rules_name_real_roles(tmp_path: Path) -> None:
    from runner.errors import ConfigError
    from runner.gateway.providers import load_script
    from runner.train.export import load_export_policy

    p = tmp_path / "export.yaml"
    p.write_text("schema: 1\nmin_kappa: 0.4\nroles: [analist]\n")
    with pytest.raises(ConfigError, match="roles"):
        load_export_policy(p)
    s = tmp_path / "script.yaml"
    s.write_text("schema: 1\nrules: [{when: {role: analist}, reply: x}]\n"
                 "default: {reply: y}\n")
    with pytest.raises(ConfigError, match="role"):
        load_script(s)
