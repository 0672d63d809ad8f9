"""``GET /v1/models``: every served model (chat, completion and embedding models), in the OpenAI shape."""

from __future__ import annotations

from aiohttp import web

from dynamo.frontend.http.body import json_response
from dynamo.frontend.model_manager import ModelManager


class ModelsRoute:
    def __init__(self, models: ModelManager):
        self.models = models

    async def list_models(self, request: web.Request) -> web.Response:
        data = [
            {"id": name, "object": "model", "created": self.models.created(name), "owned_by": "dynamo"}
            for name in self.models.names()
        ]
        return json_response({"object": "list", "data": data})
