"""dynamo/lazyjson.py: a worker's chunk passed on undecoded, a dict for anyone who looks inside."""

from __future__ import annotations

import orjson

from dynamo.lazyjson import LazyJson

CHUNK = {"id": "c1", "object": "chat.completion.chunk", "model": "m",
         "choices": [{"index": 0, "delta": {"content": 'say "usage": no'}, "finish_reason": None}]}


def lazy(obj) -> LazyJson:
    return LazyJson(orjson.dumps(obj))


def test_questions_the_pipeline_asks_per_token_need_no_decoding():
    c = lazy(CHUNK)
    assert c.get("usage") is None and "usage" not in c  # "usage" inside the content is escaped text
    assert c.has_items("choices")
    assert not c._loaded and c.raw == orjson.dumps(CHUNK)
    assert not lazy({"choices": [], "usage": {"completion_tokens": 3}}).has_items("choices")
    assert not lazy({"id": "x"}).has_items("choices")


def test_it_is_the_dict_it_encodes():
    c = lazy(CHUNK)
    assert c == CHUNK and len(c) == len(CHUNK) and isinstance(c, dict) and list(c) == list(CHUNK)
    assert c["id"] == CHUNK["id"]
    assert c.raw is not None  # read only, nothing handed out that could change: the bytes still describe it
    assert dict(c.items()) == CHUNK and c.copy() == CHUNK and {**c} == CHUNK
    assert c["choices"][0]["delta"]["content"] == 'say "usage": no'
    assert c.raw is None  # nested values handed out may be changed in place: the object is the truth now
    u = lazy({"usage": {"prompt_tokens": 2}, "choices": []})
    assert u.get("usage") == {"prompt_tokens": 2} and "usage" in u


def test_a_change_drops_the_bytes():
    c = lazy(CHUNK)
    c["model"] = "other"
    assert c.raw is None and c["model"] == "other" and c["id"] == "c1"
    d = lazy(CHUNK)
    d.pop("id")
    assert d.raw is None and "id" not in d
    assert {k: v for k, v in lazy(CHUNK).items() if k != "model"} == {k: v for k, v in CHUNK.items() if k != "model"}


def test_a_change_inside_a_nested_value_drops_the_bytes_too():
    # what n > 1 does to a chunk's choices (llm/fanout.py): the bytes must not be sent as they were
    chunk = LazyJson(b'{"choices":[{"index":0,"delta":{"content":"a"}}]}')
    for choice in chunk["choices"]:
        choice["index"] = 2
    assert chunk.raw is None
    assert orjson.loads(orjson.dumps(dict(chunk.items())))["choices"][0]["index"] == 2
    other = LazyJson(b'{"usage":{"prompt_tokens":1},"id":"x"}')
    other.get("usage")["prompt_tokens"] = 5
    assert other.raw is None
    plain = LazyJson(b'{"id":"x","choices":[]}')
    assert plain.get("id") == "x" and plain.raw is not None  # a string handed out cannot be changed
