"""The Processor's engine (a ``pystr`` engine file, docs/python-engines.md): OpenAI chat requests in, chunks out.

The Processor service runs ``dynamo-run in=dyn://<namespace>.Processor.chat out=pystr:<this file> <model>``,
which registers the model as a chat model: the frontend (``--namespace`` of the Processor) forwards each
chat request here unchanged.  This file does what the frontend would otherwise do itself, with the
frontend's own pieces: it follows the workers' model registrations in their namespace (``Processor:
workers-namespace``), and each request is templated, tokenized, routed (``Processor: router-mode``:
round-robin, random or kv) to a worker, and its tokens detokenized into chat chunks.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from dynamo.frontend.discovery import ModelWatcher
from dynamo.frontend.model_manager import ModelManager
from dynamo.frontend.remote import RouterConfig
from dynamo.llm.engine import Context
from dynamo.llm.protocols.openai import parse_chat_request
from dynamo.runtime.distributed import connect_runtime
from dynamo.sdk.lib.config import ServiceConfig

WAIT_FOR_WORKERS_S = 60.0
manager = ModelManager()
held: list[Any] = []  # the runtime and the watcher, alive as long as the engine


async def initialize() -> None:
    section = ServiceConfig.get_instance().get("Processor") or {}
    runtime = await connect_runtime()
    watcher = ModelWatcher(runtime, manager, RouterConfig(mode=str(section.get("router-mode", "round-robin"))),
                           namespace=str(section.get("workers-namespace", "workers")))
    await watcher.start()
    held.extend([runtime, watcher])


async def generate(request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    # with the usage chunk, the frontend counts the real prompt and completion tokens (not chunks)
    request = {**request, "stream": True, "stream_options": {**(request.get("stream_options") or {}), "include_usage": True}}
    req = parse_chat_request(request)
    # the first requests after start-up may come before the workers registered: wait for them a while
    await manager.wait_until(lambda: req.model in manager.names(), WAIT_FOR_WORKERS_S)
    model = manager.get(req.model)  # not there after the wait: the model's 404
    async for item in model.chat(req, request, Context()):
        if isinstance(item, dict):  # chunks; annotations are the frontend's own bookkeeping
            yield item
