"""Disaggregated prefill/decode with images, on llama.cpp with the SmolLM2 GGUF and the colour projector, in
process (the real TCP transfer between a prefill and a decode engine, as test_disagg_llamacpp.py does).

The prefill worker encodes the image; the KV state it hands over holds the image's keys and values, so the
decode worker loads it and continues without encoding the image again (its projector evaluates nothing),
and the answer equals aggregated serving's.  The decode worker still reads the image (to check the
prefill's placeholder run against its own), which costs a decode and resize, not an encode.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from dynamo.disagg.worker import DisaggWorkerEngine
from dynamo.llm.engine import Context
from dynamo.llm.gguf_card import load_gguf
from dynamo.llm.preprocessor import Preprocessor
from dynamo.llm.protocols.common import PreprocessedRequest
from dynamo.llm.protocols.openai import parse_chat_request
from harness.colour_projector import COLOURS, QUESTION, solid_png

pytestmark = pytest.mark.timeout(240)


async def _engine(gguf: Path, projector: Path) -> Any:
    from dynamo.engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(gguf, context_length=512, args={"n_parallel": 2, "n_threads": 1}, mmproj=projector)
    await engine.start()
    return engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(gguf, colour_projector):
    pre = DisaggWorkerEngine(await _engine(gguf, colour_projector), "prefill", host="127.0.0.1")
    dec = DisaggWorkerEngine(await _engine(gguf, colour_projector), "decode", pull_timeout=10)
    agg = await _engine(gguf, colour_projector)
    await pre.start()
    try:
        yield pre, dec, agg
    finally:
        for e in (pre, dec, agg):
            await e.close()


async def request(gguf: Path, colour: str, image_tokens: int) -> PreprocessedRequest:
    card = load_gguf(gguf)
    card.image_tokens = image_tokens
    url = "data:image/png;base64," + base64.b64encode(
        solid_png(tuple(255 * c for c in COLOURS[colour]), (48, 40))).decode()  # type: ignore[arg-type]
    raw = {"model": "m", "max_tokens": 10, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]}]}
    return (await Preprocessor(card).chat_async(parse_chat_request(raw), raw)).request


async def tokens(engine: Any, r: PreprocessedRequest) -> list[int]:
    return [t async for out in engine.generate(r, Context()) for t in out.token_ids]


@pytest.mark.asyncio(loop_scope="module")
async def test_the_decode_worker_loads_the_image_kv_and_encodes_nothing(engines, gguf, tok):
    pre, dec, agg = engines
    for colour in ("red", "yellow"):
        r = await request(gguf, colour, agg.image_tokens)
        expected = await tokens(agg, r)
        assert colour in tok.decode(expected).lower()
        [first] = [o async for o in pre.generate(copy.deepcopy(r), Context())]
        encoded = pre.engine.scheduler.image_tokens
        assert encoded > 0
        r.disaggregated_params = first.disaggregated_params
        before = dec.imported
        assert await tokens(dec, r) == expected
        assert dec.imported == before + 1
        assert dec.engine.scheduler.image_tokens == 0  # the image's KV came with the state
