"""The frontend's side of ``ModelType.Embedding`` workers: send the inputs (and the card tokenizer's token
ids, as the original's wire format has them) to a worker, round-robin; a worker's 400 stays a 400.  The
worker is found as for every remote engine (remote.py's :class:`WorkerStarts`: another worker when a
request reached none or the worker was busy, a wait in the queue when every worker is full, the same
503s).  The wire format is in :mod:`dynamo.llm.embeddings`."""

from __future__ import annotations

from typing import Any

from dynamo.errors import EngineError, RequestError
from dynamo.frontend.remote import QueuePolicy, WorkerStarts
from dynamo.llm.embeddings import EmbeddingInput, Embeddings
from dynamo.llm.engine import Context
from dynamo.runtime import Context as RtContext
from dynamo.runtime import EngineError as RtEngineError
from dynamo.runtime import StreamIncompleteError


class RemoteEmbeddingEngine:
    """Sends embedding requests to ``ModelType.Embedding`` workers, round-robin."""

    kind = "embedding"

    def __init__(self, client: Any, name: str = "", tokenizer: Any = None, queue: QueuePolicy | None = None):
        self.client = client
        self.name = name
        self.tokenizer = tokenizer
        self.queue = queue or QueuePolicy()

    def request(self, inputs: list[EmbeddingInput], dimensions: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.name, "input": inputs, "encoding_format": "float",
                                "dimensions": dimensions, "annotations": []}
        if self.tokenizer is not None:
            hf = self.tokenizer.hf
            body["token_ids"] = [hf.encode(i, add_special_tokens=True).ids if isinstance(i, str) else i
                                 for i in inputs]
        return body

    async def embed(self, inputs: list[EmbeddingInput], dimensions: int | None, ctx: Context) -> Embeddings:
        body = self.request(inputs, dimensions)
        rt_ctx = RtContext(ctx.id)
        starts = WorkerStarts(self.client, self.queue, None, ctx.id)
        stream = await starts.start(lambda: self.client.round_robin(body, context=rt_ctx))
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
