"""``usage.prompt_tokens_details.cached_tokens``: from each engine's own count, through the pipeline, the
worker's wire items and the unary fold, and absent when the engine says nothing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator

import pytest

from dynamo.engines import sglang as sg
from dynamo.engines.mocker import MockerEngine
from dynamo.engines.vllm import engine as vl
from dynamo.llm.aggregate import fold_chat, fold_completion
from dynamo.llm.engine import Context
from dynamo.llm.model_card import load_hf_folder
from dynamo.llm.pipeline import CorePipeline
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest, StopConditions
from dynamo.llm.protocols.openai import parse_chat_request, parse_completion_request
from dynamo.llm.protocols.wire import read_output
from dynamo.worker.handlers import backend_handler


class _Engine:
    """A core engine that answers with three tokens and, if given, a cached count on the first item."""

    kind = "core"

    def __init__(self, cached: int | None):
        self.cached = cached

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EngineOutput]:
        yield EngineOutput(token_ids=[100], cached_tokens=self.cached)
        yield EngineOutput(token_ids=[101])
        yield EngineOutput(token_ids=[102], finish_reason="length")


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


async def _chat_usage(pipeline: CorePipeline, stream: bool) -> dict[str, Any]:
    raw = {**CHAT, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    ctx = Context()
    chunks = pipeline.chat(parse_chat_request(raw), raw, ctx)
    if stream:
        items = [c async for c in chunks]
        assert items[-1]["choices"] == []
        return items[-1]["usage"]
    return (await fold_chat(chunks, ctx, "tiny"))["usage"]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_usage_reports_the_engines_cached_tokens(tiny_model: Path, stream: bool):
    pipeline = CorePipeline("tiny", load_hf_folder(tiny_model), _Engine(cached=4))
    usage = await _chat_usage(pipeline, stream)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4}
    assert usage["completion_tokens"] == 3


@pytest.mark.parametrize("stream", [False, True])
async def test_no_details_when_the_engine_does_not_say(tiny_model: Path, stream: bool):
    pipeline = CorePipeline("tiny", load_hf_folder(tiny_model), _Engine(cached=None))
    usage = await _chat_usage(pipeline, stream)
    assert "prompt_tokens_details" not in usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + 3


async def test_completions_usage_and_a_count_larger_than_the_prompt_is_capped(tiny_model: Path):
    pipeline = CorePipeline("tiny", load_hf_folder(tiny_model), _Engine(cached=10_000))
    raw = {"model": "tiny", "prompt": "abc", "max_tokens": 3}
    ctx = Context()
    usage = (await fold_completion(pipeline.completions(parse_completion_request(raw), raw, ctx), ctx, "tiny"))["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": usage["prompt_tokens"]}


async def test_worker_items_carry_the_count_and_the_frontend_reads_it(tiny_model: Path):
    """out=dyn: a Backend worker's items are dicts on the wire, the count in 1.x's ``completion_usage`` (first
    and last item); it survives into the frontend's EngineOutput."""
    card = load_hf_folder(tiny_model)
    handler = backend_handler(card, _Engine(cached=7))
    req = PreprocessedRequest(token_ids=[5, 6, 7, 8], stop_conditions=StopConditions(max_tokens=3), detokenize=True)
    items = [item async for item in handler(req.to_dict())]
    assert items[0]["completion_usage"]["prompt_tokens_details"]["cached_tokens"] == 7
    assert read_output(items[0]).cached_tokens == 7
    assert all(read_output(item).cached_tokens is None for item in items[1:-1])
    # and an engine that says nothing: the count is null, and the frontend reads none
    quiet = [item async for item in backend_handler(card, _Engine(cached=None))(req.to_dict())]
    assert all(read_output(item).cached_tokens is None for item in quiet)


async def test_mocker_reports_its_prefix_hits_on_the_first_item():
    eng = MockerEngine({"speedup_ratio": 10000.0, "block_size": 4, "num_gpu_blocks": 64}, vocab_size=40,
                       special_ids={0, 1, 2}, seed=3)
    await eng.start()
    try:
        prompt = list(range(3, 17))  # 14 tokens: 3 complete blocks of 4
        req = lambda: PreprocessedRequest(token_ids=prompt, stop_conditions=StopConditions(max_tokens=3))  # noqa: E731
        first = [i async for i in eng.generate(req(), Context())]
        assert first[0].cached_tokens == 0
        assert all(i.cached_tokens is None for i in first[1:])
        second = [i async for i in eng.generate(req(), Context())]
        assert second[0].cached_tokens == 12
    finally:
        await eng.close()


def test_vllm_num_cached_tokens_on_the_first_output_only():
    out = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[9], finish_reason=None, stop_reason=None,
                                                   logprobs=None, cumulative_logprob=None)],
                          finished=False, num_cached_tokens=32)
    assert vl.convert_output(out, [2], cached_tokens=True).cached_tokens == 32
    assert vl.convert_output(out, [2]).cached_tokens is None
    old = SimpleNamespace(outputs=out.outputs, finished=False)  # a vLLM without the attribute
    assert vl.convert_output(old, [2], cached_tokens=True).cached_tokens is None


def test_sglang_meta_cached_tokens_reported_once():
    conv = sg.OutputConverter([2])
    first = conv.convert({"output_ids": [5], "meta_info": {"cached_tokens": 48, "finish_reason": None}})
    later = conv.convert({"output_ids": [6], "meta_info": {"cached_tokens": 48, "finish_reason": None}})
    assert (first.cached_tokens, later.cached_tokens) == (48, None)
    assert sg.OutputConverter([2]).convert({"output_ids": [5], "meta_info": {}}).cached_tokens is None
