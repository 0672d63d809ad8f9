"""Pieces of the issue-12 API surface that need no server: key checks, origin and limit parsing, the
flags' combination rules, the responses store and request mapping, embedding encodings."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import pytest

from dynamo.errors import RequestError, UserError
from dynamo.llm.http.auth import KeyChecker, bearer_token
from dynamo.llm.http.embeddings import encode_base64
from dynamo.llm.http.options import DEFAULT_BODY_LIMIT_BYTES, body_limit_from_env, build_http_options, parse_origins
from dynamo.llm.http.responses import ResponseStore
from dynamo.llm.protocols.extra import parse_embedding_request
from dynamo.llm.protocols.responses import input_messages, parse_responses_request
from dynamo.run.flags import parse_args


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
    store = ResponseStore(2)
    store.put("a", [{"role": "user", "content": "1"}])
    store.put("b", [])
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", [])
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    off = ResponseStore(0)
    off.put("x", [])
    assert off.get("x") is None


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
