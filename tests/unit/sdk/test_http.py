"""``@api`` routes (dynamo.sdk.http) and request annotations (dynamo.sdk.annotations), on a real aiohttp server."""

from __future__ import annotations

from typing import Any, AsyncIterator

import httpx
import pytest
from pydantic import BaseModel

from dynamo.sdk import api, service
from dynamo.sdk.annotations import convert, request_annotation
from dynamo.sdk.http import start_api
from dynamo.sdk.service import spec_of
from harness.proc import free_port


class Req(BaseModel):
    text: str
    n: int = 1


class FakeStreamingResponse:
    """Starlette's StreamingResponse as the SDK sees it: ``body_iterator`` and ``media_type``."""

    def __init__(self, body_iterator: AsyncIterator[str], media_type: str) -> None:
        self.body_iterator = body_iterator
        self.media_type = media_type


@service
class Routes:
    @api()
    async def words(self, text: str, times: int = 2):
        for _ in range(times):
            yield text + ";"

    @api()
    async def model(self, req: Req) -> dict[str, Any]:
        return {"text": req.text.upper(), "n": req.n}

    @api(name="sse")
    async def streaming_response(self, text: str) -> FakeStreamingResponse:
        async def gen() -> AsyncIterator[str]:
            yield f"data: {text}\n\n"
            yield "data: [DONE]\n\n"
        return FakeStreamingResponse(gen(), "text/event-stream")

    @api()
    async def items(self):
        yield {"a": 1}
        yield Req(text="x")

    @api()
    async def fails(self, text: str):
        raise RuntimeError("boom " + text)
        yield  # an async generator that fails before its first item


@pytest.fixture
async def base_url():
    port = free_port()
    runner = await start_api(Routes(), spec_of(Routes).apis(), "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_routes_bind_stream_and_return(base_url):
    async with httpx.AsyncClient(base_url=base_url) as c:
        r = await c.post("/words", json={"text": "hi", "times": 3})
        assert (r.status_code, r.text) == (200, "hi;hi;hi;")
        r = await c.post("/model", json={"text": "abc"})
        assert r.json() == {"text": "ABC", "n": 1}
        r = await c.post("/model", json={"n": 2})
        assert r.status_code == 422 and "text" in r.json()["error"]
        r = await c.post("/words", json={})
        assert r.status_code == 422 and "missing field(s): text" in r.json()["error"]
        r = await c.post("/sse", json={"text": "t"})
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.text == "data: t\n\ndata: [DONE]\n\n"
        r = await c.post("/items")
        assert r.text == '{"a": 1}\n{"text":"x","n":1}\n'
        r = await c.post("/fails", json={"text": "now"})
        assert r.status_code == 500 and r.json() == {"error": "RuntimeError: boom now"}


def test_request_annotations():
    async def endpoint(self, req: Req): ...

    async def plain(self, req: dict): ...

    assert request_annotation(endpoint) is Req
    assert convert(Req, '{"text": "a"}') == Req(text="a")
    assert convert(Req, {"text": "b", "n": 3}) == Req(text="b", n=3)
    assert convert(request_annotation(plain), '{"text": "a"}') == '{"text": "a"}'  # a plain type: as it came
