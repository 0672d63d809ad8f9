"""The request plumbing of the vLLM, SGLang and TensorRT-LLM engines, against fakes shaped like the engines.

SGLang and TensorRT-LLM need CUDA and never run here, so their ``generate`` (stream, finish, abort when the
consumer stops or the context is stopped, one-line errors) is exercised with stand-ins for ``sgl.Engine``
and ``tensorrt_llm.LLM``; vLLM's with a stand-in for ``AsyncLLM`` (the vLLM tier runs the real one).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dynamo.engines import sglang as sg
from dynamo.engines import trtllm as trt
from dynamo.engines.vllm import engine as vl
from dynamo.errors import EngineError
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard
from dynamo.llm.protocols.common import PreprocessedRequest, StopConditions
from dynamo.run_config import RunConfig
from harness.wait import until


def _request() -> PreprocessedRequest:
    return PreprocessedRequest(token_ids=[1, 5, 6], stop_conditions=StopConditions(max_tokens=8), eos_token_ids=[2])


def _card() -> ModelCard:
    return ModelCard(display_name="tiny", path=Path("/nonexistent/tiny"), eos_token_ids=[2])


class _Steps:
    """An engine's stream: yields ``steps`` one per loop turn; ``fail`` raises after them; records closing."""

    def __init__(self, steps: list[Any], fail: BaseException | None = None, endless: Any = None):
        self.steps, self.fail, self.endless = list(steps), fail, endless
        self.closed = False

    def __aiter__(self) -> "_Steps":
        return self

    async def __anext__(self) -> Any:
        await asyncio.sleep(0)
        if self.steps:
            return self.steps.pop(0)
        if self.fail is not None:
            raise self.fail
        if self.endless is not None:
            return self.endless
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


# -- fakes: one per engine, with the same face for the tests ------------------------------------------

class _Fake:
    """An engine with a stand-in for its library: ``step(ids, finished)`` makes one streamed item,
    ``aborted`` lists the aborts it received, ``stream`` is what its request streams."""

    label = ""
    stream_class = _Steps

    def __init__(self, steps: list[tuple[list[int], bool]], *, fail: BaseException | None = None,
                 endless: bool = False):
        self.aborted: list[str] = []
        self.stream = self.stream_class([self.step(ids, fin) for ids, fin in steps], fail=fail,
                             endless=self.step([5], False) if endless else None)
        self.engine = self.build()

    def build(self) -> Any:
        raise NotImplementedError

    def step(self, ids: list[int], finished: bool) -> Any:
        raise NotImplementedError


class _FakeSglang(_Fake):
    label = "SGLang"

    def build(self) -> Any:
        async def async_generate(**kw: Any) -> _Steps:
            assert kw["stream"] is True and kw["input_ids"] == [1, 5, 6]
            return self.stream

        engine = sg.SglangEngine(RunConfig(output="sglang"), _card())
        engine._engine = SimpleNamespace(async_generate=async_generate,
                                         tokenizer_manager=SimpleNamespace(abort_request=self.aborted.append))
        return engine

    def step(self, ids: list[int], finished: bool) -> Any:
        return {"output_ids": ids, "meta_info": {"finish_reason": {"type": "length"} if finished else None}}


class _TrtResult(_Steps):
    """A ``GenerationResult``: aborted through itself, and no ``aclose``."""

    aclose = None  # type: ignore[assignment]
    on_abort: Any = None

    def abort(self) -> None:
        self.on_abort()


class _FakeTrtllm(_Fake):
    label = "TensorRT-LLM"
    stream_class = _TrtResult

    def build(self) -> Any:
        self.stream.on_abort = lambda: self.aborted.append("result")
        engine = trt.TrtllmEngine(RunConfig(output="trtllm"), _card())
        engine._SamplingParams = dict
        engine._llm = SimpleNamespace(generate_async=lambda ids, sampling_params, streaming: self.stream)
        return engine

    def step(self, ids: list[int], finished: bool) -> Any:
        choice = SimpleNamespace(token_ids_diff=ids, finish_reason="length" if finished else None, stop_reason=None)
        return SimpleNamespace(outputs=[choice], finished=finished)


class _FakeVllm(_Fake):
    label = "vLLM"

    def build(self) -> Any:
        async def abort(rid: str) -> None:
            self.aborted.append(rid)

        engine = vl.VllmEngine(RunConfig(output="vllm"), _card())
        engine._llm = SimpleNamespace(generate=lambda prompt, params, rid, lora_request=None: self.stream,
                                      abort=abort)
        engine._types = (lambda **kw: kw, lambda ids: ids, SimpleNamespace(DELTA="delta"), dict)
        return engine

    def step(self, ids: list[int], finished: bool) -> Any:
        choice = SimpleNamespace(token_ids=ids, finish_reason="length" if finished else None, stop_reason=None,
                                 logprobs=None, cumulative_logprob=None)
        return SimpleNamespace(outputs=[choice], finished=finished)


FAKES = [_FakeSglang, _FakeTrtllm, _FakeVllm]


async def _take(gen: Any, n: int | None = None) -> list[Any]:
    out = []
    async for item in gen:
        out.append(item)
        if n is not None and len(out) == n:
            break
    return out


# -- all three ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fake", FAKES)
async def test_streams_until_the_finish(fake: type[_Fake]) -> None:
    f = fake([([5], False), ([6, 7], True)])
    outs = await _take(f.engine.generate(_request(), Context("r")))
    assert [(o.token_ids, o.finish_reason) for o in outs] == [([5], None), ([6, 7], "length")]
    assert f.aborted == [] and not f.stream.closed


@pytest.mark.parametrize("fake", FAKES)
async def test_aborts_when_the_consumer_stops(fake: type[_Fake]) -> None:
    f = fake([], endless=True)
    gen = f.engine.generate(_request(), Context("r"))
    assert len(await _take(gen, 2)) == 2
    await gen.aclose()
    assert len(f.aborted) == 1
    assert f.stream.closed or fake is _FakeTrtllm


@pytest.mark.parametrize("fake", FAKES)
@pytest.mark.parametrize("how", ["stop_generating", "kill"])
async def test_aborts_once_when_the_context_stops(fake: type[_Fake], how: str) -> None:
    f = fake([], endless=True)
    context = Context("r")
    gen = f.engine.generate(_request(), context)
    await _take(gen, 1)
    getattr(context, how)()
    await until(lambda: f.aborted, 5, "the abort")
    assert len(f.aborted) == 1
    await gen.aclose()  # the consumer goes too: no second abort
    assert len(f.aborted) == 1


@pytest.mark.parametrize("fake", FAKES)
async def test_aborts_when_cancelled(fake: type[_Fake]) -> None:
    f = fake([], endless=True)
    gen = f.engine.generate(_request(), Context("r"))

    streaming = asyncio.Event()

    async def consume() -> None:
        async for _ in gen:
            streaming.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(streaming.wait(), 5)  # the request is under way in the engine
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(f.aborted) == 1


@pytest.mark.parametrize("fake", FAKES)
async def test_engine_error_is_one_line(fake: type[_Fake]) -> None:
    f = fake([([5], False)], fail=RuntimeError("scheduler\n  died"))
    with pytest.raises(EngineError, match=f"^{fake.label}: scheduler died$"):
        await _take(f.engine.generate(_request(), Context("r")))
    assert len(f.aborted) == 1  # the request is not known to be over


# -- vLLM only ----------------------------------------------------------------------------------------

async def test_vllm_request_stopped_before_it_starts_is_not_sent() -> None:
    f = _FakeVllm([([5], True)])
    context = Context("r")
    context.stop_generating()
    assert await _take(f.engine.generate(_request(), context)) == [] and f.aborted == []
    assert len(f.stream.steps) == 1
