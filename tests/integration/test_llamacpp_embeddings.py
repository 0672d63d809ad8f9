"""``out=llamacpp --embedding`` for real: SmolLM2's vectors over HTTP against llama-cpp-python's own
``Llama.embed`` on the same GGUF, with the same pooling (mean: SmolLM2 declares none) and normalisation.

Our engine drives llama.cpp through its low-level API (its own tokenization, batch and pooled read-out);
``Llama.embed`` is the library's independent path to the same numbers.  Skipped without llama-cpp-python
or the SmolLM2 GGUF.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import pytest

openai = pytest.importorskip("openai")

from harness.proc import DynamoRun  # noqa: E402

TEXTS = ["What is the capital of France?", "Paris is the capital of France.", "héllo wörld 🙂"]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(gguf: Path) -> Iterator[DynamoRun]:
    with DynamoRun("out=llamacpp", str(gguf), "--embedding", "--model-name", "smol-embed",
                   "--extra-engine-args", str(_args_file(gguf)), startup_timeout=120) as srv:
        yield srv


def _args_file(gguf: Path) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "embed-args.json"
    path.write_text('{"n_threads": 1}')
    return path


@pytest.fixture(scope="module")
def reference(gguf_in_process: Path) -> list[list[float]]:
    import llama_cpp

    # flash attention: llama.cpp's default ("auto", on for the CPU) which our engine keeps, as llama-server
    # does; llama-cpp-python turns it off by default (then the vectors differ by ~1e-3, cosine > 0.9999)
    llm = llama_cpp.Llama(str(gguf_in_process), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                          n_ctx=512, n_threads=1, flash_attn=True, verbose=False)
    try:
        return [llm.embed(t, normalize=True) for t in TEXTS]
    finally:
        llm.close()


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_vectors_match_llama_embed(server: DynamoRun, reference: list[list[float]]):
    client = openai.OpenAI(base_url=server.api_url, api_key="none", timeout=120, max_retries=0)
    r = client.embeddings.create(model="smol-embed", input=TEXTS, encoding_format="float")
    ours = [d.embedding for d in r.data]
    assert [len(v) for v in ours] == [len(v) for v in reference] == [576] * 3
    for a, b in zip(ours, reference, strict=True):
        assert abs(math.sqrt(sum(x * x for x in a)) - 1) < 1e-5  # L2-normalised, as llama-server does
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
    # related sentences are closer than unrelated ones: the vectors carry meaning, not noise
    assert cosine(ours[0], ours[1]) > cosine(ours[0], ours[2])
    assert r.usage.prompt_tokens > len(TEXTS)
    # base64 (the SDK's default) decodes to the same vectors
    b64 = client.embeddings.create(model="smol-embed", input=TEXTS[0]).data[0].embedding
    assert max(abs(x - y) for x, y in zip(b64, ours[0], strict=True)) < 1e-6


def test_llamacpp_refuses_dimensions_and_chat(server: DynamoRun):
    client = openai.OpenAI(base_url=server.api_url, api_key="none", timeout=120, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="smol-embed", input="x", dimensions=64)
    assert info.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smol-embed", messages=[{"role": "user", "content": "hi"}])
