"""``dynamo-run in=http out=vllm --embedding`` for real: vLLM's CPU build pooling the tiny random-weight
Llama (converted into an embedding model by vLLM's pooling runner), through the ``openai`` SDK.

The vectors are checked against the same model run by ``transformers`` in this process: the last hidden
state (after the final norm), mean-pooled over the tokens and L2-normalised, which is what the served model
is configured to do (``pooler_config`` in ``--extra-engine-args``).  The vLLM tier (``scripts/test-vllm.sh``).
"""

from __future__ import annotations

import base64
import json
import math
import struct
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from harness.proc import DynamoRun
from harness.tiny_model import build_tiny_hf_model
from harness.vllm_tier import STARTUP_TIMEOUT, serving, vllm_cache_env, vllm_tier

pytestmark = vllm_tier()

MODEL = "tiny-embed"
EXTRA_ARGS = {"dtype": "float32", "pooler_config": {"pooling_type": "MEAN"}}
TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello", "def add(a, b): return a + b"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_model(tmp_path_factory.mktemp("vllm-embed-models"))


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoRun]:
    cache = tmp_path_factory.mktemp("vllm-cache")
    extra = cache / "vllm_extra.json"
    extra.write_text(json.dumps(EXTRA_ARGS))
    with serving(DynamoRun("out=vllm", str(model), "--embedding", "--model-name", MODEL, "--context-length", "256",
                           "--extra-engine-args", str(extra), env=vllm_cache_env(cache),
                           startup_timeout=STARTUP_TIMEOUT), "vLLM embedding server") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: DynamoRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)


def reference(model: Path, texts: list[str]) -> tuple[list[list[float]], int]:
    """Mean-pooled, normalised last hidden states from transformers, and the token count."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModel

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    net = AutoModel.from_pretrained(str(model), dtype=torch.float32).eval()
    vectors, total = [], 0
    with torch.no_grad():
        for text in texts:
            ids = tok.encode(text, add_special_tokens=True).ids
            total += len(ids)
            hidden = net(input_ids=torch.tensor([ids])).last_hidden_state[0]
            vectors.append(torch.nn.functional.normalize(hidden.mean(dim=0), dim=0).tolist())
    return vectors, total


def test_vectors_are_the_models_mean_pooled_hidden_states(client: openai.OpenAI, model: Path) -> None:
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    want, tokens = reference(model, TEXTS)
    assert [d.index for d in r.data] == [0, 1, 2]
    assert r.usage.prompt_tokens == r.usage.total_tokens == tokens
    for got, ref in zip(r.data, want, strict=True):
        assert len(got.embedding) == len(ref) == 64
        assert math.isclose(sum(v * v for v in got.embedding), 1.0, rel_tol=1e-4)
        assert max(abs(a - b) for a, b in zip(got.embedding, ref, strict=True)) < 1e-4


def test_base64_is_the_same_vectors(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float").data
    with httpx.Client(timeout=120) as c:
        body = c.post(str(client.base_url) + "embeddings",
                      json={"model": MODEL, "input": TEXTS[:2], "encoding_format": "base64"}).json()
    for f, b in zip(floats, body["data"], strict=True):
        raw = base64.b64decode(b["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(f.embedding, abs=1e-6)
    # and the SDK's default (base64, decoded by the SDK)
    sdk = client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding
    assert sdk == pytest.approx(floats[0].embedding, abs=1e-6)


def test_token_ids_and_errors(client: openai.OpenAI, model: Path) -> None:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(TEXTS[1], add_special_tokens=True).ids
    by_ids = client.embeddings.create(model=MODEL, input=[ids], encoding_format="float").data[0].embedding
    by_text = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float").data[0].embedding
    assert by_ids == pytest.approx(by_text, abs=1e-6)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="x", dimensions=16)
    assert e.value.body["param"] == "dimensions"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="word " * 400)
    assert "context" in e.value.message
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert [m.id for m in client.models.list().data] == [MODEL]
