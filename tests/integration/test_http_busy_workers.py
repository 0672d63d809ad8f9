"""Every worker busy (the remote engines' overload 503, raised after a request got past the frontend's own
limit): chat, embeddings and responses answer it the same way and count it in
``<prefix>_model_rejection`` with the request's model.  Stand-in models on an in-process service."""

from __future__ import annotations

from typing import Any, AsyncIterator

import httpx
import pytest

from dynamo.errors import ServiceUnavailableError
from dynamo.frontend.http.metrics import FrontendMetrics
from dynamo.frontend.http.service import HttpService
from dynamo.frontend.model_manager import ModelManager
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard

BUSY = "Every worker serving this model is busy; try again shortly"


class Busy:
    """A served model whose every worker is at its limit and whose wait queue is full."""

    tokenizer = None

    def __init__(self, name: str):
        self.name = name
        self.card = ModelCard.placeholder(name)

    def chat(self, req: Any, raw: dict, ctx: Context) -> AsyncIterator[Any]:
        return self._busy()

    completions = chat

    async def _busy(self) -> AsyncIterator[Any]:
        raise ServiceUnavailableError(BUSY, retry_after=3, overload=True)
        yield  # an async generator, as the pipelines are

    async def embed(self, inputs: Any, dimensions: Any, ctx: Context) -> Any:
        raise ServiceUnavailableError(BUSY, retry_after=3, overload=True)


@pytest.fixture
async def service() -> AsyncIterator[HttpService]:
    manager = ModelManager()
    manager.add(Busy("Busy-Model"))
    svc = HttpService(manager, metrics=FrontendMetrics("busy_frontend"))
    await svc.start("127.0.0.1", 0)
    yield svc
    await svc.stop(grace=1)


async def test_busy_workers_answer_and_count_alike(service: HttpService):
    model = "Busy-Model"
    requests = [("/v1/chat/completions", "chat_completions", {"model": model, "stream": True,
                                                              "messages": [{"role": "user", "content": "hi"}]}),
                ("/v1/completions", "completions", {"model": model, "prompt": "hi"}),
                ("/v1/embeddings", "embeddings", {"model": model, "input": "hi"}),
                ("/v1/responses", "responses", {"model": model, "input": "hi", "stream": True})]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.port}") as client:
        for path, _, body in requests:
            r = await client.post(path, json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "3", (path, r.text)
            assert r.json()["error"] == {"message": BUSY, "type": "service_unavailable", "param": None, "code": 503}
        metrics = (await client.get("/metrics")).text
    for _, endpoint, _ in requests:
        assert f'busy_frontend_model_rejection_total{{endpoint="{endpoint}",model="busy-model"}} 1.0' in metrics
    assert service.admission.admitted == 0 and not service.admission.tasks and not service.admission.contexts
