"""``POST /v1/embeddings``: the OpenAI shape, float or base64 (little-endian float32) vectors.

Inputs: a string, a list of strings, a list of token ids or a list of token-id lists.  ``dimensions``
goes to the engine, which refuses it with a 400 unless it can honour it.  A model that is not an
embedding model gets a 400 naming the right endpoint.  Behind the frontend-wide limit like chat
(admission.py): the same 503 and the same rejection count past it.
"""

from __future__ import annotations

import base64
import struct

from aiohttp import web

from dynamo.errors import RequestError
from dynamo.frontend.http.admission import Admission
from dynamo.frontend.http.body import json_response, read_json
from dynamo.frontend.model_manager import ModelManager
from dynamo.llm.embeddings import Embeds
from dynamo.llm.engine import Context
from dynamo.llm.protocols.extra import parse_embedding_request


def encode_base64(vector: list[float]) -> str:
    """What the OpenAI SDK decodes for ``encoding_format="base64"``: float32 little-endian bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class EmbeddingsRoute:
    def __init__(self, models: ModelManager, admission: Admission):
        self.models = models
        self.admission = admission

    async def handle(self, request: web.Request) -> web.Response:
        raw = await read_json(request)
        req, inputs = parse_embedding_request(raw)
        model = self.models.get(req.model)
        if not isinstance(model, Embeds):
            raise RequestError(f"The model '{req.model}' is not an embedding model", param="model")
        ctx = Context()
        with self.admission.run(request, ctx, req.model, "embeddings", False) as flight:
            result = await model.embed(inputs, req.dimensions, ctx)
            ctx.prompt_tokens = result.prompt_tokens
            flight.metrics.tokens(0, result.prompt_tokens)
            flight.ok = True
        b64 = req.encoding_format == "base64"
        data = [
            {"object": "embedding", "index": i, "embedding": encode_base64(v) if b64 else v}
            for i, v in enumerate(result.vectors)
        ]
        usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
        return json_response({"object": "list", "data": data, "model": req.model, "usage": usage})
