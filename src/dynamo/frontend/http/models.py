"""``GET /v1/models``: every served model (chat, completion and embedding models), in the OpenAI shape;
LoRA adapters also carry vLLM's ``root`` (the adapter's file) and ``parent`` (the base model's id), and every
model its ``input_modalities`` (OpenRouter's name): ``["text", "image"]`` for a model whose engine takes
images (its card's ``image_tokens``, or ``image_urls`` for an engine given the request as sent), else
``["text"]``."""

from __future__ import annotations

from aiohttp import web

from dynamo.frontend.http.body import json_response
from dynamo.frontend.model_manager import ModelManager


class ModelsRoute:
    def __init__(self, models: ModelManager):
        self.models = models

    async def list_models(self, request: web.Request) -> web.Response:
        data = []
        for name in self.models.names():
            entry = {"id": name, "object": "model", "created": self.models.created(name), "owned_by": "dynamo"}
            card = self.models.get(name).card
            entry["input_modalities"] = ["text", "image"] if card.takes_images else ["text"]
            lora = card.lora
            if lora:  # a LoRA adapter, listed as vLLM lists one: its file and its base model
                entry.update(root=lora.get("path"), parent=lora.get("base_model"))
            data.append(entry)
        return json_response({"object": "list", "data": data})
