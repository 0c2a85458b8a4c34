"""Attacks on the run budget through the gateway: worst-case admission and request vetting.

The upstream reports usage at the worst case a request allows (every request byte an
input token, n x max tokens out), so a flat or partial reservation shows up as spend
over the USD limit. Each test fails when the attack gets through.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from runner.gateway.budget import BudgetPolicy, RunBudget
from runner.gateway.calllog import CallLog, CallRecord
from runner.gateway.config import UpstreamPolicy, parse_upstream
from runner.gateway.server import Gateway
from sandbox.gateway_client import client
from tests.fixtures.gateway_upstreams import Upstream, upstream

PRICE = {"input_per_mtok": 10.0, "output_per_mtok": 30.0}


@pytest.fixture
def worst(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Upstream]]:
    monkeypatch.setenv("CBX_BUDGET_KEY", "sk-budget")
    with upstream() as u:
        yield u


def policy(url: str, **kw: Any) -> UpstreamPolicy:
    return parse_upstream({
        "provider": "openai", "base_url": url, "credential": {"env": "CBX_BUDGET_KEY"},
        "models": ["worst-m"], "max_tokens": 1000, "prices": {"worst-m": PRICE},
        "limits": {"rate_per_s": 1e6, "burst": 10**6}, **kw})


def run(tmp_path: Path, up: UpstreamPolicy, limit: float, bodies: list[bytes],
        threads: int = 1, gateways: int = 1) -> tuple[list[int], list[CallRecord], RunBudget]:
    """Post ``bodies`` on ``threads`` connections, spread over ``gateways`` gateways (each
    with its own event loop) that share one budget."""
    budget = RunBudget(BudgetPolicy(limit_usd=limit, reservation_usd=0.0001))
    statuses: list[int] = []
    lock = threading.Lock()
    dirs = [tmp_path if gateways == 1 else tmp_path / f"gw{g}" for g in range(gateways)]
    with contextlib.ExitStack() as stack:
        socks: list[tuple[Path, str]] = []
        for d in dirs:
            d.mkdir(exist_ok=True)
            gw = stack.enter_context(Gateway(d, "b", {"target": up}, {"analyst": "target"},
                                             budget))
            b = stack.enter_context(gw.bound("analyst", stage="s", uid=os.getuid()))
            socks.append((b.directory / "gateway.sock", gw.token_for("analyst")))

        def worker(mine: list[bytes], sock: Path, token: str) -> None:
            with httpx2.Client(transport=httpx2.HTTPTransport(uds=str(sock)),
                               timeout=60) as c:
                for body in mine:
                    r = c.post("http://gw/v1/chat/completions", content=body,
                               headers={"Authorization": f"Bearer {token}"})
                    with lock:
                        statuses.append(r.status_code)

        ts = [threading.Thread(target=worker, args=(bodies[i::threads], *socks[i % gateways]))
              for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return statuses, [r for d in dirs for r in CallLog(d / "gateway").records()], budget


def spent(budget: RunBudget) -> float:
    return float(budget.totals()["total"]["spent_usd"])  # type: ignore[index,arg-type]


def msg(content: str = "hi", **extra: Any) -> bytes:
    import json
    return json.dumps({"model": "worst-m", "messages": [{"role": "user", "content": content}],
                       **extra}).encode()


def test_n_128_is_refused_and_reserved_at_its_worst_case_when_allowed(
        tmp_path: Path, worst: tuple[str, Upstream]) -> None:
    url, srv = worst
    st, recs, _ = run(tmp_path / "a", policy(url), 10.0, [msg(n=128)])
    assert st == [400] and recs[0].error == "n_not_allowed" and not srv.requests
    # Allowed by policy: 128 x 1000 tokens x 30 USD/M = 3.84 USD worst case > 1 USD limit.
    st, recs, budget = run(tmp_path / "b", policy(url, rules={"max_n": 128}), 1.0,
                           [msg(n=128)] * 3)
    assert st == [429] * 3 and {r.error for r in recs} == {"budget"}
    assert not srv.requests and spent(budget) == 0.0
    st, recs, budget = run(tmp_path / "c", policy(url, rules={"max_n": 128}), 10.0,
                           [msg(n=128)] * 4)
    assert st.count(200) == 2 and spent(budget) <= 10.0, "n x max_tokens not reserved"


def test_4mb_prompt_cannot_overshoot_the_limit(tmp_path: Path,
                                               worst: tuple[str, Upstream]) -> None:
    url, _ = worst
    big = msg("x" * (4_000_000 - 100))  # ~40 USD of input at 10 USD/M if every byte bills
    st, _recs, budget = run(tmp_path, policy(url), 100.0, [big] * 4)
    overshoot = spent(budget) - 100.0
    print(f"4 MB prompts: spent {spent(budget):.4f} of 100 USD, overshoot {max(0, overshoot)}")
    assert st.count(200) == 2 and st.count(429) == 2
    assert overshoot <= 0 and budget.halted is None


@pytest.mark.parametrize("extra", [
    {"max_completion_tokens": 1000, "max_tokens": 10**9},
    {"max_tokens": 1000, "max_completion_tokens": 10**9},
    {"max_tokens": 1e9}, {"max_tokens": "99999"}, {"max_tokens": True}, {"max_tokens": 0},
    {"max_tokens": -1}, {"max_completion_tokens": None, "max_tokens": 1001},
])
def test_max_tokens_tricks_are_refused(tmp_path: Path, worst: tuple[str, Upstream],
                                       extra: dict[str, Any]) -> None:
    url, srv = worst
    st, recs, _ = run(tmp_path, policy(url), 10.0, [msg(**extra)])
    assert st == [400] and recs[0].error == "max_tokens_over_cap" and not srv.requests


def test_missing_max_tokens_is_set_to_the_cap(tmp_path: Path,
                                              worst: tuple[str, Upstream]) -> None:
    url, srv = worst
    st, _, budget = run(tmp_path, policy(url), 10.0, [msg()])
    assert st == [200] and srv.requests[0]["max_tokens"] == 1000
    assert spent(budget) == pytest.approx((len(msg()) + 15) * 10e-6 + 1000 * 30e-6, rel=0.2)


def test_concurrent_calls_never_overshoot(tmp_path: Path, worst: tuple[str, Upstream]) -> None:
    """Calls in flight at once (one gateway: admitted one at a time on its event loop,
    then awaiting the upstream together) are held at their worst case until they settle:
    admission that reserved nothing would overshoot here. It cannot see the budget's lock
    (one loop never admits two calls at once); the next test can."""
    url, _ = worst
    # Each call's worst case is ~0.03 USD; 64 calls on 16 connections against 0.25 USD.
    st, _recs, budget = run(tmp_path, policy(url), 0.25, [msg()] * 64, threads=16)
    overshoot = spent(budget) - 0.25
    print(f"concurrent: {st.count(200)} admitted, spent {spent(budget):.6f} of 0.25 USD, "
          f"worst overshoot {max(0.0, overshoot)}")
    assert overshoot <= 1e-12
    assert st.count(200) + st.count(429) == 64 and st.count(429) > 0
    assert budget.halted is None, "a charge above its reservation got through"


def test_gateways_sharing_a_budget_never_overshoot(tmp_path: Path, worst: tuple[str, Upstream],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget is shared and thread-safe by contract: two gateways, each admitting on
    its own event-loop thread, race for one limit. The last call that fits waits (up to
    2 s) between its check and its reservation for a second admission to pass its check
    too, as the lock must prevent: without ``RunBudget``'s lock both are admitted and
    spend plus open reservations pass the limit; with it the second one waits for the
    first's reservation and is refused."""
    url, _ = worst
    check, admit = RunBudget._check, RunBudget.admit
    boundary = threading.Barrier(2, timeout=2)
    committed: list[float] = []

    def racing_check(acct: Any, amount: float, limit: float | None, *rest: str) -> None:
        check(acct, amount, limit, *rest)
        if limit is not None and acct.spent + acct.reserved + 2 * amount > limit:
            with contextlib.suppress(threading.BrokenBarrierError):
                boundary.wait()  # fits, but a second one would not: wait for a rival

    def watched_admit(self: RunBudget, role: str, worst_case_usd: float | None = 0.0,
                      **kw: Any) -> Any:
        res = admit(self, role, worst_case_usd, **kw)
        committed.append(self._total.spent + self._total.reserved)
        return res

    monkeypatch.setattr(RunBudget, "_check", staticmethod(racing_check))
    monkeypatch.setattr(RunBudget, "admit", watched_admit)
    st, _recs, budget = run(tmp_path, policy(url), 0.25, [msg()] * 64, threads=16, gateways=2)
    print(f"two gateways: {st.count(200)} admitted, spent {spent(budget):.6f}, at most "
          f"{max(committed):.6f} committed of 0.25 USD")
    assert max(committed) <= 0.25 + 1e-12, "spend plus open reservations passed the limit"
    assert spent(budget) <= 0.25 + 1e-12
    assert st.count(200) + st.count(429) == 64 and st.count(429) > 0


@pytest.mark.parametrize(("extra", "code"), [
    ({"service_tier": "priority"}, "service_tier_not_allowed"),
    ({"store": True}, "field_not_allowed"),
    ({"web_search_options": {}}, "field_not_allowed"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools_not_allowed"),
    ({"functions": [{"name": "f"}]}, "field_not_allowed"),
    ({"best_of": 64}, "field_not_allowed"),
    ({"modalities": ["audio"], "audio": {"voice": "x"}}, "field_not_allowed"),
    ({"prediction": {"type": "content", "content": "x"}}, "field_not_allowed"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://attacker.example/x.png"}}]}]},
     "remote_content_not_allowed"),
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
     "content_part_not_allowed"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "images_not_allowed"),
    ({"stream": "yes"}, "bad_request"),
])
def test_unvetted_fields_are_refused(tmp_path: Path, worst: tuple[str, Upstream],
                                     extra: dict[str, Any], code: str) -> None:
    url, srv = worst
    st, recs, _ = run(tmp_path, policy(url), 10.0, [msg(**extra)])
    assert st == [400] and [r.error for r in recs] == [code]
    assert not srv.requests, "an unvetted field reached the upstream"


def test_tools_when_allowed_are_functions_only(tmp_path: Path,
                                               worst: tuple[str, Upstream]) -> None:
    url, srv = worst
    up = policy(url, rules={"allow_tools": True})
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    st, recs, _ = run(tmp_path, up, 10.0, [msg(tools=[{"type": "web_search"}]),
                                           msg(tools=[fn])])
    assert st == [400, 200] and recs[0].error == "tool_not_allowed"
    assert len(srv.requests) == 1 and srv.requests[0]["tools"] == [fn]


def test_unknown_price_is_refused_under_a_limit(tmp_path: Path,
                                                worst: tuple[str, Upstream]) -> None:
    url, srv = worst
    up = policy(url).model_copy(update={"prices": {}})
    st, recs, _ = run(tmp_path, up, 10.0, [msg()])
    assert st == [429] and recs[0].error == "budget" and not srv.requests


def test_sdk_sees_named_refusals(tmp_path: Path, worst: tuple[str, Upstream]) -> None:
    url, _ = worst
    with Gateway(tmp_path, "b", {"target": policy(url)}, {"analyst": "target"}) as gw, \
            gw.bound("analyst", stage="s", uid=os.getuid()) as b, \
            pytest.raises(openai.BadRequestError, match="service_tier"):
        client(gateway_dir=b.directory).chat.completions.create(
            model="worst-m", service_tier="priority",
            messages=[{"role": "user", "content": "x"}])
