"""Images through ``dynamo-run in=http out=vllm`` for real: vLLM's CPU build serving a tiny vision model.

The model (harness/tiny_vlm.py) is an Idefics3 (SmolVLM's architecture) with **random weights**: these
tests prove the plumbing (the image reaches vLLM's image processor and encoder, in its place in the
prompt, and vLLM's prefix cache is keyed by the image's content), not the quality of any answer.  What a
random model can show honestly: at temperature 0 the same image gives the same tokens, another image other
tokens, and swapping two images in a message changes the answer.  Naming colours is tested with
llama.cpp's closed-form projector (tests/integration/test_llamacpp_images.py).

One server for the module (vLLM takes 20-60 s to start here); KV blocks of 32 tokens (the least vLLM's CPU attention takes) so the short
prompts fill whole blocks and the prefix cache shows in ``cached_tokens``.
"""

from __future__ import annotations

from typing import Any, Iterator

import openai
import pytest

from harness.images import GREEN, RED, data_url, image_bytes
from harness.proc import DynamoRun
from harness.tiny_vlm import build_tiny_vlm
from harness.vllm_tier import STARTUP_TIMEOUT, serving, vllm_cache_env, vllm_tier

pytestmark = vllm_tier()

MODEL = "tiny-vlm"
BLUE = (0, 0, 255)
# enough text after the image that a repeat's cache hit reaches well past it (blocks of 32)
QUESTION = ("Describe this image in detail, please: what colours, what shapes, and what is in the middle of it? "
            "Then say what the picture reminds you of, and why, in one short sentence.")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoRun]:
    model = build_tiny_vlm(tmp_path_factory.mktemp("vlm"), MODEL)
    env = vllm_cache_env(tmp_path_factory.mktemp("vllm-cache"))
    with serving(DynamoRun("out=vllm", str(model), "--context-length", "1024", "--kv-cache-block-size", "32",
                           env=env, startup_timeout=STARTUP_TIMEOUT), "vLLM vision server") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: DynamoRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)


def png(color: tuple[int, int, int], width: int = 40, height: int = 30, noise_seed: int | None = None) -> str:
    return data_url(image_bytes(width, height, color, noise_seed=noise_seed))


def ask(client: openai.OpenAI, *urls: str, text: str = QUESTION) -> Any:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    parts.append({"type": "text", "text": text})
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],  # type: ignore[misc,list-item]
                                          max_tokens=12, temperature=0, seed=7, logprobs=True,
                                          extra_body={"ignore_eos": True})


def answer(r: Any) -> str:
    text = r.choices[0].message.content
    assert text, r  # twelve tokens of something (a random model's words)
    return text


def logprobs(r: Any) -> list[float]:
    """The answer's token log-probabilities: finer than its tokens, which a random model's flat logits often
    keep the same for the first few tokens whatever the image."""
    return [t.logprob for t in r.choices[0].logprobs.content]


def same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_the_model_says_it_takes_images(server: DynamoRun) -> None:
    import httpx

    [entry] = httpx.get(server.api_url + "/models", timeout=30).json()["data"]
    assert entry["id"] == MODEL and entry["input_modalities"] == ["text", "image"]


def test_same_image_same_tokens_other_image_other_tokens(client: openai.OpenAI) -> None:
    red = answer(ask(client, png(RED)))
    assert answer(ask(client, png(RED))) == red
    assert answer(ask(client, png(BLUE))) != red
    assert answer(ask(client, png(GREEN, 64, 64, noise_seed=3))) != red


def test_two_images_in_order(client: openai.OpenAI) -> None:
    red, blue = png(RED, 33, 47), png(BLUE, 71, 19)
    first = logprobs(ask(client, red, blue))
    assert same(logprobs(ask(client, red, blue)), first)
    swapped = logprobs(ask(client, blue, red))
    assert not same(swapped, first), (swapped, first)
    assert not same(logprobs(ask(client, red)), first)  # one image fewer


def test_prefix_cache_is_keyed_by_the_image(client: openai.OpenAI) -> None:
    """vLLM hashes the image's identifier (our ``mm_hash``) into the blocks it touches: a repeat of the
    image reuses the blocks past it; another image with the same text reuses only the blocks before it."""
    text = QUESTION + " Answer briefly."  # a prompt no other test sent
    red, other = png(RED, 21, 13, noise_seed=11), png(RED, 21, 13, noise_seed=12)
    first = ask(client, red, text=text)
    prompt_tokens = first.usage.prompt_tokens
    again = ask(client, red, text=text)
    assert again.usage.prompt_tokens == prompt_tokens
    hit = again.usage.prompt_tokens_details.cached_tokens
    assert hit >= prompt_tokens - 32, again.usage  # all but the last (partial) block
    changed = ask(client, other, text=text)
    assert changed.usage.prompt_tokens_details.cached_tokens < hit - 32, changed.usage  # not past the image


def test_a_broken_image_is_a_400_and_it_keeps_serving(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="(?i)image"):
        ask(client, data_url(b"\x89PNG\r\n\x1a\n" + bytes(range(40))))  # a PNG signature, then garbage
    answer(ask(client, png(RED)))
