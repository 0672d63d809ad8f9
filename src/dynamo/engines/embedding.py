"""Embedding engines for ``--embedding``: a deterministic echo-style one for tests, and the factory.

``echo_core --embedding`` needs no weights: it tokenizes with the model's tokenizer and turns the token
ids into a fixed vector (a hashed bag of tokens with their positions, L2-normalised), so the same input
always gives the same vector, different inputs give different ones, and the usage counts are real
tokens.  It honours ``dimensions`` (a prefix of the vector, normalised again, as Matryoshka models do);
``out=llamacpp --embedding`` refuses it.  ``out=vllm --embedding`` is vLLM's pooling runner (vllm_embed.py).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from dynamo.errors import RequestError, UserError
from dynamo.llm.embeddings import EmbeddingInput, Embeddings
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard

ECHO_DIMENSIONS = 32
EMBEDDING_ENGINES = ("echo_core", "llamacpp", "vllm")


class EchoEmbeddingEngine:
    kind = "embedding"

    def __init__(self, card: ModelCard, dimensions: int = ECHO_DIMENSIONS):
        from dynamo.llm.tokenizer import Tokenizer

        self.tokenizer = Tokenizer(card.tokenizer_json)  # type: ignore[arg-type]
        self.dimensions = dimensions

    async def embed(self, inputs: list[EmbeddingInput], dimensions: int | None, ctx: Context) -> Embeddings:
        if dimensions is not None and dimensions > self.dimensions:
            raise RequestError(f"dimensions must be at most {self.dimensions} for this model", param="dimensions")
        size = dimensions or self.dimensions
        vectors, total = [], 0
        for item in inputs:
            ids = self.tokenizer.encode(item) if isinstance(item, str) else item
            total += len(ids)
            vectors.append(echo_vector(ids, self.dimensions)[:size])
            await asyncio.sleep(0)
        return Embeddings([_normalised(v) for v in vectors], total)


def echo_vector(ids: list[int], dimensions: int) -> list[float]:
    """The echo engine's vector for ``ids`` (unnormalised): each token adds a pseudo-random +-1 pattern."""
    vec = [0.0] * dimensions
    for pos, tok in enumerate(ids):
        h = (tok * 2654435761 + pos * 40503 + 1) & 0xFFFFFFFF
        for j in range(dimensions):
            h = (h * 1103515245 + 12345) & 0x7FFFFFFF
            vec[j] += 1.0 if h & 0x10000 else -1.0
    return vec


def _normalised(vec: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in vec))
    return [v / norm for v in vec] if norm > 0 else vec


def create_embedding_engine(name: str, cfg: Any, card: ModelCard) -> Any:
    """The ``--embedding`` engine for ``out=<name>``; other engines are a clear error."""
    if name == "echo_core":
        if not card.has_tokenizer:
            raise UserError("out=echo_core --embedding needs a model folder or GGUF file for its tokenizer")
        return EchoEmbeddingEngine(card)
    if name == "llamacpp":
        from dynamo.engines.registry import extra_engine_args, require_package

        require_package("llamacpp")
        if card.gguf_path is None:
            raise UserError("out=llamacpp needs a GGUF file")
        from dynamo.engines.llamacpp_embed import DEFAULT_EMBED_CTX, LlamaCppEmbeddingEngine

        ctx_len = getattr(cfg, "context_length", None) or min(card.context_length or DEFAULT_EMBED_CTX,
                                                              DEFAULT_EMBED_CTX)
        card.context_length = ctx_len
        return LlamaCppEmbeddingEngine(card.gguf_path, context_length=ctx_len, args=extra_engine_args(cfg),
                                       verbose=getattr(cfg, "verbosity", 0) >= 2)
    if name == "vllm":
        from dynamo.engines.registry import _json_engine_args, require_package

        require_package("vllm")
        if card.path is None and card.gguf_path is None:
            raise UserError("out=vllm --embedding needs a model: a Hugging Face folder or repo id")
        if not card.has_tokenizer:
            raise UserError("out=vllm --embedding needs the model's tokenizer (tokenizer.json)")
        from dynamo.engines.vllm_embed import create

        return create(cfg, card, _json_engine_args(cfg), getattr(cfg, "extra_engine_args", None))
    raise UserError(f"--embedding is supported by out={', out='.join(EMBEDDING_ENGINES)}, not out={name}")
