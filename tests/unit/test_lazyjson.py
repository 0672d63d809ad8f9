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
    assert c == CHUNK and dict(c.items()) == CHUNK and len(c) == len(CHUNK) and isinstance(c, dict)
    assert c["choices"][0]["delta"]["content"] == 'say "usage": no'
    assert list(c) == list(CHUNK) and c.copy() == CHUNK and {**c} == CHUNK
    assert c.raw is not None  # read only: the bytes still describe it
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
