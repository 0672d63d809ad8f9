"""Embedding models: inputs in, one vector per input out, locally or on ``ModelType.Embedding`` workers.

An embedding engine (``kind = "embedding"``) has ``embed(inputs, dimensions, ctx) -> Embeddings``; it
tokenizes strings itself (so a remote frontend needs no tokenizer, and llama.cpp sees its own tokens)
and refuses ``dimensions`` with a :class:`RequestError` unless it can honour it.  :class:`EmbeddingModel`
is what the model manager serves under the model's name: ``/v1/embeddings`` calls ``embed``; chat and
completions get a clear 400.  On a worker, :func:`embedding_handler` serves the engine, and
:class:`~dynamo.frontend.remote_embeddings.RemoteEmbeddingEngine` reaches it from a frontend (errors travel as items, so a 400 stays a 400).

On the wire (``ModelType.Embedding`` endpoints) a worker gets ``{"token_ids": [[...]], "model",
"encoding_format", "dimensions", "annotations"}`` (the frontend tokenizes with the card's tokenizer, special
tokens added) and yields ``{"embeddings": [[...]], "prompt_tokens", "total_tokens"}``, so workers written
against the original's Python API work.  We also send the inputs as the client gave them (``"input"``):
our own workers embed those, so llama.cpp tokenizes exactly as it does locally, and a model whose card has
no tokenizer can still be served.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol, runtime_checkable

from dynamo.errors import EngineError, RequestError, UserError
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard

log = logging.getLogger(__name__)

EmbeddingInput = str | list[int]


@dataclass
class Embeddings:
    vectors: list[list[float]]
    prompt_tokens: int


@runtime_checkable
class Embeds(Protocol):
    """Answers ``/v1/embeddings``: an embedding engine, or a served model over one (:class:`EmbeddingModel`)."""

    async def embed(self, inputs: list[EmbeddingInput], dimensions: int | None, ctx: Context) -> Embeddings: ...


class EmbeddingEngine(Embeds, Protocol):
    kind: str  # "embedding"


class EmbeddingModel:
    """A served embedding model (a ``ServedModel`` whose chat and completions refuse politely)."""

    def __init__(self, name: str, card: ModelCard, engine: EmbeddingEngine, tokenizer: Any = None):
        self.name = name
        self.card = card
        self.engine = engine
        self.tokenizer = tokenizer
        if tokenizer is None and card.has_tokenizer:  # for /tokenize; the engine tokenizes on its own
            from dynamo.llm.tokenizer import Tokenizer

            self.tokenizer = Tokenizer(card.tokenizer_json)  # type: ignore[arg-type]

    async def embed(self, inputs: list[EmbeddingInput], dimensions: int | None, ctx: Context) -> Embeddings:
        result = await self.engine.embed(inputs, dimensions, ctx)
        if len(result.vectors) != len(inputs):
            raise EngineError(f"embedding engine returned {len(result.vectors)} vectors for {len(inputs)} inputs")
        return result

    def _refuse(self, *args: Any) -> AsyncIterator[Any]:
        raise RequestError(f"The model '{self.name}' is an embedding model: use /v1/embeddings", param="model")

    chat = _refuse
    completions = _refuse


def embedding_handler(engine: EmbeddingEngine) -> Any:
    """A worker's endpoint handler: one request (``input``, else ``token_ids``) -> one item with the vectors."""

    async def generate(request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        ctx = Context(context.id() if context is not None else None)
        inputs = request.get("input")
        if inputs is None:
            inputs = request.get("token_ids") or []
        try:
            result = await engine.embed(list(inputs), request.get("dimensions"), ctx)
        except RequestError as e:
            yield {"error": {"message": e.message, "status": e.status, "param": e.param}}
            return
        except UserError as e:
            yield {"error": {"message": str(e), "status": 400, "param": None}}
            return
        yield {"embeddings": result.vectors, "prompt_tokens": result.prompt_tokens,
               "total_tokens": result.prompt_tokens}

    return generate
