"""The gateway on the host with the real openai SDK over its unix socket (no containers).

Covers replay, budget admission under concurrency, unknown-cost halting and caps.
Container-side behaviour is in test_gateway_containers.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest

from runner.gateway.budget import BudgetPolicy, RunBudget
from runner.gateway.calllog import CallLog
from runner.gateway.config import UpstreamPolicy, parse_upstream
from runner.gateway.report import summarize
from runner.gateway.server import Gateway
from sandbox.gateway_client import client
from tests.fixtures.fake_upstream import serve

SCRIPT = Path(__file__).resolve().parents[2] / "policies" / "scripts" / "default.yaml"


def scripted(**kw: object) -> UpstreamPolicy:
    return parse_upstream({"provider": "scripted", "script": str(SCRIPT),
                                          "models": ["m"], "prices": {"m": {
                                              "input_per_mtok": 1.0, "output_per_mtok": 1.0}},
                                          **kw})


@pytest.fixture
def upstream() -> Iterator[int]:
    srv = serve("127.0.0.1", 0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()


def _raw_post(directory: Path, token: str, body: bytes) -> httpx2.Response:
    with httpx2.Client(transport=httpx2.HTTPTransport(uds=str(directory / "gateway.sock"))) as c:
        return c.post("http://gw/v1/chat/completions", content=body,
                      headers={"Authorization": f"Bearer {token}",
                               "Content-Type": "application/json"})


def test_replay_is_byte_exact_and_fails_closed(tmp_path: Path) -> None:
    rec_dir = tmp_path / "recorded"
    bodies = [b'{"model":"m","messages":[{"role":"user","content":"ping"}]}',
              b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}']
    with Gateway(rec_dir, "rec", {"target": scripted()}, {"analyst": "target"}) as gw, \
            gw.bound("analyst", stage="s", uid=10001) as b:
        first = [_raw_post(b.directory, gw.token_for("analyst"), body).content
                 for body in bodies]
    with Gateway(tmp_path / "replayed", "rep",
                 {"target": scripted(provider="replay", replay_from=str(rec_dir), script=None)},
                 {"analyst": "target"}) as gw, gw.bound("analyst", stage="s", uid=10001) as b:
        again = [_raw_post(b.directory, gw.token_for("analyst"), body).content
                 for body in bodies]
        miss = _raw_post(b.directory, gw.token_for("analyst"),
                         b'{"model":"m","messages":[{"role":"user","content":"new"}]}')
    assert again == first
    assert miss.status_code == 502 and miss.json()["error"]["code"] == "replay_miss"
    recs = CallLog(tmp_path / "replayed" / "gateway").records()
    assert [r.status for r in recs] == ["ok", "ok", "infra_error"]
    assert recs[2].error == "replay_miss"
    orig = CallLog(rec_dir / "gateway").records()
    assert [r.request_sha256 for r in recs[:2]] == [r.request_sha256 for r in orig]
    assert [r.response_sha256 for r in recs[:2]] == [r.response_sha256 for r in orig]


def test_concurrent_calls_respect_max_calls_and_limit(tmp_path: Path) -> None:
    budget = RunBudget(BudgetPolicy(limit_usd=1.0, max_calls=12, reservation_usd=0.001))
    results: list[str] = []
    lock = threading.Lock()
    with Gateway(tmp_path, "b", {"target": scripted()}, {"analyst": "target"}, budget) as gw, \
            gw.bound("analyst", stage="s", uid=10001) as b:
        def worker() -> None:
            c = client(gateway_dir=b.directory)
            for _ in range(5):
                try:
                    c.chat.completions.create(model="m",
                                              messages=[{"role": "user", "content": "ping"}])
                    outcome = "ok"
                except openai.RateLimitError as exc:
                    outcome = "refused:" + str(exc.body)
                with lock:
                    results.append(outcome)

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results.count("ok") == 12
    assert len(results) == 40
    assert all("max_calls 12" in r for r in results if r != "ok")
    recs = CallLog(tmp_path / "gateway").records()
    assert sum(r.status == "ok" for r in recs) == 12
    assert {r.error for r in recs if r.status == "refused"} == {"budget"}
    assert budget.totals()["total"]["spent_usd"] <= 1.0  # type: ignore[index,operator]


def test_call_without_usage_is_charged_its_worst_case_and_the_run_goes_on(
        tmp_path: Path, upstream: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CBX_KEY_NOUSAGE", "sk-test")
    price = {"input_per_mtok": 1, "output_per_mtok": 1}
    up = parse_upstream({
        "provider": "openai", "base_url": f"http://127.0.0.1:{upstream}/v1",
        "credential": {"env": "CBX_KEY_NOUSAGE"}, "max_tokens": 100,
        "models": ["nousage-x", "ok-x", "nousage-unpriced"],
        "prices": {"nousage-x": price, "ok-x": price}})
    budget = RunBudget(BudgetPolicy(reservation_usd=0.0))
    msg = [{"role": "user", "content": "a"}]
    with Gateway(tmp_path, "u", {"target": up}, {"analyst": "target"}, budget) as gw, \
            gw.bound("analyst", stage="s", uid=10001) as b:
        c = client(gateway_dir=b.directory)
        c.chat.completions.create(model="ok-x", messages=msg)
        c.chat.completions.create(model="nousage-x", messages=msg)
        c.chat.completions.create(model="ok-x", messages=msg)  # admission goes on
        c.chat.completions.create(model="nousage-unpriced", messages=msg)  # no price: unknown
        with pytest.raises(openai.RateLimitError, match="unknown cost"):
            c.chat.completions.create(model="ok-x", messages=[{"role": "user", "content": "b"}])
    recs = CallLog(tmp_path / "gateway").records()
    assert [r.status for r in recs] == ["ok", "ok", "ok", "ok", "refused"]
    assert [r.cost_basis for r in recs] == ["measured", "upper_bound", "measured", None, None]
    sent = CallLog(tmp_path / "gateway").blob(recs[1].request_sha256)
    # the worst case: every sent byte (plus the template margin) an input token at the
    # dearest input price (a cache write's, 1.25 times the input price), 100 output
    assert recs[1].cost_usd == pytest.approx(((len(sent) + 64) * 1.25 + 100) / 1e6)
    totals = summarize(recs)
    assert totals.total.bounded_calls == 1
    assert totals.total.complete is False and totals.total.cost_usd is None
    assert totals.total.cost_usd_known_part is not None
    tot = budget.totals()["total"]
    assert tot["complete"] is False and tot["bounded_calls"] == 1  # type: ignore[index]
    assert budget.halted == "unknown cost for a analyst call"


def test_max_tokens_cap_and_bad_requests(tmp_path: Path) -> None:
    with Gateway(tmp_path, "c", {"target": scripted(max_tokens=100)}, {"analyst": "target"},
                 ) as gw, gw.bound("analyst", stage="s", uid=10001) as b:
        c = client(gateway_dir=b.directory)
        with pytest.raises(openai.BadRequestError, match="exceeds the cap 100"):
            c.chat.completions.create(model="m", max_tokens=101,
                                      messages=[{"role": "user", "content": "x"}])
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        bad = _raw_post(b.directory, gw.token_for("analyst"), b'{"model": NaN}')
        assert bad.status_code == 400
    recs = CallLog(tmp_path / "gateway").records()
    assert [r.error for r in recs] == ["max_tokens_over_cap", None, "bad_request"]
    sent = CallLog(tmp_path / "gateway").blob(recs[1].request_sha256)
    assert b'"max_tokens":100' in sent  # the cap is filled in when the role sets none


def test_chunked_stream_from_a_real_upstream_is_recorded_dechunked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.fixtures.gateway_upstreams import upstream as hostile_upstream

    monkeypatch.setenv("CBX_KEY_CHUNKED", "sk-chunked")
    with hostile_upstream() as (url, _srv):
        up = parse_upstream({
            "provider": "openai", "base_url": url, "credential": {"env": "CBX_KEY_CHUNKED"},
            "models": ["chunked-m"], "prices": {"chunked-m": {"input_per_mtok": 1,
                                                              "output_per_mtok": 1}}})
        with Gateway(tmp_path, "ch", {"target": up}, {"analyst": "target"}) as gw, \
                gw.bound("analyst", stage="s", uid=10001) as b:
            c = client(gateway_dir=b.directory)
            for _ in range(2):  # the second call reuses the kept-alive upstream connection
                text = "".join(ch.choices[0].delta.content or "" for ch in
                               c.chat.completions.create(model="chunked-m", stream=True,
                                                         messages=[{"role": "user",
                                                                    "content": "hi"}])
                               if ch.choices)
                assert text == "hello"
    recs = CallLog(tmp_path / "gateway").records()
    assert [(r.status, r.usage.total_tokens if r.usage else None) for r in recs] == [
        ("ok", 5), ("ok", 5)]
    body = CallLog(tmp_path / "gateway").blob(recs[0].response_sha256 or "")
    assert body.startswith(b"data: {") and body.endswith(b"data: [DONE]\n\n")
