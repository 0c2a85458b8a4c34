"""Run budget shared by all roles of a cycle (SPEC §4).

Admission happens before every call under a lock: a reservation of the call's worst
case (never less than ``reservation_usd``) is held until the call settles with its
reported cost, so the sum of spend and open reservations never passes a limit, however
many calls run at once. A call that ends without usage but was admitted at a known worst
case is charged that worst case (an upper bound, counted in ``bounded_calls``) and the
run goes on. An unknown charge (no price) or a charge above its reservation stops all
further admission, and totals are then marked incomplete or halted. Nothing here does IO.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

from pydantic import Field, field_validator

from runner.isolation.sandbox import Frozen


class BudgetPolicy(Frozen):
    """Limits as written in a cycle file or policy."""

    limit_usd: float | None = Field(default=None, ge=0)
    """Total spend allowed for the run; None: no money limit (cost is still tracked)."""
    max_calls: int | None = Field(default=None, ge=0)
    """Total model calls allowed for the run."""
    reservation_usd: float = Field(default=0.05, ge=0)
    """Floor of the amount held per call until it settles; the gateway reserves the
    call's worst case when that is larger. A call costing more than its reservation
    halts admission."""
    per_role_usd: dict[str, float] = Field(default_factory=dict)
    """Optional per-role spend caps (keys: :data:`MODEL_ROLES`)."""
    per_role_calls: dict[str, int] = Field(default_factory=dict)
    """Optional per-role call caps (keys: :data:`MODEL_ROLES`)."""

    @field_validator("per_role_usd", "per_role_calls")
    @classmethod
    def _roles(cls, v: dict[str, float]) -> dict[str, float]:
        # a misspelt role's cap was kept and never applied (admission looks it up by name)
        stray = sorted(k for k in v if k not in MODEL_ROLES)
        if stray:
            raise ValueError(f"names {', '.join(map(repr, stray))}, not a role that calls a "
                             f"model; the roles are {', '.join(MODEL_ROLES)}")
        bad = sorted(k for k, n in v.items() if not (0 <= n < float("inf")))
        if bad:
            raise ValueError(f"caps must be 0 or more, and finite: {', '.join(bad)}")
        return v


MODEL_ROLES = ("analyst", "worker", "evaluator")
"""The roles that reach a model through the gateway: the agent under test, the coding
worker (and the dream relay it answers for), the judge."""


@dataclass(frozen=True)
class Reservation:
    id: int
    role: str
    amount: float


class BudgetRefused(Exception):
    """Admission refused; ``reason`` names why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Account:
    spent: float = 0.0
    reserved: float = 0.0
    calls: int = 0
    unknown_cost_calls: int = 0
    bounded_calls: int = 0


@dataclass
class RunBudget:
    """Thread-safe admission and settlement."""

    policy: BudgetPolicy
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _total: _Account = field(default_factory=_Account)
    _roles: dict[str, _Account] = field(default_factory=dict)
    _open: dict[int, Reservation] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    halted: str | None = None
    """Why admission stopped for good, if it did."""
    last_refusal: str | None = None
    """The reason of the latest refused admission (what a run's headline names)."""

    def admit(self, role: str, worst_case_usd: float | None = 0.0, *,
              free: bool = False) -> Reservation:
        """Reserve the call's worst case (at least ``reservation_usd``) or raise BudgetRefused.

        ``worst_case_usd`` None means the worst case is unknown (no price): refused
        whenever a USD limit applies, since nothing would bound the charge. ``free``: a
        call no upstream bills (Anthropic's count_tokens) still reaches one, so it counts
        against the call caps, and reserves nothing.
        """
        with self._lock:
            try:
                return self._admit(role, 0.0 if free else worst_case_usd, free=free)
            except BudgetRefused as exc:
                self.last_refusal = exc.reason
                raise

    def _admit(self, role: str, worst_case_usd: float | None, *, free: bool) -> Reservation:
        """Under self._lock (see admit)."""
        p = self.policy
        acct = self._roles.setdefault(role, _Account())
        if self.halted:
            raise BudgetRefused(f"admission halted: {self.halted}")
        if p.max_calls is not None and self._total.calls + 1 > p.max_calls:
            raise BudgetRefused(f"max_calls {p.max_calls} reached")
        role_calls = p.per_role_calls.get(role)
        if role_calls is not None and acct.calls + 1 > role_calls:
            raise BudgetRefused(f"per-role max_calls {role_calls} reached for {role}")
        role_cap = p.per_role_usd.get(role)
        if worst_case_usd is None and (p.limit_usd is not None or role_cap is not None):
            raise BudgetRefused("worst case unknown (no price for the model) under a "
                                "USD limit; add the model to the upstream's prices")
        amount = 0.0 if free else max(p.reservation_usd, worst_case_usd or 0.0)
        self._check(self._total, amount, p.limit_usd, "limit_usd")
        if role_cap is not None:
            self._check(acct, amount, role_cap, "per-role limit_usd", f" for {role}")
        res = Reservation(id=next(self._ids), role=role, amount=amount)
        for a in (self._total, acct):
            a.calls += 1
            a.reserved += amount
        self._open[res.id] = res
        return res

    @staticmethod
    def _check(acct: _Account, amount: float, limit: float | None, what: str,
               who: str = "") -> None:
        if limit is not None and acct.spent + acct.reserved + amount > limit + 1e-12:
            raise BudgetRefused(f"{what} {limit} would be exceeded{who} by this call's worst case "
                                f"{amount:.6f} (spent {acct.spent:.6f}, reserved "
                                f"{acct.reserved:.6f})")

    def settle(self, res: Reservation, cost_usd: float | None, *,
               upper_bound: bool = False) -> None:
        """Release the reservation and charge the cost; None means the cost is unknown.
        ``upper_bound``: the cost is the call's admitted worst case, charged because the
        call ended without usage (counted in ``bounded_calls``)."""
        with self._lock:
            if self._open.pop(res.id, None) is None:
                raise ValueError(f"reservation {res.id} settled twice")
            acct = self._roles[res.role]
            for a in (self._total, acct):
                a.reserved -= res.amount
                a.bounded_calls += int(upper_bound and cost_usd is not None)
                if cost_usd is None:
                    a.unknown_cost_calls += 1
                else:
                    a.spent += cost_usd
            if cost_usd is None:
                self.halted = self.halted or f"unknown cost for a {res.role} call"
            elif cost_usd > res.amount + 1e-12:
                self.halted = self.halted or (f"a {res.role} call cost {cost_usd:.6f} USD, above "
                                              f"its reservation {res.amount:.6f}")

    def halt(self, reason: str) -> None:
        """Stop admission for good (the first reason stays)."""
        with self._lock:
            self.halted = self.halted or reason

    def release(self, res: Reservation) -> None:
        """Undo an admission for a call that never reached an upstream (no charge)."""
        with self._lock:
            if self._open.pop(res.id, None) is None:
                return
            for a in (self._total, self._roles[res.role]):
                a.reserved -= res.amount
                a.calls -= 1

    def totals(self) -> dict[str, object]:
        """Spend and calls overall and per role, each with ``complete``."""
        with self._lock:
            def row(a: _Account) -> dict[str, object]:
                return {"spent_usd": round(a.spent, 9), "calls": a.calls,
                        "unknown_cost_calls": a.unknown_cost_calls,
                        "bounded_calls": a.bounded_calls,
                        "complete": a.unknown_cost_calls == 0 and a.reserved < 1e-12}
            return {"total": row(self._total), "halted": self.halted,
                    "per_role": {r: row(a) for r, a in sorted(self._roles.items())}}
