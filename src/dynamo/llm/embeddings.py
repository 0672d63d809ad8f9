"""Embedding models: inputs in, one vector per input out, locally or on ``ModelType.Embedding`` workers.

An embedding engine (``kind = "embedding"``) has ``embed(inputs, dimensions, ctx) -> Embeddings``; it
tokenizes strings itself (so a remote frontend needs no tokenizer, and llama.cpp sees its own tokens)
and refuses ``dimensions`` with a :class:`RequestError` unless it can honour it.  :class:`EmbeddingModel`
is what the model manager serves under the model's name: ``/v1/embeddings`` calls ``embed``; chat and
completions get a clear 400.  On a worker, :func:`embedding_handler` serves the engine, and
:class:`RemoteEmbeddingEngine` reaches it from a frontend (errors travel as items, so a 400 stays a 400).

On the wire (spec 8.2, ``ModelType.Embedding``) a worker gets ``{"token_ids": [[...]], "model",
"encoding_format", "dimensions", "annotations"}`` (the frontend tokenizes with the card's tokenizer, special
tokens added) and yields ``{"embeddings": [[...]], "prompt_tokens", "total_tokens"}``, so workers written
against the original's Python API work.  We also send the inputs as the client gave them (``"input"``):
our own workers embed those, so llama.cpp tokenizes exactly as it does locally, and a model whose card has
no tokenizer can still be served.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from dynamo.errors import EngineError, RequestError, UserError
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard

log = logging.getLogger(__name__)

EmbeddingInput = str | list[int]


@dataclass
class Embeddings:
    vectors: list[list[float]]
    prompt_tokens: int


class EmbeddingEngine(Protocol):
    kind: str  # "embedding"

    async def embed(self, inputs: list[EmbeddingInput], dimensions: int | None, ctx: Context) -> Embeddings: ...


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


class RemoteEmbeddingEngine:
    """Sends embedding requests to ``ModelType.Embedding`` workers, round-robin."""

    kind = "embedding"

    def __init__(self, client: Any, name: str = "", tokenizer: Any = None):
        self.client = client
        self.name = name
        self.tokenizer = tokenizer

    def request(self, inputs: list[EmbeddingInput], dimensions: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.name, "input": inputs, "encoding_format": "float",
                                "dimensions": dimensions, "annotations": []}
        if self.tokenizer is not None:
            hf = self.tokenizer.hf
            body["token_ids"] = [hf.encode(i, add_special_tokens=True).ids if isinstance(i, str) else i
                                 for i in inputs]
        return body

    async def embed(self, inputs: list[EmbeddingInput], dimensions: int | None, ctx: Context) -> Embeddings:
        from dynamo.frontend.remote import MAX_NO_RESPONDER_RETRIES, NO_WORKER_MESSAGE, _ensure_instances
        from dynamo.runtime import Context as RtContext
        from dynamo.runtime import EngineError as RtEngineError
        from dynamo.runtime import NoInstancesError, NoRespondersError, StreamIncompleteError

        body = self.request(inputs, dimensions)
        rt_ctx = RtContext(ctx.id)
        for _ in range(MAX_NO_RESPONDER_RETRIES + 1):
            await _ensure_instances(self.client)
            try:
                stream = self.client.round_robin(body, context=rt_ctx)
                await stream.start()
                break
            except NoRespondersError as e:  # nothing reached a worker: another one may take it
                log.info("embedding request %s: %s; sending it to another worker", ctx.id, e)
            except NoInstancesError:
                raise RequestError(NO_WORKER_MESSAGE, status=503) from None
        else:
            raise RequestError(NO_WORKER_MESSAGE, status=503)
        try:
            async for item in stream:
                err = item.get("error")
                if err:
                    raise RequestError(err.get("message", "embedding failed"), status=int(err.get("status", 400)),
                                       param=err.get("param"))
                if not isinstance(item, dict) or not isinstance(item.get("embeddings"), list):
                    raise EngineError("the embedding worker's answer has no 'embeddings'")
                return Embeddings(item["embeddings"], int(item.get("prompt_tokens", 0)))
        except (RtEngineError, StreamIncompleteError) as e:
            raise EngineError(str(e)) from None
        finally:
            await stream.aclose()
        raise EngineError("the embedding worker answered nothing")
