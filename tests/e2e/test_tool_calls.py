"""A tool loop with the openai SDK, as an agent runs it: call -> tool result -> final answer, unary and
streaming, against ``in=http`` with a ``pytok:`` engine that writes Qwen3's format through the real Qwen3
tokenizer and chat template; once with the engine in the frontend, once behind ``out=dyn`` (a worker on
real etcd + NATS, which parses on its side).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

from harness.proc import DynamoRun, DynamoWorker
from harness.qwen3 import require_qwen3_model_dir
from harness.servers import EtcdServer, NatsServer

pytestmark = pytest.mark.timeout(120)

ENGINE = Path(__file__).parent / "data" / "tool_engine.py"
MODEL = "qwen3-tools"
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                       "required": ["city"]},
    },
}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
MARKUP = ("<tool_call>", "</tool_call>", "<think>", "</think>", "{\"name\"")


class EngineServer(DynamoRun):
    """DynamoRun with the engine's arguments (after ``--``) kept last."""

    def __init__(self, *args: str, engine_args: tuple[str, ...], **kw: Any):
        super().__init__(*args, **kw)
        self.engine_args = list(engine_args)

    def command(self) -> list[str]:
        return super().command() + self.engine_args


@pytest.fixture(scope="module")
def qwen3() -> Path:
    folder = require_qwen3_model_dir()
    return folder


@pytest.fixture(scope="module", params=["local", "dyn"])
def client(request: pytest.FixtureRequest, qwen3: Path) -> Iterator[openai.OpenAI]:
    engine_args = ("--", "--model-path", str(qwen3))
    if request.param == "local":
        with EngineServer(f"out=pytok:{ENGINE}", str(qwen3), "--model-name", MODEL, engine_args=engine_args) as server:
            yield openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0, timeout=30)
        return
    with EtcdServer() as etcd, NatsServer() as nats:
        env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url}
        with DynamoWorker("in=dyn://tools.qwen.generate", f"out=pytok:{ENGINE}", str(qwen3), "--model-name", MODEL,
                          *engine_args, env={**env, "DYN_LOG": "info,dynamo.cli.launch=debug"}) as worker, DynamoRun("out=dyn", env=env) as frontend:
            assert "tool-call parser hermes, reasoning parser qwen3" in worker.stderr_text()
            c = openai.OpenAI(base_url=frontend.api_url, api_key="x", max_retries=0, timeout=30)
            _wait_for_model(c)
            yield c


def _wait_for_model(c: openai.OpenAI) -> None:
    import time

    deadline = time.monotonic() + 20
    while MODEL not in {m.id for m in c.models.list().data}:
        assert time.monotonic() < deadline, "the worker's model never showed up"
        time.sleep(0.1)


def _second_turn(first: dict[str, Any]) -> list[dict[str, Any]]:
    call = first["tool_calls"][0]
    return [*QUESTION, first, {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18}'}]


def test_tool_loop_unary(client: openai.OpenAI):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content == "Let me check.\n"
    assert msg.model_extra["reasoning_content"] == "The user wants the weather in Paris. I should call get_weather."
    (call,) = msg.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}

    # the SDK's message goes back as the agent sends it: content, tool_calls (arguments a JSON string)
    assistant = msg.model_dump(exclude_none=True)
    assistant.pop("reasoning_content")
    r2 = client.chat.completions.create(model=MODEL, messages=_second_turn(assistant), tools=TOOLS)
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.content == "It is 18 degrees in Paris."
    assert not r2.choices[0].message.tool_calls


def test_second_turn_with_null_content(client: openai.OpenAI):
    """The openai SDK sends an assistant turn that only called tools with content null."""
    first = {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_abc", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]}
    r = client.chat.completions.create(model=MODEL, messages=_second_turn(first), tools=TOOLS)
    assert r.choices[0].message.content == "It is 18 degrees in Paris."


def test_tool_loop_streaming(client: openai.OpenAI):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, stream=True)
    content, reasoning, entries, finish = [], [], [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        for m in MARKUP:
            assert m not in (delta.content or "")
        content.append(delta.content or "")
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        entries += delta.tool_calls or []
        finish.append(chunk.choices[0].finish_reason)
    assert "".join(content) == "Let me check.\n"
    assert "".join(reasoning) == "The user wants the weather in Paris. I should call get_weather."
    assert len([r for r in reasoning if r]) > 3  # reasoning streams, it is not sent at the end
    first, *fragments = entries
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert len(fragments) > 3 and all(f.id is None and f.function.name is None for f in fragments)
    arguments = "".join(f.function.arguments for f in fragments)
    assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}
    assert finish[-1] == "tool_calls" and not any(finish[:-1])

    assistant = {"role": "assistant", "content": "".join(content), "tool_calls": [
        {"id": first.id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
    stream = client.chat.completions.create(model=MODEL, messages=_second_turn(assistant), tools=TOOLS, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "It is 18 degrees in Paris."
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_enable_thinking_false(client: openai.OpenAI):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = r.choices[0].message
    assert "reasoning_content" not in (msg.model_extra or {}) and msg.content == "Let me check.\n"
    assert msg.tool_calls[0].function.name == "get_weather"


def test_tool_choice_none_hides_the_tools(client: openai.OpenAI):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == "No tools here." and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_required_and_named_through_guided_decoding(client: openai.OpenAI, choice: Any):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=choice)
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=choice,
                                            stream=True)
    entries = [e for chunk in stream for e in chunk.choices[0].delta.tool_calls or []]
    assert entries[0].function.name == "get_weather" and len(entries) > 2
    assert json.loads("".join(e.function.arguments or "" for e in entries)) == {"city": "Paris", "unit": "celsius"}


@pytest.mark.parametrize("choice", ["sometimes", {"type": "function", "function": {"name": "nope"}}])
def test_malformed_tool_choice_is_a_400(client: openai.OpenAI, choice: Any):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=choice)
    assert e.value.body["param"] == "tool_choice"  # type: ignore[index]


# -- kill -9 mid-answer: the stream moves to another worker, whose parser picks up where it stopped ---------


def test_worker_killed_mid_call_the_answer_continues_on_another(qwen3: Path):
    import httpx

    from harness.fleet import served_by, sse_events, wait_for_model
    from harness.wait import wait_until

    engine_args = ("--", "--model-path", str(qwen3))
    with EtcdServer() as etcd, NatsServer() as nats:
        env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url, "TOOL_ENGINE_DELAY_S": "0.02",
               "DYN_LOG": "info,dynamo.worker.handlers=debug"}
        workers = [DynamoWorker("in=dyn://mig.qwen.generate", f"out=pytok:{ENGINE}", str(qwen3), "--model-name", MODEL,
                                "--migration-limit", "1", *engine_args, env=env).start(wait=False) for _ in range(2)]
        try:
            for w in workers:
                w.wait_ready()
            with DynamoRun("out=dyn", env=env) as frontend:
                wait_for_model(frontend, MODEL, "dyn://mig.qwen.generate", 2)
                body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "stream": True}
                events, victim = [], None
                with httpx.stream("POST", frontend.api_url + "/chat/completions", json=body, timeout=30,
                                  headers={"x-request-id": "mig-tool-1"}) as resp:
                    for data in sse_events(resp):
                        if data == "[DONE]":
                            break
                        events.append(json.loads(data))
                        calls = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("tool_calls")]
                        if victim is None and len(calls) == 3:  # the name and two argument fragments are out
                            victim = wait_until(lambda: served_by(workers, "mig-tool-1"), 2, "the serving worker")[0]
                            victim.kill()
        finally:
            for w in workers:
                w.stop()
    assert victim is not None
    other = workers[1 - workers.index(victim)]
    assert "request mig-tool-1" in other.stderr_text(), "the stream did not move to the other worker"
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == \
        "The user wants the weather in Paris. I should call get_weather."
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check.\n"
    entries = [t for d in deltas for t in d.get("tool_calls") or ()]
    assert [t["function"].get("name") for t in entries if "id" in t] == ["get_weather"]  # one call, announced once
    assert json.loads("".join(t["function"]["arguments"] for t in entries)) == {"city": "Paris", "unit": "celsius"}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

