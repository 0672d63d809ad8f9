"""``out=vllm --embedding`` around a stand-in for vLLM's ``AsyncLLM`` (the real one: tests/vllm/): inputs
longer than the context, vLLM's request errors as 400s, and one failing input stopping the others."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace
from typing import Any, AsyncIterator

import pytest

from dynamo.engines.vllm.embed import VllmEmbeddingEngine
from dynamo.errors import RequestError
from dynamo.llm.engine import Context


class ClientError(Exception):
    def __init__(self, message: str, parameter: str | None = None):
        super().__init__(message)
        self.parameter = parameter


class FakeLLM:
    """Token ids [9] are refused as vLLM refuses a bad request; [5] waits until cancelled."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def encode(self, ids: list[int], params: Any, rid: str) -> AsyncIterator[Any]:
        if ids == [9]:
            await asyncio.sleep(0.01)
            raise ClientError("Model 'm' does not support Matryoshka embeddings")
        if ids == [5]:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(rid)
                raise
        yield SimpleNamespace(error=None, outputs=SimpleNamespace(data=SimpleNamespace(tolist=lambda: [float(len(ids))])))


def engine(llm: FakeLLM) -> VllmEmbeddingEngine:
    eng = VllmEmbeddingEngine.__new__(VllmEmbeddingEngine)  # no vLLM, no tokenizer: token-id inputs only
    eng.card = SimpleNamespace(context_length=4, display_name="m")  # type: ignore[assignment]
    eng.core = SimpleNamespace(llm=llm)  # type: ignore[assignment]
    eng._ids = itertools.count()
    eng._params = lambda task, dimensions: SimpleNamespace(task=task, dimensions=dimensions)
    eng._client_error = ClientError
    eng._tokens_input = list
    return eng


async def test_vectors_and_usage() -> None:
    out = await engine(FakeLLM()).embed([[1, 2], [3]], None, Context())
    assert out.vectors == [[2.0], [1.0]] and out.prompt_tokens == 3


async def test_an_input_longer_than_the_context_is_a_400() -> None:
    with pytest.raises(RequestError) as e:
        await engine(FakeLLM()).embed([[1], [1, 2, 3, 4, 5]], None, Context())
    assert e.value.param == "input" and "input[1] has 5 tokens" in e.value.message


async def test_a_refused_input_is_a_400_and_stops_the_others() -> None:
    llm = FakeLLM()
    with pytest.raises(RequestError) as e:
        await engine(llm).embed([[5], [9]], 8, Context())
    assert e.value.param == "dimensions" and "Matryoshka" in e.value.message
    assert len(llm.cancelled) == 1  # the input still waiting on vLLM was given up
