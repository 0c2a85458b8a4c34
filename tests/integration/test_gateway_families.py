"""Every API family through a live gateway with the real SDKs (``openai``, ``anthropic``)
over its unix socket: scripted shapes parsed by the SDKs' own parsers (streams too), tool
calls and tool results, usage and cost per family, byte-exact replay, token headers,
routes an upstream does not serve, an Anthropic upstream, and the worker and dream relay
in each family."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from runner.gateway.calllog import CallLog, CallRecord
from runner.gateway.config import UpstreamPolicy, parse_upstream
from runner.gateway.report import summarize
from runner.gateway.server import Binding, Gateway
from tests.fixtures.gateway_upstreams import upstream

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "fixtures" / "families_script.yaml"
PRICE = {"input_per_mtok": 1.0, "output_per_mtok": 2.0}
OAI_TOOLS: Any = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]
RESP_TOOLS: Any = [{"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}]
ANT_TOOLS: Any = [{"name": "get_weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}}}]


def scripted(**kw: Any) -> UpstreamPolicy:
    return parse_upstream({"provider": "scripted", "script": str(SCRIPT), "models": ["m"],
                           "prices": {"m": PRICE}, "rules": {"allow_tools": True}, **kw})


def openai_client(gw: Gateway, b: Binding, role: str = "analyst") -> openai.OpenAI:
    http = openai.DefaultHttpx2Client(
        transport=httpx2.HTTPTransport(uds=str(b.directory / "gateway.sock")))
    return openai.OpenAI(api_key=gw.token_for(role), base_url="http://gw/v1", max_retries=0,
                         http_client=http)


def anthropic_client(gw: Gateway, b: Binding, role: str = "analyst") -> anthropic.Anthropic:
    http = anthropic.DefaultHttpxClient(
        transport=httpx2.HTTPTransport(uds=str(b.directory / "gateway.sock")))
    return anthropic.Anthropic(api_key=gw.token_for(role), base_url="http://gw",
                               max_retries=0, http_client=http)


def every_family(gw: Gateway, b: Binding) -> dict[str, Any]:
    """One conversation with a tool call per family, streamed and not, plus embeddings
    and token counting; returns what the SDKs parsed."""
    oc, ac = openai_client(gw, b), anthropic_client(gw, b)
    got: dict[str, Any] = {}
    ask = [{"role": "user", "content": "weather in Paris?"}]
    # chat: tool call, streamed tool call, then the tool result
    r = oc.chat.completions.create(model="m", messages=ask, tools=OAI_TOOLS)  # type: ignore[arg-type]
    call = (r.choices[0].message.tool_calls or [])[0]
    got["chat_tool"] = (call.function.name, json.loads(call.function.arguments))  # type: ignore[union-attr]
    chunks = list(oc.chat.completions.create(model="m", messages=ask,  # type: ignore[arg-type]
                                             tools=OAI_TOOLS, stream=True))
    got["chat_stream_args"] = "".join(
        (c.choices[0].delta.tool_calls or [])[0].function.arguments or ""  # type: ignore[union-attr]
        for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    got["chat_stream_usage"] = chunks[-1].usage
    follow: Any = [*ask, r.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    got["chat_after_tool"] = oc.chat.completions.create(
        model="m", messages=follow, tools=OAI_TOOLS).choices[0].message.content
    # responses: function_call item, a stream, then function_call_output
    resp = oc.responses.create(model="m", input="weather in Paris?", tools=RESP_TOOLS)
    item = resp.output[0]
    got["responses_tool"] = (item.type, getattr(item, "name", None))
    with oc.responses.stream(model="m", input="hello") as st:
        for _ in st:
            pass
        final = st.get_final_response()
    got["responses_stream"] = (final.output_text, final.usage.total_tokens if final.usage
                               else None)
    after: Any = [{"role": "user", "content": "weather in Paris?"}, item.model_dump(
        exclude_none=True, include={"type", "call_id", "name", "arguments"}),
        {"type": "function_call_output", "call_id": getattr(item, "call_id", ""),
         "output": "sunny"}]
    got["responses_after_tool"] = oc.responses.create(model="m", input=after,
                                                      tools=RESP_TOOLS).output_text
    # embeddings (the SDK asks for base64 by default and decodes it)
    e = oc.embeddings.create(model="m", input=["a", "b"])
    got["embeddings"] = [len(d.embedding) for d in e.data]
    got["embedding_a"] = e.data[0].embedding
    # messages: text, a streamed tool_use, the tool_result, and count_tokens
    m = ac.messages.create(model="m", max_tokens=50, messages=[{"role": "user",
                                                                "content": "hi"}])
    got["messages_text"] = m.content[0].text  # type: ignore[union-attr]
    with ac.messages.stream(model="m", max_tokens=50, tools=ANT_TOOLS,
                            messages=[{"role": "user", "content": "weather in Paris?"}]) as ms:
        fm = ms.get_final_message()
    got["messages_stream"] = (fm.stop_reason, fm.content[0].input,  # type: ignore[union-attr]
                              fm.usage.output_tokens)
    m2 = ac.messages.create(model="m", max_tokens=50, tools=ANT_TOOLS, messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": fm.content},  # type: ignore[typeddict-item]
        {"role": "user", "content": [{"type": "tool_result", "content": "sunny",
                                      "tool_use_id": fm.content[0].id}]}])  # type: ignore[union-attr]
    got["messages_after_tool"] = m2.content[0].text  # type: ignore[union-attr]
    got["count_tokens"] = ac.messages.count_tokens(
        model="m", messages=[{"role": "user", "content": "hi"}]).input_tokens
    return got


def test_every_family_through_the_real_sdks_then_replay_is_byte_exact(tmp_path: Path) -> None:
    rec_dir = tmp_path / "recorded"
    with Gateway(rec_dir, "rec", {"target": scripted()}, {"analyst": "target"}) as gw, \
            gw.bound("analyst", stage="s", uid=os.getuid()) as b:
        got = every_family(gw, b)
    assert got["chat_tool"] == ("get_weather", {"city": "Paris"})
    assert json.loads(got["chat_stream_args"]) == {"city": "Paris"}
    assert got["chat_stream_usage"].total_tokens > 0
    assert got["chat_after_tool"] == "It is sunny in Paris."
    assert got["responses_tool"] == ("function_call", "get_weather")
    assert got["responses_stream"][0] == "plain reply" and got["responses_stream"][1] > 0
    assert got["responses_after_tool"] == "It is sunny in Paris."
    assert got["embeddings"] == [8, 8]
    assert got["messages_text"] == "hello from messages"
    assert got["messages_stream"][:2] == ("tool_use", {"city": "Paris"})
    assert got["messages_after_tool"] == "It is sunny in Paris."
    assert got["count_tokens"] >= 1
    recs = CallLog(rec_dir / "gateway").records()
    assert [r.api for r in recs] == ["chat"] * 3 + ["responses"] * 3 + ["embeddings"] + [
        "messages"] * 3 + ["count_tokens"]
    assert all(r.status == "ok" and r.fixture for r in recs)
    assert [r.stream for r in recs] == [False, True, False, False, True, False, False, False,
                                        True, False, False]
    for r in recs:
        assert r.cost_basis == "measured"
        if r.api == "count_tokens":
            assert r.cost_usd == 0.0 and r.usage is None
        else:
            assert r.usage is not None and r.cost_usd == pytest.approx(
                (r.usage.prompt_tokens * 1.0 + r.usage.completion_tokens * 2.0) / 1e6)
    assert recs[6].usage is not None and recs[6].usage.completion_tokens == 0  # embeddings
    # replay: the same SDK calls get the recorded bytes back, family by family
    rep_dir = tmp_path / "replayed"
    up = scripted(provider="replay", replay_from=str(rec_dir), script=None)
    with Gateway(rep_dir, "rep", {"target": up}, {"analyst": "target"}) as gw, \
            gw.bound("analyst", stage="s", uid=os.getuid()) as b:
        again = every_family(gw, b)
    assert again == got
    replayed = CallLog(rep_dir / "gateway").records()
    assert [(r.api, r.request_sha256, r.response_sha256) for r in replayed] == [
        (r.api, r.request_sha256, r.response_sha256) for r in recs]
    assert [r.usage for r in replayed] == [r.usage for r in recs]


def test_embeddings_are_deterministic_from_the_input(tmp_path: Path) -> None:
    with Gateway(tmp_path, "e", {"target": scripted()}, {"analyst": "target"}) as gw, \
            gw.bound("analyst", stage="s", uid=os.getuid()) as b:
        oc = openai_client(gw, b)
        one = oc.embeddings.create(model="m", input="same", dimensions=16)
        two = oc.embeddings.create(model="m", input=["same", "other"], dimensions=16,
                                   encoding_format="float")
    assert one.data[0].embedding == pytest.approx(two.data[0].embedding, abs=1e-6)
    assert two.data[0].embedding != two.data[1].embedding
    assert len(one.data[0].embedding) == 16


def _post(b: Binding, path: str, headers: dict[str, str], body: object) -> httpx2.Response:
    with httpx2.Client(transport=httpx2.HTTPTransport(
            uds=str(b.directory / "gateway.sock"))) as c:
        return c.post(f"http://gw{path}", content=json.dumps(body),
                      headers={"content-type": "application/json", **headers})


def test_token_as_bearer_or_x_api_key_and_both_must_agree(tmp_path: Path) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with Gateway(tmp_path, "t", {"target": scripted()}, {"analyst": "target"}) as gw, \
            gw.bound("analyst", stage="s", uid=os.getuid()) as b:
        tok = gw.token_for("analyst")
        statuses = [_post(b, "/v1/chat/completions", h, body).status_code for h in (
            {"authorization": f"Bearer {tok}"}, {"x-api-key": tok},
            {"authorization": f"Bearer {tok}", "x-api-key": tok},
            {"authorization": f"Bearer {tok}", "x-api-key": tok + "x"},
            {"authorization": "Bearer nope", "x-api-key": tok},
            {"authorization": tok}, {})]
        ant = _post(b, "/v1/messages", {"x-api-key": "wrong"},
                    {**body, "max_tokens": 5})
    assert statuses == [200, 200, 200, 401, 401, 401, 401]
    assert ant.status_code == 401
    assert ant.json()["type"] == "error"
    assert ant.json()["error"]["type"] == "authentication_error"
    recs = CallLog(tmp_path / "gateway").records()
    assert [r.error for r in recs if r.status == "refused"] == ["bad_token"] * 5
    assert recs[-1].api == "messages"


@pytest.fixture
def dead_upstreams(monkeypatch: pytest.MonkeyPatch) -> dict[str, UpstreamPolicy]:
    monkeypatch.setenv("CBX_DEAD_KEY", "sk-never-used")
    common = {"base_url": "http://127.0.0.1:9", "credential": {"env": "CBX_DEAD_KEY"},
              "models": ["m"], "prices": {"m": PRICE}}
    return {"oai": parse_upstream({"provider": "openai", **common}),
            "ant": parse_upstream({"provider": "anthropic", **common})}


def test_a_route_the_upstream_does_not_serve_is_a_404_in_the_family_shape(
        tmp_path: Path, dead_upstreams: dict[str, UpstreamPolicy]) -> None:
    with Gateway(tmp_path, "r", dead_upstreams, {"analyst": "oai", "worker": "ant"}) as gw, \
            gw.bound("analyst", stage="s", uid=os.getuid()) as a, \
            gw.bound("worker", stage="s", uid=os.getuid()) as w:
        with pytest.raises(anthropic.NotFoundError) as ant_err:
            anthropic_client(gw, a).messages.create(
                model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.NotFoundError) as oai_err:
            openai_client(gw, w, "worker").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.NotFoundError):
            openai_client(gw, w, "worker").responses.create(model="m", input="hi")
    assert "/v1/messages is not served by upstream oai" in str(ant_err.value)
    assert "provider openai" in str(ant_err.value)
    assert ant_err.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert "/v1/chat/completions is not served by upstream ant" in str(oai_err.value)
    assert oai_err.value.code == "route_not_served"
    recs = CallLog(tmp_path / "gateway").records()
    assert [(r.status, r.error, r.api) for r in recs] == [
        ("refused", "route_not_served", "messages"), ("refused", "route_not_served", "chat"),
        ("refused", "route_not_served", "responses")]


def test_anthropic_upstream_gets_host_headers_never_the_role_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CBX_ANT_KEY", "sk-ant-host-only")
    with upstream() as (url, srv):
        up = parse_upstream({"provider": "anthropic", "base_url": url.removesuffix("/v1"),
                             "credential": {"env": "CBX_ANT_KEY"}, "models": ["claude-x"],
                             "anthropic_version": "2023-06-01",
                             "prices": {"claude-x": {"input_per_mtok": 3, "output_per_mtok": 15,
                                                     "cache_write_per_mtok": 3.75,
                                                     "cached_input_per_mtok": 0.3}}})
        with Gateway(tmp_path, "a", {"target": up}, {"analyst": "target"}) as gw, \
                gw.bound("analyst", stage="s", uid=os.getuid()) as b:
            m = anthropic_client(gw, b).messages.create(
                model="claude-x", max_tokens=100,
                messages=[{"role": "user", "content": "Hello, Claude"}])
            token = gw.token_for("analyst")
    assert m.content[0].text == "Hi! My name is Claude."  # type: ignore[union-attr]
    h = srv.headers[0]
    assert h["x-api-key"] == "sk-ant-host-only" and h["anthropic-version"] == "2023-06-01"
    assert "authorization" not in h and token not in json.dumps(srv.headers)
    assert srv.requests[0]["max_tokens"] == 100
    rec = CallLog(tmp_path / "gateway").records()[0]
    assert rec.api == "messages" and rec.provider == "anthropic" and rec.cost_basis == "measured"
    assert rec.usage is not None and rec.usage.prompt_tokens == 2095
    assert rec.cost_usd == pytest.approx((2095 * 3 + 6 * 15) / 1e6)


@pytest.fixture
def worker_dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    yield tmp_path / "in", tmp_path / "out"


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_worker_and_relay_speak_the_optimizer_family(
        api: str, tmp_path: Path, worker_dirs: tuple[Path, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sandbox import gateway_client, relay, worker

    script = tmp_path / "w.yaml"
    script.write_text(json.dumps({"schema": 1, "rules": [
        {"when": {"role": "worker", "contains": ["Failure brief"], "api": api},
         "reply_json": {"files": [{"path": "prompt.md", "content": "new\n"}],
                        "rationale": "r"}}],
        "default": {"reply": f"relay reply via {api}"}}))
    up = parse_upstream({"provider": "scripted", "script": str(script), "models": ["m"],
                         "prices": {"m": PRICE}})
    in_dir, out_dir = worker_dirs
    (in_dir / "request.json").write_text(json.dumps({
        "brief": "fix it", "paths": ["prompt.md"], "allowlist": ["prompt.md"],
        "files": [{"path": "prompt.md", "content": "old\n", "sha256": "0" * 64}],
        "model": "m", "max_tokens": 200}))
    (in_dir / "calls.json").write_text(json.dumps({"model": "m", "max_tokens": 50, "calls": [
        {"id": "c1", "messages": [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "vary this"}]}]}))
    monkeypatch.setenv("CYCLEBOX_API", api)
    with Gateway(tmp_path / "run", "w", {"optimizer": up}, {"worker": "optimizer"}) as gw, \
            gw.bound("worker", stage="propose", uid=os.getuid()) as b:
        monkeypatch.setattr(gateway_client, "GATEWAY_DIR", b.directory)
        assert worker.main(in_dir, out_dir) == 0
        assert relay.main(in_dir, out_dir) == 0
    proposal = json.loads((out_dir / "proposal.json").read_text())
    assert proposal["files"] == [{"path": "prompt.md", "content": "new\n"}]
    replies = json.loads((out_dir / "replies.json").read_text())
    assert replies == {"c1": {"ok": True, "text": f"relay reply via {api}"}}
    recs: list[CallRecord] = CallLog(tmp_path / "run" / "gateway").records()
    assert [r.api for r in recs] == [api, api] and all(r.status == "ok" for r in recs)
    assert summarize(recs).total.complete


def _references(gw: Gateway, b: Binding) -> dict[str, Any]:
    """Responses with ``store: true`` whose next request refers to their output items
    by id, as the Vercel AI SDK sends them: a function call (not streamed) and a text
    answer (streamed), each referenced once."""
    oc = openai_client(gw, b)
    first = oc.responses.create(model="m", input="weather in Paris?", tools=RESP_TOOLS,
                                store=True)
    call = first.output[0]
    with oc.responses.stream(model="m", input="hello", store=True) as st:
        for _ in st:
            pass
        text = st.get_final_response().output[0]
    after: Any = [{"role": "user", "content": "hello"},
                  {"type": "item_reference", "id": text.id},
                  {"role": "user", "content": "weather in Paris?"},
                  {"type": "item_reference", "id": call.id},
                  {"type": "function_call_output", "call_id": getattr(call, "call_id", ""),
                   "output": "sunny"}]
    answer = oc.responses.create(model="m", input=after, tools=RESP_TOOLS, store=True)
    return {"call": call, "text": text, "answer": answer.output_text}


def test_item_references_resolve_to_this_containers_own_answers_only(tmp_path: Path) -> None:
    """An item reference (the Responses API's stored state) resolves to an output item of
    an earlier answer to the same container, put in its place before the call: the
    upstream reads nothing it keeps, the record holds the whole request, replay matches
    it. Another container's item id is refused by name, before anything is sent."""
    rec_dir = tmp_path / "recorded"
    with Gateway(rec_dir, "rec", {"target": scripted()}, {"analyst": "target"}) as gw, \
            gw.bound("analyst", stage="s", case="a", uid=os.getuid()) as b, \
            gw.bound("analyst", stage="s", case="other", uid=os.getuid()) as other:
        got = _references(gw, b)
        stolen = got["call"].id
        with pytest.raises(openai.BadRequestError) as exc:
            openai_client(gw, other).responses.create(
                model="m", input=[{"type": "item_reference", "id": stolen},
                                  {"role": "user", "content": "hi"}])
        assert exc.value.code == "item_reference_unknown", exc.value
        assert "this same container" in str(exc.value)
        # the API's other spelling of a reference: an item with an id, no type, no role
        auth = {"Authorization": f"Bearer {gw.token_for('analyst')}"}
        bare = _post(other, "/v1/responses", auth, {"model": "m", "input": [{"id": stolen}]})
        assert bare.status_code == 400 and "item_reference_unknown" in bare.text, bare.text
        twice = [{"type": "item_reference", "id": stolen}] * 2
        again = _post(b, "/v1/responses", auth, {"model": "m", "input": twice})
        assert again.status_code == 400 and "item_reference_repeated" in again.text
    assert got["answer"] == "It is sunny in Paris."
    assert got["call"].id.startswith("fc_") and got["text"].id.startswith("msg_")
    log = CallLog(rec_dir / "gateway")
    recs = log.records()
    assert [(r.case, r.status, r.error) for r in recs] == [
        ("a", "ok", None), ("a", "ok", None), ("a", "ok", None),
        ("other", "refused", "item_reference_unknown"),
        ("other", "refused", "item_reference_unknown"),
        ("a", "refused", "item_reference_repeated")]
    sent = json.loads(log.blob(recs[2].request_sha256))
    assert "item_reference" not in json.dumps(sent)
    assert sent["input"][3] == got["call"].model_dump(exclude_none=True)
    assert sent["input"][1]["id"] == got["text"].id
    assert sent["input"][1]["content"][0]["text"] == "plain reply"
    assert recs[2].usage is not None and recs[2].cost_basis == "measured"
    assert [r.resolved_references for r in recs] == [None, None, 2, None, None, None]
    # replay: the same references resolve to the same recorded items, the same request
    rep_dir = tmp_path / "replayed"
    up = scripted(provider="replay", replay_from=str(rec_dir), script=None)
    with Gateway(rep_dir, "rep", {"target": up}, {"analyst": "target"}) as gw, \
            gw.bound("analyst", stage="s", case="a", uid=os.getuid()) as b:
        assert _references(gw, b)["answer"] == got["answer"]
    assert [r.request_sha256 for r in CallLog(rep_dir / "gateway").records()] == [
        r.request_sha256 for r in recs[:3]]
