"""A tool loop with the ``anthropic`` SDK, as an agent runs it: ``tool_use`` -> the agent's ``tool_result`` ->
the final answer, unary and streamed, with thinking blocks from the reasoning parser; against ``in=http``
with the ``pytok:`` engine of tests/e2e/test_tool_calls.py (Qwen3's format through the real Qwen3 tokenizer
and chat template), once with the engine in the frontend, once behind ``out=dyn`` (a worker on real
etcd + NATS, which parses on its side).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import anthropic
import pytest

from harness.proc import DynamoRun, DynamoWorker
from harness.servers import EtcdServer, NatsServer
from harness.wait import wait_until
from tests.e2e.test_tool_calls import ENGINE, MARKUP, EngineServer

pytestmark = pytest.mark.timeout(120)

MODEL = "qwen3-anthropic"
TOOLS: list[Any] = [{"name": "get_weather", "description": "Current weather in a city",
                     "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                                       "unit": {"type": "string"}},
                                      "required": ["city"]}}]
QUESTION: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
THINKING = {"type": "enabled", "budget_tokens": 1024}
REASONING = "The user wants the weather in Paris. I should call get_weather."
ARGS = {"city": "Paris", "unit": "celsius"}
FINAL = "It is 18 degrees in Paris."


@pytest.fixture(scope="module", params=["local", "dyn"])
def client(request: pytest.FixtureRequest) -> Iterator[anthropic.Anthropic]:
    from harness.qwen3 import require_qwen3_model_dir

    folder: Path = require_qwen3_model_dir()
    engine_args = ("--", "--model-path", str(folder))
    if request.param == "local":
        with EngineServer(f"out=pytok:{ENGINE}", str(folder), "--model-name", MODEL, "--enable-anthropic-api",
                          engine_args=engine_args) as server:
            yield anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=30)
        return
    with EtcdServer() as etcd, NatsServer() as nats:
        env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url}
        with DynamoWorker("in=dyn://anthtools.qwen.generate", f"out=pytok:{ENGINE}", str(folder), "--model-name",
                          MODEL, *engine_args, env=env), \
                DynamoRun("out=dyn", "--enable-anthropic-api", env=env) as frontend:
            c = anthropic.Anthropic(base_url=frontend.base_url, api_key="x", max_retries=0, timeout=30)
            wait_until(lambda: MODEL in {m.id for m in c.models.list()}, 20, "the worker's model")
            yield c


def result_turn(call: Any) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": '{"temperature": 18}'}]}


def without_ids(m: Any) -> dict[str, Any]:
    """The message as a dict without its id and its calls' ids (new for every answer)."""
    d = m.model_dump(exclude={"id"})
    for block in d["content"]:
        block.pop("id", None)
    return d


def check_first_turn(m: Any, thinking: bool) -> Any:
    """(thinking,) the sentence before the call, then the call: in the order the model wrote them."""
    kinds = ["thinking", "text", "tool_use"] if thinking else ["text", "tool_use"]
    assert [b.type for b in m.content] == kinds
    if thinking:
        assert m.content[0].thinking == REASONING and m.content[0].signature == ""
    text, call = m.content[-2:]
    assert text.text == "Let me check.\n"
    assert call.name == "get_weather" and call.input == ARGS and call.id.startswith("call_")
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    return call


def test_tool_loop_unary(client: anthropic.Anthropic):
    first = client.messages.create(model=MODEL, max_tokens=2048, messages=QUESTION, tools=TOOLS)
    call = check_first_turn(first, thinking=False)  # no thinking unless asked for
    # the agent sends back the SDK's own content blocks, then the tool's result
    second = client.messages.create(model=MODEL, max_tokens=2048, tools=TOOLS, messages=[
        *QUESTION, {"role": "assistant", "content": first.content}, result_turn(call)])
    assert [b.type for b in second.content] == ["text"] and second.content[0].text == FINAL
    assert second.stop_reason == "end_turn"


def test_thinking_then_tool_loop_streamed(client: anthropic.Anthropic):
    kinds: list[str] = []
    with client.messages.stream(model=MODEL, max_tokens=2048, messages=QUESTION, tools=TOOLS,
                                thinking=THINKING) as stream:  # type: ignore[arg-type]
        for ev in stream:
            if ev.type == "content_block_delta":
                kinds.append(ev.delta.type)
                for m in MARKUP:
                    assert m not in getattr(ev.delta, "text", "") and m not in getattr(ev.delta, "thinking", "")
        first = stream.get_final_message()
    call = check_first_turn(first, thinking=True)
    assert kinds.count("thinking_delta") > 3 and kinds.count("input_json_delta") > 3  # they stream
    assert kinds.index("thinking_delta") < kinds.index("text_delta") < kinds.index("input_json_delta")
    unary = client.messages.create(model=MODEL, max_tokens=2048, messages=QUESTION, tools=TOOLS,
                                   thinking=THINKING)  # type: ignore[arg-type]
    assert without_ids(unary) == without_ids(first)
    # the thinking block goes back with the call (Qwen3's template shows it in a tool loop)
    with client.messages.stream(model=MODEL, max_tokens=2048, tools=TOOLS, thinking=THINKING,  # type: ignore[arg-type]
                                messages=[*QUESTION, {"role": "assistant", "content": first.content},
                                          result_turn(call)]) as stream:
        second = stream.get_final_message()
    assert [b.type for b in second.content] == ["thinking", "text"]
    assert second.content[0].thinking == "The user wants the weather in Paris. I have the result."  # type: ignore[union-attr]
    assert second.content[1].text == FINAL  # type: ignore[union-attr]


def test_thinking_display_omitted(client: anthropic.Anthropic):
    m = client.messages.create(model=MODEL, max_tokens=2048, messages=QUESTION, tools=TOOLS,
                               thinking={"type": "adaptive", "display": "omitted"})  # type: ignore[arg-type]
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"] and m.content[0].thinking == ""  # type: ignore[union-attr]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tool_choice_any_and_named(client: anthropic.Anthropic, choice: Any):
    m = client.messages.create(model=MODEL, max_tokens=2048, messages=QUESTION, tools=TOOLS, tool_choice=choice)
    assert [b.type for b in m.content] == ["tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].name == "get_weather" and m.content[0].input == ARGS  # type: ignore[union-attr]


def test_tool_choice_none_hides_the_tools(client: anthropic.Anthropic):
    m = client.messages.create(model=MODEL, max_tokens=2048, messages=QUESTION, tools=TOOLS,
                               tool_choice={"type": "none"})
    assert m.content[0].text == "No tools here." and m.stop_reason == "end_turn"  # type: ignore[union-attr]


def test_structured_output_through_guided_decoding(client: anthropic.Anthropic):
    schema = TOOLS[0]["input_schema"]
    m = client.messages.create(model=MODEL, max_tokens=2048, messages=QUESTION,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert m.content[0].text == '{"city": "Paris", "unit": "celsius"}'  # type: ignore[union-attr]


def test_count_tokens_matches_the_prompt_with_tools(client: anthropic.Anthropic):
    n = client.messages.count_tokens(model=MODEL, messages=QUESTION, tools=TOOLS)
    m = client.messages.create(model=MODEL, max_tokens=2048, messages=QUESTION, tools=TOOLS)
    assert n.input_tokens == m.usage.input_tokens > 100  # the template lists the tools in the prompt
