"""Pieces of the issue-12 API surface that need no server: key checks, origin and limit parsing, the
flags' combination rules, the responses store and request mapping, embedding encodings."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import pytest

from dynamo.cli.flags import parse_args
from dynamo.errors import RequestError, UserError
from dynamo.frontend.http.auth import KeyChecker, bearer_token
from dynamo.frontend.http.embeddings import encode_base64
from dynamo.frontend.http.options import (
    DEFAULT_BODY_LIMIT_BYTES,
    body_limit_from_env,
    build_http_options,
    parse_origins,
)
from dynamo.frontend.http.responses_output import OutputItems
from dynamo.frontend.http.responses_store import ResponseStore, Stored
from dynamo.llm.protocols.extra import parse_embedding_request
from dynamo.llm.protocols.responses import chat_tool_choice, chat_tools, input_messages, parse_responses_request


def test_key_checker_accepts_each_key_and_nothing_else():
    checker = KeyChecker(["alpha", "beta-longer-key"])
    assert checker.allows("alpha") and checker.allows("beta-longer-key")
    for wrong in ("", "alph", "alphaa", "ALPHA", "beta"):
        assert not checker.allows(wrong)


def test_bearer_token():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer   abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer") is None and bearer_token(None) is None


def test_flag_keys_replace_the_environment_and_env_keys_split_on_commas():
    assert build_http_options(api_keys=["flag"], environ={"DYN_API_KEY": "env"}).api_keys == ["flag"]
    assert build_http_options(environ={"DYN_API_KEY": "a, b"}).api_keys == ["a", "b"]
    assert build_http_options(environ={}).api_keys == []
    with pytest.raises(UserError, match="empty key"):
        build_http_options(environ={"DYN_API_KEY": "a,,b"})


def test_origins_forms():
    assert parse_origins(["https://a.example, http://b.example:8080/"]) == ["https://a.example",
                                                                          "http://b.example:8080"]
    assert parse_origins(['["*"]']) == ["*"]
    assert parse_origins(["https://a.example", "https://a.example"]) == ["https://a.example"]
    with pytest.raises(UserError):
        parse_origins(["a.example"])
    with pytest.raises(UserError):
        parse_origins(["[1, 2]"])


def test_body_limit():
    assert body_limit_from_env({}) == DEFAULT_BODY_LIMIT_BYTES
    assert body_limit_from_env({"DYN_HTTP_BODY_LIMIT_MB": "45"}) == 45 * 1024 * 1024
    for bad in ("0", "-1", "x"):
        with pytest.raises(UserError):
            body_limit_from_env({"DYN_HTTP_BODY_LIMIT_MB": bad})


def test_flags(tmp_path: Path):
    cfg = parse_args(["in=http", "out=echo_full", "--api-key", "a", "--api-key", "b", "--allowed-origins", "*"])
    assert cfg.api_keys == ["a", "b"] and cfg.allowed_origins == ["*"]
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{{ messages }}")
    assert parse_args(["in=http", "out=echo_core", "--chat-template", str(tpl)]).chat_template == tpl
    with pytest.raises(UserError, match="worker"):
        parse_args(["in=http", "out=dyn", "--chat-template", str(tpl)])
    with pytest.raises(UserError, match="worker"):
        parse_args(["in=http", "out=dyn", "--embedding"])
    with pytest.raises(UserError, match="only for in=http"):
        parse_args(["in=dyn://a.b.c", "out=echo_core", "--allowed-origins", "*"])
    assert parse_args(["in=dyn://a.b.c", "out=echo_core", "--embedding"]).embedding


def test_response_store_is_bounded_and_evicts_the_least_recently_used():
    def entry(rid: str) -> Stored:
        return Stored({"id": rid}, [{"role": "user", "content": rid}])

    store = ResponseStore(2)
    store.put("a", entry("a"))
    store.put("b", entry("b"))
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", entry("c"))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert store.delete("a") and not store.delete("a") and store.get("a") is None
    off = ResponseStore(0)
    off.put("x", entry("x"))
    assert off.get("x") is None


def test_response_store_is_bounded_in_bytes_too():
    """1000 entries bound nothing when each holds a long conversation: the JSON they hold is bounded."""
    def entry(rid: str, chars: int) -> Stored:
        return Stored({"id": rid}, [{"role": "user", "content": "x" * chars}])

    store = ResponseStore(1000, max_bytes=10_000)
    for i in range(10):
        store.put(f"r{i}", entry(f"r{i}", 3000))
    assert len(store) == 3 and store.bytes <= 10_000
    assert store.get("r9") is not None and store.get("r6") is None
    store.put("big", entry("big", 20_000))  # alone more than the bound: not kept, nothing evicted for it
    assert store.get("big") is None and len(store) == 3
    store.put("r9", entry("r9", 10))  # replaced: its old size is given back
    assert store.delete("r9") and store.bytes == sum(store.get(r).nbytes for r in ("r7", "r8"))


def test_responses_input_mapping():
    req = parse_responses_request({"model": "m", "input": [
        {"role": "developer", "content": "d"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "x"}, {"type": "input_text", "text": "y"}]},
    ]})
    assert input_messages(req) == [{"role": "system", "content": "d"}, {"role": "assistant", "content": "a"},
                                   {"role": "user", "content": "x\ny"}]
    with pytest.raises(RequestError):
        input_messages(parse_responses_request({"model": "m", "input": [{"role": "tool", "content": "x"}]}))
    with pytest.raises(RequestError):
        parse_responses_request({"model": "m", "input": "x", "max_output_tokens": 0})


def test_responses_tools_and_tool_choice_become_chat_tools():
    req = parse_responses_request({"model": "m", "input": "x", "tool_choice": {"type": "function", "name": "f"},
                                   "tools": [{"type": "function", "name": "f", "description": "d",
                                              "parameters": {"type": "object"}, "strict": True}]})
    assert chat_tools(req) == [{"type": "function", "function": {"name": "f", "description": "d",
                                                                 "parameters": {"type": "object"}, "strict": True}}]
    assert chat_tool_choice(req) == {"type": "function", "function": {"name": "f"}}
    for bad, param in (({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
                       ({"tools": [{"type": "function"}]}, "tools[0].name"),
                       ({"tool_choice": "required"}, "tool_choice"),
                       ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice")):
        with pytest.raises(RequestError) as e:
            parse_responses_request({"model": "m", "input": "x", **bad})
        assert e.value.param == param
    with pytest.raises(RequestError, match="code_interpreter"):
        parse_responses_request({"model": "m", "input": "x", "tools": [{"type": "code_interpreter"}]})


def test_responses_agent_loop_items_become_chat_messages():
    req = parse_responses_request({"model": "m", "input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ]})
    calls = [{"id": c, "type": "function", "function": {"name": n, "arguments": a}}
             for c, n, a in (("c1", "f", "{}"), ("c2", "g", '{"a": 1}'))]
    assert input_messages(req) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "think", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]


def test_output_items_follow_the_deltas_in_order():
    out = OutputItems()
    events = []
    for delta in ({"reasoning_content": "th"}, {"reasoning_content": "ink"}, {"content": "Hi"},
                  {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                   "function": {"name": "f", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
                  {"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                   "function": {"name": "g", "arguments": "[1]"}}]}):
        events += out.feed(delta)
    events += out.finish("completed")
    assert [e[0] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [e[1]["output_index"] for e in events if e[0] == "response.output_item.done"] == [0, 1, 2, 3]
    items = out.output()
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert items[2] | {"id": None} == {"type": "function_call", "id": None, "call_id": "call_a", "name": "f",
                                       "arguments": "{}", "status": "completed"}
    assert out.assistant_message() == {
        "role": "assistant", "content": "Hi", "reasoning_content": "think",
        "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                       {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": "[1]"}}]}


def test_an_empty_answer_still_has_a_message_and_a_cut_one_is_incomplete():
    empty = OutputItems()
    assert [e[0] for e in empty.finish("completed")][0] == "response.output_item.added"
    assert empty.output()[0]["type"] == "message" and empty.output()[0]["content"][0]["text"] == ""
    cut = OutputItems()
    cut.feed({"content": "partial"})
    cut.finish("incomplete")
    assert cut.output()[0]["status"] == "incomplete"


def test_embedding_inputs_and_base64():
    assert parse_embedding_request({"model": "m", "input": "a"})[1] == ["a"]
    assert parse_embedding_request({"model": "m", "input": [1, 2]})[1] == [[1, 2]]
    assert parse_embedding_request({"model": "m", "input": [[1], [2, 3]]})[1] == [[1], [2, 3]]
    with pytest.raises(RequestError):
        parse_embedding_request({"model": "m", "input": [True]})
    with pytest.raises(RequestError):
        parse_embedding_request({"model": "m", "input": "a", "encoding_format": "hex"})
    vec = [0.5, -1.25, 3.0]
    assert struct.unpack("<3f", base64.b64decode(encode_base64(vec))) == (0.5, -1.25, 3.0)
