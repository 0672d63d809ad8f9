"""Engines that fail, before or during a stream: the client always gets a clean, OpenAI-shaped answer.

The echo engines never fail, so these tests serve small stand-in models from an in-process
:class:`HttpService` on a real socket and talk to it with httpx and the openai SDK.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamo.errors import EngineError
from dynamo.frontend.http.metrics import FrontendMetrics
from dynamo.frontend.http.service import HttpService
from dynamo.frontend.model_manager import ModelManager
from dynamo.llm.chunks import ChatChunks, CompletionChunks
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard
from dynamo.llm.protocols.openai import ChatCompletionRequest


class StandIn:
    """A served model whose engine behaves as its name says."""

    tokenizer = None

    def __init__(self, name: str):
        self.name = name
        self.card = ModelCard.placeholder(name)

    def chat(self, req: Any, raw: dict, ctx: Context) -> AsyncIterator[Any]:
        return self._run(req, ctx)

    def completions(self, req: Any, raw: dict, ctx: Context) -> AsyncIterator[Any]:
        return self._run(req, ctx)

    async def _run(self, req: Any, ctx: Context) -> AsyncIterator[Any]:
        chunks = ChatChunks(req.model, ctx.id) if isinstance(req, ChatCompletionRequest) else CompletionChunks(req.model, ctx.id)
        if self.name == "fails-at-start":
            raise EngineError("engine could not start: out of memory")
        ctx.completion_tokens = 1
        yield chunks.delta("partial ")
        if self.name == "fails-mid-stream":
            raise EngineError("engine lost its GPU")
        if self.name == "has-a-bug":
            raise ValueError("unexpected shape")
        ctx.completion_tokens = 2
        yield chunks.delta("answer")
        yield chunks.delta(None, "stop")


NAMES = ["works", "fails-at-start", "fails-mid-stream", "has-a-bug"]


@pytest.fixture
async def service() -> AsyncIterator[HttpService]:
    manager = ModelManager()
    for name in NAMES:
        manager.add(StandIn(name))
    svc = HttpService(manager, metrics=FrontendMetrics("test_frontend"))
    await svc.start("127.0.0.1", 0)
    yield svc
    await svc.stop(grace=1)


def url(svc: HttpService) -> str:
    return f"http://127.0.0.1:{svc.port}"


def chat(model: str, stream: bool) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}


async def sse_data(client: httpx.AsyncClient, path: str, body: dict) -> list[str]:
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        return [line[5:].strip() async for line in r.aiter_lines() if line.startswith("data:")]


async def test_working_stand_in(service: HttpService):
    async with httpx.AsyncClient(base_url=url(service)) as client:
        data = await sse_data(client, "/v1/chat/completions", chat("works", True))
        assert data[-1] == "[DONE]"
        assert "".join(json.loads(d)["choices"][0]["delta"].get("content") or "" for d in data[:-1]) == "partial answer"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_failure_before_the_first_chunk_is_a_500(service: HttpService, stream: bool, path: str):
    body = chat("fails-at-start", stream) if "chat" in path else {"model": "fails-at-start", "prompt": "x", "stream": stream}
    async with httpx.AsyncClient(base_url=url(service)) as client:
        r = await client.post(path, json=body)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["message"] == "Failed to generate completions: engine could not start: out of memory"
        assert err["type"] == "server_error"
        assert (await client.post("/v1/chat/completions", json=chat("works", False))).status_code == 200


async def test_engine_error_mid_stream_is_an_error_event_then_done(service: HttpService):
    async with httpx.AsyncClient(base_url=url(service)) as client:
        data = await sse_data(client, "/v1/chat/completions", chat("fails-mid-stream", True))
    assert json.loads(data[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # the opening
    assert json.loads(data[1])["choices"][0]["delta"]["content"] == "partial "
    error = json.loads(data[2])["error"]
    assert "engine lost its GPU" in error["message"]
    assert data[-1] == "[DONE]"


async def test_unexpected_exception_mid_stream_still_ends_the_stream(service: HttpService):
    async with httpx.AsyncClient(base_url=url(service)) as client:
        data = await sse_data(client, "/v1/completions", {"model": "has-a-bug", "prompt": "x", "stream": True})
        assert data[-1] == "[DONE]"
        assert "ValueError: unexpected shape" in json.loads(data[1])["error"]["message"]
        assert (await client.post("/v1/completions", json={"model": "works", "prompt": "x"})).status_code == 200


async def test_engine_error_mid_stream_unary_is_a_500(service: HttpService):
    async with httpx.AsyncClient(base_url=url(service)) as client:
        r = await client.post("/v1/chat/completions", json=chat("fails-mid-stream", False))
    assert r.status_code == 500
    assert "engine lost its GPU" in r.json()["error"]["message"]


async def test_openai_sdk_raises_the_mid_stream_error(service: HttpService):
    client = openai.AsyncOpenAI(base_url=url(service) + "/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(model="fails-mid-stream", messages=[{"role": "user", "content": "hi"}],
                                                  stream=True)
    seen = []
    with pytest.raises(openai.APIError, match="engine lost its GPU"):
        async for chunk in stream:
            seen.append(chunk.choices[0].delta.content)
    assert seen == ["", "partial "]  # the role-only opening chunk, then the text
    await client.close()


async def test_failed_streams_count_as_errors(service: HttpService):
    async with httpx.AsyncClient(base_url=url(service)) as client:
        await sse_data(client, "/v1/chat/completions", chat("fails-mid-stream", True))
        await sse_data(client, "/v1/chat/completions", chat("works", True))
        metrics = (await client.get("/metrics")).text
    status = {}
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == "test_frontend_requests_total":
                status[s.labels["model"]] = s.labels["status"]
    assert status == {"fails-mid-stream": "error", "works": "success"}


class EndlessCoreEngine:
    """A token engine that never finishes on its own; records how its work ended."""

    kind = "core"

    def __init__(self) -> None:
        self.started = 0
        self.ended: list[str] = []

    async def generate(self, request: Any, context: Context) -> AsyncIterator[Any]:
        import asyncio

        from dynamo.llm.protocols.common import EngineOutput

        self.started += 1
        try:
            while not context.is_stopped:
                await asyncio.sleep(0.005)
                yield EngineOutput(token_ids=[300])
            self.ended.append("stopped")
        except GeneratorExit:
            self.ended.append("closed")
            raise
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
async def test_client_going_away_stops_the_engine(tiny_model, stream: bool):
    import asyncio

    from dynamo.llm.model_card import load_hf_folder
    from dynamo.llm.pipeline import CorePipeline

    engine = EndlessCoreEngine()
    manager = ModelManager()
    manager.add(CorePipeline("tiny-chat", load_hf_folder(tiny_model), engine))
    svc = HttpService(manager, metrics=FrontendMetrics("test_endless"))
    await svc.start("127.0.0.1", 0)
    try:
        body = {"model": "tiny-chat", "prompt": "go on forever", "stream": stream}
        async with httpx.AsyncClient(base_url=url(svc), timeout=30) as client:
            if stream:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    lines = r.aiter_lines()
                    while not (await lines.__anext__()).startswith("data:"):
                        pass
            else:
                task = asyncio.create_task(client.post("/v1/completions", json=body))
                for _ in range(500):
                    if engine.started:
                        break
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.05)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
        for _ in range(500):
            if engine.ended:
                break
            await asyncio.sleep(0.01)
        assert engine.started == 1
        assert engine.ended, "the engine kept generating after the client left"
    finally:
        await svc.stop(grace=1)


async def test_client_gone_at_the_last_write_is_not_an_error(service: HttpService, monkeypatch, caplog):
    """A client that closes as its stream ends (a load generator stopping) is routine, not a server error."""
    from aiohttp.client_exceptions import ClientConnectionResetError

    from dynamo.frontend.http import sse

    async def closing(self: Any, data: bytes = b"") -> None:
        raise ClientConnectionResetError("Cannot write to closing transport")

    monkeypatch.setattr(sse.SseResponse, "write_eof", closing)
    caplog.set_level("DEBUG", logger="dynamo.frontend.http.sse")
    async with httpx.AsyncClient(base_url=url(service)) as client:
        with pytest.raises(httpx.HTTPError):  # the body never ends: the client sees a cut stream
            async with client.stream("POST", "/v1/chat/completions", json=chat("works", True)) as r:
                async for _ in r.aiter_lines():
                    pass
        monkeypatch.undo()
        assert (await client.post("/v1/chat/completions", json=chat("works", False))).status_code == 200
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert any("client went away before the end of the stream" in r.getMessage() for r in caplog.records)
