"""The parse stage wired into the token path: a Backend worker parses beside detokenization and sends
deltas; a frontend passes them through (and turns ``stop`` into ``tool_calls``); the preprocessor sets
the parsing options from the card and the request, and renders tool-call history."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, AsyncIterator

import msgspec
import pytest

from dynamo.errors import RequestError
from dynamo.llm.aggregate import fold_chat
from dynamo.llm.engine import Context
from dynamo.llm.model_card import load_hf_folder
from dynamo.llm.pipeline import CorePipeline
from dynamo.llm.preprocessor import Preprocessor
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest
from dynamo.llm.protocols.openai import parse_chat_request
from dynamo.llm.protocols.wire import read_output
from dynamo.llm.tokenizer import Tokenizer
from dynamo.worker.handlers import backend_handler

ANSWER = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


class TokenEngine:
    """Says ANSWER a token at a time (through the tiny tokenizer, so tags split across tokens)."""

    kind = "core"

    def __init__(self, tok: Tokenizer):
        self.ids = tok.encode(ANSWER)

    async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[EngineOutput]:
        for tid in self.ids:
            yield EngineOutput(token_ids=[tid])
        yield EngineOutput(finish_reason="stop")


class Relay:
    """A remote worker as the frontend sees it (RemoteCoreEngine asks for text): the handler's items,
    through JSON."""

    kind = "core"

    def __init__(self, handler: Any):
        self.handler = handler
        self.items: list[dict[str, Any]] = []

    async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[EngineOutput]:
        request.detokenize = True
        async for item in self.handler(json.loads(msgspec.json.encode(request))):
            self.items.append(item)
            yield read_output(json.loads(json.dumps(item)))


def chat(**kw: Any) -> tuple[Any, dict[str, Any]]:
    raw = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Weather in Paris?"}], **kw}
    return parse_chat_request(raw), raw


async def run(pipeline: CorePipeline, **kw: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    req, raw = chat(stream=True, **kw)
    chunks = [c async for c in pipeline.chat(req, raw, Context())]
    req, raw = chat(**kw)
    unary = await fold_chat(pipeline.chat(req, raw, Context()), Context(), "tiny-chat")
    return chunks, unary


def check(chunks: list[dict[str, Any]], unary: dict[str, Any]) -> None:
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    calls = [e for d in deltas for e in d.get("tool_calls") or ()]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert json.loads("".join(e["function"]["arguments"] for e in calls)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    msg = unary["choices"][0]["message"]
    assert unary["choices"][0]["finish_reason"] == "tool_calls"
    assert msg["content"] == "Checking." and msg["tool_calls"][0]["function"]["name"] == "get_weather"


async def test_local_engine_is_parsed_in_the_frontend(tiny_model: Path):
    card = load_hf_folder(tiny_model)
    pipeline = CorePipeline("tiny-chat", card, TokenEngine(Tokenizer(card.tokenizer_json)))  # type: ignore[arg-type]
    check(*await run(pipeline, tools=TOOLS))


async def test_remote_worker_parses_and_the_frontend_passes_its_deltas_through(tiny_model: Path):
    card = load_hf_folder(tiny_model)
    relay = Relay(backend_handler(card, TokenEngine(Tokenizer(card.tokenizer_json))))  # type: ignore[arg-type]
    check(*await run(CorePipeline("tiny-chat", card, relay), tools=TOOLS))
    assert relay.items and all(item["text"] == "" and "deltas" in item for item in relay.items)
    assert not any("<tool_call>" in json.dumps(item) for item in relay.items)


async def test_without_tools_nothing_is_parsed(tiny_model: Path):
    card = load_hf_folder(tiny_model)
    pipeline = CorePipeline("tiny-chat", card, TokenEngine(Tokenizer(card.tokenizer_json)))  # type: ignore[arg-type]
    chunks, unary = await run(pipeline)
    assert unary["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    assert unary["choices"][0]["finish_reason"] == "stop"


def test_preprocessor_parsing_options(tiny_model: Path):
    card = load_hf_folder(tiny_model)
    pre = Preprocessor(card)
    assert pre.chat(*chat()).request.parsing is None  # no tools, no reasoning in this template
    opts = pre.chat(*chat(tools=TOOLS, parallel_tool_calls=False)).request.parsing
    assert opts is not None and opts.tool_call_parser == "hermes" and opts.parallel_tool_calls is False
    none = pre.chat(*chat(tools=TOOLS, tool_choice="none"))
    assert none.request.parsing is None and "get_weather" not in (none.formatted_prompt or "")
    card.tool_call_parser = None  # no format known (or --tool-call-parser none): the generic JSON format
    generic = Preprocessor(card).chat(*chat(tools=TOOLS))
    assert generic.request.parsing is not None and generic.request.parsing.tool_call_parser == "generic"
    assert '"name": "get_weather"' in (generic.formatted_prompt or "")


def test_history_with_null_content_and_string_arguments_renders(tiny_model: Path):
    card = load_hf_folder(tiny_model)
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    raw = {"model": "tiny-chat", "messages": messages, "tools": TOOLS}
    prompt = Preprocessor(card).chat(parse_chat_request(raw), raw).formatted_prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<|im_start|>tool\n18 degrees" in prompt


def test_the_card_carries_the_parser_choice(tiny_model: Path):
    from dynamo.llm.model_card import ModelCard

    card = load_hf_folder(tiny_model)
    card.tool_call_parser, card.reasoning_parser = "hermes", None
    back = ModelCard.from_json(json.loads(json.dumps(card.to_json())))
    assert (back.tool_call_parser, back.reasoning_parser) == ("hermes", None)
    old = {k: v for k, v in card.to_json().items() if not k.endswith("_parser")}  # an older worker's card
    assert ModelCard.from_json(old).tool_call_parser == "auto"


def test_tool_choice_required_and_named_need_guided_decoding(tiny_model: Path):
    card = load_hf_folder(tiny_model)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(RequestError) as e:
            Preprocessor(card).chat(*chat(tools=TOOLS, tool_choice=choice))
        assert e.value.param == "tool_choice" and "guided decoding" in str(e.value)


def test_tool_choice_through_guided_decoding(tiny_model: Path):
    card = load_hf_folder(tiny_model)
    card.guided_decoding = ["json"]
    pre = Preprocessor(card)
    named = pre.chat(*chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})).request
    assert named.sampling_options.guided_decoding == {"json": {"type": "object"}}
    assert named.parsing is not None and named.parsing.forced_tool == "function:get_weather"
    required = pre.chat(*chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)).request
    schema = required.sampling_options.guided_decoding["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    for bad in ({"type": "function", "function": {"name": "nope"}}, "required"):
        kw = {"guided_regex": "x"} if bad == "required" else {}
        with pytest.raises(RequestError) as e:
            pre.chat(*chat(tools=TOOLS, tool_choice=bad, **kw))
        assert e.value.param == "tool_choice"


async def test_a_migrated_request_resumes_the_parser_where_the_dead_worker_left_it(tiny_model: Path):
    """Worker A streams the first k tokens and dies; the frontend resends prompt + those tokens to worker B
    (with ``resumed_tokens``), whose parser replays them: the client's stream is the same as without the
    failure, for every k (mid-tag, mid-name, mid-arguments)."""
    from dynamo.llm.parsers.fold import ParsedFold

    card = load_hf_folder(tiny_model)
    tok = Tokenizer(card.tokenizer_json)  # type: ignore[arg-type]
    engine = TokenEngine(tok)
    req, raw = chat(tools=TOOLS)
    request = Preprocessor(card).chat(req, raw).request
    request.detokenize = True  # as the frontend's remote engine asks
    handler = backend_handler(card, engine)

    async def items(r: PreprocessedRequest, engine_ids: list[int]) -> list[dict[str, Any]]:
        engine.ids = engine_ids
        return [json.loads(json.dumps(i)) async for i in handler(json.loads(msgspec.json.encode(r)))]

    def fold(all_items: list[dict[str, Any]]) -> dict[str, Any]:
        f = ParsedFold()
        for item in all_items:
            for d in item["deltas"]:
                f.add(d)
        content = "".join(d.get("content", "") for item in all_items for d in item["deltas"])
        msg = f.message(content)
        for call in msg.get("tool_calls", []):
            call["id"] = "x"
        return msg

    ids = tok.encode(ANSWER)
    expected = fold(await items(request, ids))
    for k in range(1, len(ids)):
        first = (await items(request, ids[:k]))[:k]  # A's items for its k tokens (then it died)
        resumed = msgspec.structs.replace(request, token_ids=request.token_ids + ids[:k],
                                          parsing=msgspec.structs.replace(request.parsing, resumed_tokens=k))
        assert fold(first + await items(resumed, ids[k:])) == expected, k


def test_constraints_the_engine_cannot_honour_are_400s_naming_the_field(tiny_model: Path):
    card = load_hf_folder(tiny_model)  # echo_core / llamacpp / mocker: no guided decoding
    pre = Preprocessor(card)
    cases = [({"response_format": {"type": "json_object"}}, "response_format"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
              "response_format"),
             ({"guided_regex": "[0-9]+"}, "guided_regex"), ({"nvext": {"guided_choice": ["a", "b"]}}, "guided_choice"),
             ({"logit_bias": {"50": 10}}, "logit_bias"), ({"response_format": {"type": "xml"}}, "response_format")]
    for fields, param in cases:
        with pytest.raises(RequestError) as e:
            pre.chat(*chat(**fields))
        assert e.value.param == param, fields
    assert pre.chat(*chat(response_format={"type": "text"})).request.sampling_options.guided_decoding is None
    card.guided_decoding = ["json"]
    got = Preprocessor(card).chat(*chat(response_format={"type": "json_object"})).request.sampling_options
    assert got.guided_decoding == {"json": {"type": "object"}}
    with pytest.raises(RequestError) as e:
        Preprocessor(card).chat(*chat(guided_regex="x"))
    assert e.value.param == "guided_regex" and "json only" in str(e.value)


def test_completions_fields_we_do_not_honour(tiny_model: Path):
    from dynamo.llm.protocols.openai import parse_completion_request

    pre = Preprocessor(load_hf_folder(tiny_model))
    for fields, param in (({"best_of": 2}, "best_of"), ({"suffix": "end"}, "suffix"), ({"logit_bias": {"1": 1}}, "logit_bias"),
                          ({"guided_json": {"type": "object"}}, "guided_json")):
        raw = {"model": "tiny-chat", "prompt": "hello", **fields}
        with pytest.raises(RequestError) as e:
            pre.completion(parse_completion_request(raw), raw)
        assert e.value.param == param


def test_logit_bias_checked_and_passed_on(tiny_model: Path):
    card = load_hf_folder(tiny_model)
    with pytest.raises(RequestError) as e:
        Preprocessor(card).chat(*chat(logit_bias={"5": 1}))  # the engine does not apply it
    assert e.value.param == "logit_bias"
    card.logit_bias = True
    pre = Preprocessor(card)
    assert pre.chat(*chat(logit_bias={"5": 10, 6: -100})).request.sampling_options.logit_bias == {"5": 10.0, "6": -100.0}
    for bad in ({"x": 1}, {"999999": 1}, {"5": 101}, {"5": "high"}, [5]):
        with pytest.raises(RequestError) as e:
            pre.chat(*chat(logit_bias=bad))
        assert e.value.param == "logit_bias", bad
