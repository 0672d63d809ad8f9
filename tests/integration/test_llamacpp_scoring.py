"""Scoring a text the way eval harnesses do, on llama.cpp for real (SmolLM2 GGUF), locally and through
``out=dyn``: ``/v1/completions`` with ``echo`` and ``logprobs`` on prompts given as token ids (one, or a
list of them in one request), ``max_tokens: 0`` (the prompt alone), and the entry of the end-of-turn
token that ends a choice (a scorer counts one entry per generated token).  Skipped like test_llamacpp.py
when the GGUF or llama-cpp-python is missing."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")

from harness.smollm2 import SMOLLM2_MODEL as MODEL  # noqa: E402

pytestmark = pytest.mark.timeout(300)
TEXT = "The cat sat on the mat."
OTHER = "Water boils at one hundred degrees."
# a finished assistant turn: SmolLM2's likeliest next token is <|im_end|> (its EOS)
FINISHED_TURN = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\nHi! How can I help you today?"


@pytest.fixture(params=["local", "dyn"])
def api(request) -> "openai.OpenAI":
    return request.getfixturevalue("smollm2_client" if request.param == "local" else "smollm2_dyn_client")


def ids_of(api: "openai.OpenAI", text: str) -> list[int]:
    base = str(api.base_url).removesuffix("/").removesuffix("/v1")
    r = httpx.post(base + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def score(api: "openai.OpenAI", prompt: Any, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 1)
    return api.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, temperature=0, **kw)


def test_token_id_prompt_echoes_like_the_text_prompt(api):
    ids = ids_of(api, TEXT)
    by_text, by_ids = score(api, TEXT), score(api, ids)
    t, i = by_text.choices[0], by_ids.choices[0]
    assert i.text == t.text and i.text.startswith(TEXT)
    assert i.logprobs.tokens == t.logprobs.tokens and len(i.logprobs.tokens) == len(ids) + 1
    assert i.logprobs.token_logprobs[0] is None and i.logprobs.top_logprobs[0] is None
    assert i.logprobs.token_logprobs[1:] == pytest.approx(t.logprobs.token_logprobs[1:], abs=1e-4)
    assert i.logprobs.text_offset == t.logprobs.text_offset
    assert by_ids.usage.prompt_tokens == len(ids) and by_ids.usage.completion_tokens == 1


def test_several_prompts_in_one_request_are_one_choice_each(api):
    a, b = ids_of(api, TEXT), ids_of(api, OTHER)
    both = score(api, [a, b])
    assert [c.index for c in both.choices] == [0, 1]
    for choice, ids in zip(both.choices, (a, b), strict=True):
        alone = score(api, ids).choices[0]
        assert choice.text == alone.text and choice.logprobs.tokens == alone.logprobs.tokens
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(alone.logprobs.token_logprobs[1:], abs=1e-4)
    assert both.usage.prompt_tokens == len(a) + len(b) and both.usage.completion_tokens == 2
    texts = api.completions.create(model=MODEL, prompt=[TEXT, OTHER], max_tokens=2, temperature=0)
    assert [c.index for c in texts.choices] == [0, 1] and all(c.text for c in texts.choices)


def test_max_tokens_zero_gives_the_prompt_and_its_logprobs_only(api):
    ids = ids_of(api, TEXT)
    r = score(api, ids, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(score(api, ids).choices[0].logprobs.token_logprobs[1:-1],
                                                               abs=1e-4)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    plain = api.completions.create(model=MODEL, prompt=TEXT, echo=True, max_tokens=0)
    assert plain.choices[0].text == TEXT and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        api.completions.create(model=MODEL, prompt=TEXT, max_tokens=0)


def test_the_end_of_turn_token_that_ends_a_choice_keeps_its_entry(api):
    ids = ids_of(api, FINISHED_TURN)
    r = score(api, ids, max_tokens=4)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.text == FINISHED_TURN  # never shown in the text
    assert len(choice.logprobs.tokens) == len(ids) + 1 == r.usage.prompt_tokens + r.usage.completion_tokens
    assert choice.logprobs.tokens[-1] == "<|im_end|>" and choice.logprobs.token_logprobs[-1] < 0
