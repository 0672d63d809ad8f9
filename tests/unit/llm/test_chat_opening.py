"""The role-only opening chunk of a chat stream (llm/chunks.py ``split_opening``), for every first-chunk shape
our producers send: text, a parser's tool call or reasoning, a finish on the first chunk, and chunks that must
pass untouched."""

from __future__ import annotations

from dynamo.lazyjson import LazyJson
from dynamo.llm.chunks import ChatChunks, CompletionChunks, split_opening

OPENING = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def test_first_text_chunk_becomes_opening_then_text() -> None:
    chunks = ChatChunks("m", "r1")
    opening, text = split_opening(chunks.delta("Hi"))
    assert opening["choices"] == [OPENING]
    assert (opening["id"], opening["object"], opening["model"]) == ("chatcmpl-r1", "chat.completion.chunk", "m")
    assert text["choices"][0]["delta"] == {"content": "Hi"}
    assert text["id"] == opening["id"]


def test_first_tool_call_chunk_keeps_content_null() -> None:
    call = {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}]}
    opening, rest = split_opening(ChatChunks("m").parsed(call))
    assert opening["choices"] == [OPENING]
    assert rest["choices"][0]["delta"] == {"content": None, **call}


def test_first_chunk_with_logprobs_moves_them_off_the_opening() -> None:
    entry = [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}]
    opening, rest = split_opening(ChatChunks("m").delta("Hi", logprobs=entry))  # type: ignore[arg-type]
    assert opening["choices"][0]["logprobs"] is None
    assert rest["choices"][0]["logprobs"] == {"content": entry}


def test_an_empty_answer_still_opens_then_finishes() -> None:
    opening, last = split_opening(ChatChunks("m").delta(None, "stop"))
    assert opening["choices"] == [OPENING]
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["delta"] == {}


def test_chunks_from_a_remote_worker_split_the_same() -> None:
    raw = b'{"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,' \
          b'"delta":{"role":"assistant","content":"Yo"},"logprobs":null,"finish_reason":null}]}'
    opening, text = split_opening(LazyJson(raw))
    assert opening["choices"] == [OPENING] and text["choices"][0]["delta"] == {"content": "Yo"}


def test_what_needs_no_split_passes_alone() -> None:
    chunks = ChatChunks("m")
    already = split_opening(chunks.delta("a"))[0]  # a role-only chunk is not split again
    assert split_opening(already) == [already]
    later = chunks.delta("b")  # no role: not a first chunk
    assert split_opening(later) == [later]
    completion = CompletionChunks("m").delta("x")
    assert split_opening(completion) == [completion]
    assert split_opening("event") == ["event"]
