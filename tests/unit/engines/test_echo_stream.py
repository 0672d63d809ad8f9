"""echo_full's stream: the chunks a client reads are the same JSON as the chunk builders' dicts, one per
character, then the finish and (when asked) the usage; a stop or a close ends it as a generator would."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from dynamo.engines.echo import EchoFullEngine
from dynamo.lazyjson import LazyJson
from dynamo.llm.chunks import ChatChunks, CompletionChunks
from dynamo.llm.engine import Context
from dynamo.llm.protocols.openai import parse_chat_request, parse_completion_request

TEXT = 'a "quoted" é\n\\ 中文 \U0001f600 end'


def _bytes(chunk: Any) -> bytes:
    """What the SSE writer sends for a chunk: a LazyJson's own bytes, a dict encoded."""
    if type(chunk) is LazyJson:
        assert chunk.raw is not None
        return chunk.raw
    return orjson.dumps(chunk)


async def _collect(stream: Any) -> list[Any]:
    out = []
    async for chunk in stream:
        out.append(chunk)
    return out


@pytest.mark.parametrize("delay", [0.0, 0.001])
async def test_chat_chunks_are_the_builders_json(delay: float) -> None:
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": TEXT}], "stream": True,
                              "stream_options": {"include_usage": True}})
    ctx = Context("req1")
    got = await _collect(EchoFullEngine(delay).generate(req, ctx))
    want = ChatChunks("m", "req1")
    want.created = got[0]["created"]
    expected = [want.delta(ch) for ch in TEXT] + [want.delta(None, "stop"), want.usage(len(TEXT), len(TEXT))]
    assert [_bytes(c) for c in got] == [orjson.dumps(e) for e in expected]
    assert got[1] == expected[1]  # a reader that decodes sees the same dict
    assert (ctx.prompt_tokens, ctx.completion_tokens) == (len(TEXT), len(TEXT))


async def test_completion_text_and_max_tokens() -> None:
    req = parse_completion_request({"model": "m", "prompt": TEXT, "max_tokens": 5, "stream": True})
    got = await _collect(EchoFullEngine(0.0).generate(req, Context("r")))
    want = CompletionChunks("m", "r")
    want.created = got[0]["created"]
    expected = [want.delta(ch) for ch in TEXT[:5]] + [want.delta(None, "length")]  # no usage: not asked
    assert [_bytes(c) for c in got] == [orjson.dumps(e) for e in expected]


async def test_stop_mid_stream_finishes_with_stop_and_counts_what_was_sent() -> None:
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": TEXT}], "stream": True,
                              "stream_options": {"include_usage": True}})
    ctx = Context()
    stream = EchoFullEngine(0.0).generate(req, ctx)
    first = [await stream.__anext__() for _ in range(3)]
    ctx.stop_generating()
    rest = await _collect(stream)
    assert "".join(c["choices"][0]["delta"]["content"] for c in first) == TEXT[:3]
    assert rest[0]["choices"][0]["finish_reason"] == "stop"
    assert rest[1]["usage"]["completion_tokens"] == 3
    assert len(rest) == 2


async def test_close_ends_the_stream_and_a_waiting_chunk_is_dropped() -> None:
    errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": TEXT}], "stream": True})
    stream = EchoFullEngine(0.05).generate(req, Context())
    await stream.__anext__()
    waiting: Any = stream.__anext__()  # due in 50 ms
    waiting.cancel()  # what a task's cancellation does to the future it awaits
    await stream.aclose()  # type: ignore[attr-defined]
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    await asyncio.sleep(0.08)  # its deadline passes: the cancelled future is left alone
    assert errors == []


async def test_logprobs_is_refused_with_the_first_chunk() -> None:
    from dynamo.errors import RequestError

    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True})
    stream = EchoFullEngine(0.0).generate(req, Context())
    with pytest.raises(RequestError):
        await stream.__anext__()
