"""A worker's LoRA adapters: announced in discovery, and loaded or unloaded at run time on request.

Each adapter the engine serves (``ServesLoraAdapters``: llama.cpp, vLLM) is announced as a model entry of its
own under the worker's lease (llm/lora.py's card: the base card under the adapter's name, with its
parent), so frontends list it and route its requests only to the workers that announce it.

Beside ``generate`` the worker serves Dynamo's three control endpoints on its component:

* ``load_lora``: ``{"lora_name": str, "lora_path": str}`` (vLLM's body) or ``{"lora_name": str,
  "source": {"uri": "file:///..."}}`` (Dynamo's); only local files (a path or a ``file://`` URI).
* ``unload_lora``: ``{"lora_name": str}``.
* ``list_loras``: ``{}``.

Each answers one item, Dynamo's shape: ``{"status": "success" | "error", "message": str, "lora_name": str}``
(``list_loras``: ``{"status": "success", "loras": {name: path}, "count": n}``).  A frontend of workers
sends ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` here (frontend/lora_fleet.py).

Loading and unloading are off unless the worker's operator sets ``DYN_ALLOW_RUNTIME_LORA_UPDATING=true``
(vLLM's variable, also read): loading reads any file the worker can read.  Without it the endpoints
still answer (an error saying so), so a frontend can tell the user which worker refused; the entry's
``runtime_config`` says ``runtime_lora_updating`` so frontends know before asking.

Order: a loaded adapter is announced only once the engine has it (no request can reach a worker that
cannot serve it); an unloaded one is withdrawn first, then unloaded (requests already running finish
with it, llamacpp/lora.py).  A failed announcement unloads the adapter again: the worker never serves an
adapter nobody can see.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator
from urllib.parse import unquote, urlparse

from dynamo.errors import UserError
from dynamo.llm.engine import ServesLoraAdapters
from dynamo.llm.lora import (
    LIST_LORAS_ENDPOINT,
    LOAD_LORA_ENDPOINT,
    UNLOAD_LORA_ENDPOINT,
    adapter_card,
    check_adapter_name,
    runtime_lora_allowed,
)
from dynamo.llm.model_card import ModelCard
from dynamo.llm.model_type import ModelType
from dynamo.llm.register import publish_model
from dynamo.runtime import Endpoint

log = logging.getLogger(__name__)


def adapter_path(request: Any) -> str:
    """The adapter file a load request names (vLLM's ``lora_path`` or Dynamo's ``source.uri``)."""
    path = request.get("lora_path")
    source = request.get("source")
    if path is None and isinstance(source, dict):
        uri = source.get("uri")
        if not isinstance(uri, str) or not uri:
            raise UserError("'source.uri' must be a non-empty string")
        parsed = urlparse(uri)
        if parsed.scheme == "file":
            path = unquote(parsed.path)
        elif parsed.scheme == "":
            path = uri
        else:
            raise UserError(f"LoRA source {uri!r}: only local files can be loaded here (a path or file:// URI)")
    if not isinstance(path, str) or not path:
        raise UserError("'lora_path' (or 'source.uri') is required: a non-empty string")
    return path


def _name(request: Any) -> str:
    name = request.get("lora_name") if isinstance(request, dict) else None
    if not isinstance(name, str) or not name:
        raise UserError("'lora_name' is required: a non-empty string")
    return name


class LoraControl:
    """The adapters one worker announces, and its ``load_lora`` / ``unload_lora`` / ``list_loras``."""

    def __init__(self, endpoint: Endpoint, engine: ServesLoraAdapters, card: ModelCard, model_type: ModelType,
                 runtime_config: dict[str, Any]):
        self.endpoint = endpoint
        self.engine = engine
        self.card = card
        self.model_type = model_type
        self.runtime_config = runtime_config
        self.allowed = runtime_lora_allowed()
        self._keys: dict[str, str] = {}  # adapter name -> its model entry's key
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._tasks: list[asyncio.Task[None]] = []

    async def announce_all(self) -> None:
        """Announce the adapters loaded at start (``--lora``)."""
        for name, path in self.engine.lora_adapters().items():
            await self._announce(name, path)

    async def _announce(self, name: str, path: str) -> None:
        entry = await publish_model(self.endpoint, adapter_card(self.card, name, path), self.model_type,
                                    runtime_config=self.runtime_config)
        self._keys[name] = entry.key()

    def serve(self) -> None:
        component = self.endpoint.component
        for ep_name, handler in ((LOAD_LORA_ENDPOINT, self.load), (UNLOAD_LORA_ENDPOINT, self.unload),
                                 (LIST_LORAS_ENDPOINT, self.list)):
            self._tasks.append(asyncio.create_task(component.endpoint(ep_name).serve_endpoint(handler),
                                                   name=f"lora-{ep_name}"))

    async def load(self, request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        name = request.get("lora_name") if isinstance(request, dict) else None
        try:
            name = _name(request)
            self._check_allowed()
            path = adapter_path(request)
            check_adapter_name(name, self.card.display_name)
            async with self._lock:
                if name in self.engine.lora_adapters():
                    raise UserError(f"The lora adapter '{name}' has already been loaded.")
                await self.engine.load_lora(name, path)
                try:
                    await self._announce(name, path)
                except Exception:
                    await self.engine.unload_lora(name)  # never serve what no frontend can see
                    raise
        except UserError as e:
            yield _error(str(e), name)
            return
        except Exception as e:  # noqa: BLE001 - etcd or the engine failed: say so, keep serving
            log.warning("loading LoRA adapter %s failed: %s", name, e)
            yield _error(f"loading failed on this worker: {e}", name)
            return
        log.info("LoRA adapter %s loaded from %s and announced", name, path)
        yield {"status": "success", "message": f"LoRA adapter '{name}' loaded successfully", "lora_name": name}

    async def unload(self, request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        name = request.get("lora_name") if isinstance(request, dict) else None
        try:
            name = _name(request)
            self._check_allowed()
            async with self._lock:
                if name not in self.engine.lora_adapters():
                    raise UserError(f"The lora adapter '{name}' cannot be found.")
                key = self._keys.get(name)
                if key is not None:  # withdrawn first: frontends stop sending it here
                    await self.endpoint.runtime.discovery().delete(key)
                    del self._keys[name]
                await self.engine.unload_lora(name)
        except UserError as e:
            yield _error(str(e), name)
            return
        except Exception as e:  # noqa: BLE001
            log.warning("unloading LoRA adapter %s failed: %s", name, e)
            yield _error(f"unloading failed on this worker: {e}", name)
            return
        log.info("LoRA adapter %s withdrawn and unloaded", name)
        yield {"status": "success", "message": f"LoRA adapter '{name}' unloaded successfully", "lora_name": name}

    async def list(self, request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        loras = self.engine.lora_adapters()
        yield {"status": "success", "loras": loras, "count": len(loras)}

    def _check_allowed(self) -> None:
        if not self.allowed:
            raise UserError("run-time LoRA loading is off on this worker (its operator can set "
                            "DYN_ALLOW_RUNTIME_LORA_UPDATING=true)")


def _error(message: str, name: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"status": "error", "message": message}
    if isinstance(name, str):
        out["lora_name"] = name
    return out
