"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: LoRA adapters loaded and unloaded
while serving, with vLLM's bodies (``{"lora_name": ..., "lora_path": ...}``) and answers (a plain-text
``Success: ...`` line; errors in the OpenAI error shape, 400 for a bad adapter or a name taken, 404 for
an unknown one).

Off unless the operator sets ``DYN_ALLOW_RUNTIME_LORA_UPDATING=true`` (or vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): loading reads any file the server can read, so it is an
operator's decision, and the routes are behind the API key like every route but the operational ones
(auth.py).  Without it the routes are absent (404), as in vLLM.

A local engine (``out=llamacpp``, ``out=vllm``): the adapter is loaded into the engine of the served base model that
takes adapters (``ServesLoraAdapters``) and served as a model of its own (llm/lora.py).  A frontend of
workers (``out=dyn``): the load or unload is sent on to the workers of the base model
(frontend/lora_fleet.py: all or nothing), each of which must allow it too; with several base models
the body names one as ``base_model_name`` (ours).
"""

from __future__ import annotations

from aiohttp import web

from dynamo.errors import RequestError, UserError
from dynamo.frontend.http.body import read_json
from dynamo.frontend.model_manager import ModelManager
from dynamo.llm.engine import ServesLoraAdapters
from dynamo.llm.lora import adapter_model, check_adapter_name
from dynamo.llm.pipeline import ServedModel


class LoraRoutes:
    def __init__(self, models: ModelManager):
        self.models = models

    def install(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/load_lora_adapter", self.load)
        router.add_post("/v1/unload_lora_adapter", self.unload)

    async def load(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        base_name = body.get("base_model_name") if isinstance(body, dict) else None
        if base_name is not None and (not isinstance(base_name, str) or not base_name):
            raise RequestError("'base_model_name' must be a non-empty string", param="base_model_name")
        if self.models.loras is not None:  # out=dyn: the workers load it
            return web.Response(text=await self.models.loras.load(name, path, base_name))
        base = self._base()
        if base_name is not None and base_name != base.name:
            self.models.get(base_name)  # a 404 if it does not exist
            raise RequestError(f"'{base_name}' does not take LoRA adapters here", param="base_model_name")
        if name in self.models.names():
            raise RequestError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        try:
            check_adapter_name(name, base.name)
            await _engine(base).load_lora(name, path)
        except UserError as e:
            raise RequestError(str(e), param="lora_path") from None
        self.models.add(adapter_model(base, name, path))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        name = _field(await read_json(request), "lora_name")
        if self.models.loras is not None:  # out=dyn: the workers unload it
            return web.Response(text=await self.models.loras.unload(name))
        base = self._base()
        engine = _engine(base)
        if name not in engine.lora_adapters():
            raise RequestError(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name",
                               code="model_not_found")
        self.models.remove(name)  # new requests for it are 404s; those running finish with it
        await engine.unload_lora(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def _base(self) -> ServedModel:
        bases = [m for m in (self.models.get(n) for n in self.models.names())
                 if isinstance(m.engine, ServesLoraAdapters) and m.card.lora is None]
        if not bases:
            raise RequestError("no served model takes LoRA adapters at run time here (out=llamacpp and out=vllm do)")
        if len(bases) > 1:
            raise RequestError("several base models serve LoRA adapters; load adapters at start with --lora")
        return bases[0]


def _engine(model: ServedModel) -> ServesLoraAdapters:
    engine = model.engine
    assert isinstance(engine, ServesLoraAdapters)
    return engine


def _field(body: object, key: str) -> str:
    value = body.get(key) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise RequestError(f"'{key}' is required: a non-empty string", param=key)
    return value
