"""Anthropic's Messages API through the official ``anthropic`` SDK: unary, streamed (the SDK's stream helper
accumulates the same message), stop reasons, usage, count_tokens, errors in Anthropic's shape, API keys
as ``x-api-key``, the flag that turns the routes on; locally (``echo_core``: the templated prompt's tokens
echoed through the real pre- and post-processor, so the answer shows what the server made of the
request) and through ``out=dyn`` (a worker on real etcd + NATS; a mocker worker reports prefix-cache hits).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import pytest

from harness.proc import DynamoRun, DynamoWorker
from harness.servers import EtcdServer, NatsServer
from harness.wait import wait_until
from tests.integration.test_http_exposure import ExposedRun

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-chat"
KEY = "sk-ant-test-0123456789"
SYSTEM_DEFAULT = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
HELLO = [{"role": "user", "content": "Hello there"}]


def templated(user: str, system: str | None = None) -> str:
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else SYSTEM_DEFAULT
    return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[ExposedRun]:
    with ExposedRun("out=echo_core", str(tiny_model), "--enable-anthropic-api", "--api-key", KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ExposedRun) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=30)


def tokens(server: ExposedRun, text: str) -> int:
    r = httpx.post(server.base_url + "/tokenize", headers={"x-api-key": KEY},
                   json={"model": MODEL, "prompt": text, "add_special_tokens": False})
    return r.json()["count"]


# -- unary and streamed --------------------------------------------------------------------------------


def test_unary_message(client: anthropic.Anthropic, server: ExposedRun):
    """echo_core answers with the prompt up to its first end-of-turn: the system block as templated."""
    m = client.messages.create(model=MODEL, max_tokens=100, system=[{"type": "text", "text": "Be brief."}],
                               messages=HELLO, metadata={"user_id": "u-1"})
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == "<|im_start|>system\nBe brief."
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.input_tokens == tokens(server, templated("Hello there", "Be brief."))
    assert m.usage.output_tokens == tokens(server, "<|im_start|>system\nBe brief.<|im_end|>")
    assert m.usage.cache_read_input_tokens is None  # echo_core keeps no cache: it does not claim a miss either


def test_stream_accumulates_to_the_unary_message(client: anthropic.Anthropic):
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 100, "system": "Be brief.", "messages": HELLO}
    unary = client.messages.create(**kw)
    events = []
    with client.messages.stream(**kw) as stream:
        for ev in stream:
            events.append(ev.type)
        final = stream.get_final_message()
        text = stream.text_stream
    assert final.model_dump(exclude={"id"}) == unary.model_dump(exclude={"id"})
    assert events[0] == "message_start" and events[-1] == "message_stop"
    deltas = [e for e in events if e == "content_block_delta"]
    assert len(deltas) > 3  # the text streams, it is not sent at the end
    assert events.count("content_block_start") == events.count("content_block_stop") == 1
    assert text is not None


def test_raw_stream_events_and_request_id(server: ExposedRun):
    body = {"model": MODEL, "max_tokens": 100, "stream": True, "messages": HELLO}
    with httpx.stream("POST", server.base_url + "/v1/messages", json=body, timeout=30,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        assert r.headers["request-id"].startswith("req_")
        lines = [line for line in r.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert [d["type"] for d in datas] == names  # every event's data names its event
    start = datas[0]["message"]
    assert start["usage"]["input_tokens"] > 0 and start["usage"]["output_tokens"] == 0 and start["content"] == []
    delta = datas[-2]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] > 0


# -- stop reasons ------------------------------------------------------------------------------------


def test_stop_sequence_is_reported(client: anthropic.Anthropic):
    m = client.messages.create(model=MODEL, max_tokens=100, messages=HELLO, stop_sequences=["nothing", "helpful"])
    assert m.content[0].text == "<|im_start|>system\nYou are a "
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "helpful")
    with client.messages.stream(model=MODEL, max_tokens=100, messages=HELLO, stop_sequences=["helpful"]) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == (
        "stop_sequence", "helpful", "<|im_start|>system\nYou are a ")


def test_max_tokens_stop_reason(client: anthropic.Anthropic):
    m = client.messages.create(model=MODEL, max_tokens=3, messages=HELLO)
    assert (m.stop_reason, m.stop_sequence, m.usage.output_tokens) == ("max_tokens", None, 3)


def test_assistant_turns_and_sampling_fields_reach_the_template(client: anthropic.Anthropic):
    """Earlier turns as content blocks; temperature, top_p and top_k are accepted (echo ignores them)."""
    m = client.messages.create(  # (this SDK no longer types the sampling fields; older clients send them)
        model=MODEL, max_tokens=200, extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20}, system="S",
        cache_control={"type": "ephemeral"},
        messages=[{"role": "user", "content": [{"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "two"}]},
                  {"role": "user", "content": "three"}],
        stop_sequences=["three"])
    assert m.content[0].text == "<|im_start|>system\nS"  # echo stops at the first end of turn
    n = client.messages.count_tokens(model=MODEL, system="S", messages=[
        {"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}])
    assert n.input_tokens == m.usage.input_tokens


# -- count_tokens ------------------------------------------------------------------------------------


def test_count_tokens_equals_what_the_engine_sees(client: anthropic.Anthropic, server: ExposedRun):
    n = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=HELLO)
    m = client.messages.create(model=MODEL, max_tokens=5, system="Be brief.", messages=HELLO)
    assert n.input_tokens == m.usage.input_tokens == tokens(server, templated("Hello there", "Be brief."))


# -- errors ------------------------------------------------------------------------------------------


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


@pytest.mark.parametrize(("body", "words"), [
    ({"model": MODEL, "messages": HELLO}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 0, "messages": HELLO}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 5, "messages": []}, "at least one message"),
    ({"model": MODEL, "max_tokens": 5, "messages": HELLO, "temperature": 1.5}, "temperature"),
    ({"model": MODEL, "max_tokens": 5, "messages": HELLO, "frobnicate": True}, "frobnicate"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "image"),
    ({"model": MODEL, "max_tokens": 5, "messages": HELLO, "tools": [{"type": "web_search_20250305", "name": "w"}]},
     "server tool"),
    ({"model": MODEL, "max_tokens": 5, "messages": HELLO, "tool_choice": {"type": "any"}}, "needs tools"),
    ({"model": MODEL, "max_tokens": 2000, "messages": HELLO, "thinking": {"type": "enabled", "budget_tokens": 100}},
     "budget_tokens"),
    ({"model": MODEL, "max_tokens": 1500, "messages": HELLO, "thinking": {"type": "enabled", "budget_tokens": 2000}},
     "less than max_tokens"),
    ({"model": MODEL, "max_tokens": 5, "messages": HELLO, "output_config": {"effort": "high"}}, "effort"),
    ({"model": MODEL, "max_tokens": 5, "messages": HELLO, "speed": "fast"}, "speed"),
    ({"model": MODEL, "max_tokens": 5, "messages": HELLO,
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "response_format"),
])
def test_bad_bodies_are_400s_in_anthropics_shape(server: ExposedRun, body: dict[str, Any], words: str):
    r = httpx.post(server.base_url + "/v1/messages", json=body, headers={"x-api-key": KEY})
    assert words in anthropic_error(r, 400, "invalid_request_error")


def test_not_json_and_unknown_model(server: ExposedRun):
    r = httpx.post(server.base_url + "/v1/messages", content=b"{nope", headers={"x-api-key": KEY})
    anthropic_error(r, 400, "invalid_request_error")
    r = httpx.post(server.base_url + "/v1/messages", json={"model": "nope", "max_tokens": 5, "messages": HELLO},
                   headers={"x-api-key": KEY})
    assert "nope" in anthropic_error(r, 404, "not_found_error")
    r = httpx.get(server.base_url + "/v1/messages", headers={"x-api-key": KEY})
    anthropic_error(r, 405, "invalid_request_error")


def test_sdk_raises_typed_errors(client: anthropic.Anthropic, server: ExposedRun):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=5, messages=[])
    assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e2:
        wrong.messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    assert e2.value.body == {"type": "error", "error": {"type": "authentication_error",  # type: ignore[comparison-overlap]
                                                       "message": "Incorrect API key provided."}}
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model=MODEL, messages=HELLO)


def test_keys_as_bearer_or_x_api_key(server: ExposedRun):
    body = {"model": MODEL, "max_tokens": 2, "messages": HELLO}
    assert httpx.post(server.base_url + "/v1/messages", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    r = httpx.post(server.base_url + "/v1/messages", json=body)
    assert "x-api-key" in anthropic_error(r, 401, "authentication_error")
    # the OpenAI routes take x-api-key too, and keep their own error shape
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 2},
                   headers={"x-api-key": KEY})
    assert r.status_code == 200
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"model": MODEL, "messages": HELLO},
                   headers={"x-api-key": "sk-wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_overload_is_a_529_the_sdk_knows(tiny_model: Path):
    """Past ``--max-inflight`` the gate answers at once; under /v1/messages as Anthropic's 529."""
    with DynamoRun("out=echo_core", str(tiny_model), "--enable-anthropic-api", "--max-inflight", "1",
                   delay_ms=30) as srv:
        c = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0, timeout=30)
        started = threading.Event()

        def slow() -> None:
            with c.messages.stream(model=MODEL, max_tokens=200, messages=HELLO) as s:
                for _ in s:
                    started.set()

        t = threading.Thread(target=slow, daemon=True)
        t.start()
        assert started.wait(20)
        with pytest.raises(anthropic.APIStatusError) as e:
            c.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
        assert e.value.status_code == 529 and e.value.response.headers["retry-after"]
        assert e.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        t.join(30)


# -- the flag ----------------------------------------------------------------------------------------


def test_off_without_the_flag_and_on_with_the_environment(tiny_model: Path):
    body = {"model": MODEL, "max_tokens": 2, "messages": HELLO}
    with DynamoRun("out=echo_core", str(tiny_model)) as srv:
        r = httpx.post(srv.base_url + "/v1/messages", json=body)
        assert "--enable-anthropic-api" in anthropic_error(r, 404, "not_found_error")
        r = httpx.post(srv.base_url + "/v1/messages/count_tokens", json=body)
        anthropic_error(r, 404, "not_found_error")
    with DynamoRun("out=echo_core", str(tiny_model), env={"DYN_ENABLE_ANTHROPIC_API": "1"}) as srv:
        assert httpx.post(srv.base_url + "/v1/messages", json=body).status_code == 200


def test_a_bad_flag_value_is_one_line(tiny_model: Path):
    from harness.proc import run_cli

    r = run_cli(["in=http", "out=echo_core", str(tiny_model), "--http-port", "0"],
                env={"DYN_ENABLE_ANTHROPIC_API": "maybe"})
    assert r.returncode != 0 and "DYN_ENABLE_ANTHROPIC_API" in r.stderr and "Traceback" not in r.stderr


# -- out=dyn -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dyn(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoRun]:
    args_file = tmp_path_factory.mktemp("mocker") / "mocker.json"
    args_file.write_text(json.dumps({"num_gpu_blocks": 512, "block_size": 16, "speedup_ratio": 20.0}))
    with EtcdServer() as etcd, NatsServer() as nats_srv:
        env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats_srv.url}
        with DynamoWorker("in=dyn://anth.echo.generate", "out=echo_core", str(tiny_model), env=env), \
                DynamoWorker("in=dyn://anth.mocker.generate", "out=mocker", str(tiny_model), "--model-name", "mock",
                             "--extra-engine-args", str(args_file), env=env), \
                DynamoRun("out=dyn", "--enable-anthropic-api", env=env) as fe:
            wait_until(lambda: {MODEL, "mock"} <= {m["id"] for m in httpx.get(fe.api_url + "/models").json()["data"]},
                       30, "the frontend to see both models")
            yield fe


def test_through_out_dyn(dyn: DynamoRun):
    c = anthropic.Anthropic(base_url=dyn.base_url, api_key="x", max_retries=0, timeout=30)
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 100, "messages": HELLO, "stop_sequences": ["helpful"]}
    unary = c.messages.create(**kw)
    assert unary.content[0].text == "<|im_start|>system\nYou are a "
    assert (unary.stop_reason, unary.stop_sequence) == ("stop_sequence", "helpful")  # found by the worker
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.model_dump(exclude={"id"}) == unary.model_dump(exclude={"id"})
    assert c.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens == unary.usage.input_tokens


def test_cache_reads_through_out_dyn(dyn: DynamoRun):
    """The mocker reports the prompt tokens it found cached: the second identical request reads them."""
    c = anthropic.Anthropic(base_url=dyn.base_url, api_key="x", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "a long shared question " * 20}]
    first = c.messages.create(model="mock", max_tokens=2, messages=messages)
    assert first.usage.cache_read_input_tokens == 0
    with c.messages.stream(model="mock", max_tokens=2, messages=messages) as s:
        second = s.get_final_message()
    cached = second.usage.cache_read_input_tokens
    assert cached is not None and 16 <= cached <= second.usage.input_tokens and cached % 16 == 0
    assert second.usage.input_tokens == first.usage.input_tokens


def test_openai_stream_names_the_stop_string(server: ExposedRun):
    """The same stop string reaches OpenAI clients as the last chunk's ``stop_reason`` (vLLM's field)."""
    body = {"model": MODEL, "messages": HELLO, "stop": ["helpful"], "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"x-api-key": KEY}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["stop_reason"] == "helpful"
    body["stop"] = ["nowhere"]
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"x-api-key": KEY}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "stop_reason" not in chunks[-1]["choices"][0]  # ended by the end of turn, not a stop string


def test_llamacpp_prefix_reuse_is_a_cache_read():
    """A real engine: SmolLM2 on llama.cpp reuses the prompt of the turn before (greedy, so the streamed
    and the unary answers are the same)."""
    from harness.smollm2 import SMOLLM2_MODEL, NotInstalled, smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except NotInstalled as e:
        pytest.skip(str(e))
    with DynamoRun("out=llamacpp", str(gguf), "--enable-anthropic-api", startup_timeout=120) as srv:
        c = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)
        kw: dict[str, Any] = {"model": SMOLLM2_MODEL, "max_tokens": 12, "extra_body": {"temperature": 0},
                              "system": "You answer in one short sentence. " * 8,
                              "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        first = c.messages.create(**kw)
        assert first.content[0].text and first.usage.output_tokens <= 12  # type: ignore[union-attr]
        with c.messages.stream(**kw) as s:
            second = s.get_final_message()
        assert second.content[0].text == first.content[0].text and second.stop_reason == first.stop_reason  # type: ignore[union-attr]
        assert second.usage.input_tokens == first.usage.input_tokens
        assert 0 < (second.usage.cache_read_input_tokens or 0) < second.usage.input_tokens
        assert c.messages.count_tokens(model=SMOLLM2_MODEL, system=kw["system"],
                                       messages=kw["messages"]).input_tokens == first.usage.input_tokens


def test_engine_failures_in_anthropics_shape():
    """A failure before the first token is a 500 ``api_error``; after it, the stream ends with an ``error``
    event (the headers are out); the SDK raises either way.  count_tokens is refused for an engine that
    templates by itself."""
    engine = Path(__file__).parents[1] / "e2e" / "data" / "behaviour_engine.py"
    with DynamoRun(f"out=pystr:{engine}", "--model-name", "behave", "--enable-anthropic-api") as srv:
        def ask(text: str) -> dict[str, Any]:
            return {"model": "behave", "max_tokens": 50, "messages": [{"role": "user", "content": text}]}

        r = httpx.post(srv.base_url + "/v1/messages", json=ask("raise"), timeout=30)
        assert "boom requested" in anthropic_error(r, 500, "api_error")
        with httpx.stream("POST", srv.base_url + "/v1/messages", json={**ask("raise-mid"), "stream": True},
                          timeout=30) as resp:
            assert resp.status_code == 200
            lines = [line for line in resp.iter_lines() if line]
        assert lines[-2] == "event: error" and "message_stop" not in "".join(lines)
        error = json.loads(lines[-1][6:])
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert "mid-stream failure" in error["error"]["message"]
        c = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0, timeout=30)
        with pytest.raises(anthropic.APIError), c.messages.stream(**ask("raise-mid")) as s:
            s.get_final_message()
        m = c.messages.create(**ask("hi"))
        assert m.content[0].text == "Hello from the behaviour engine." and m.stop_reason == "end_turn"  # type: ignore[union-attr]
        r = httpx.post(srv.base_url + "/v1/messages/count_tokens", json=ask("hi"), timeout=30)
        assert "cannot be counted" in anthropic_error(r, 400, "invalid_request_error")


def test_the_flag_is_for_the_http_server(tiny_model: Path):
    from harness.proc import run_cli

    r = run_cli(["in=dyn://a.b.c", "out=echo_core", str(tiny_model), "--enable-anthropic-api"])
    assert r.returncode != 0 and "--enable-anthropic-api" in r.stderr and "Traceback" not in r.stderr
