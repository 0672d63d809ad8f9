"""The set of models an input can serve, by name; discovery adds and removes models while serving."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Protocol

from dynamo.errors import RequestError
from dynamo.llm.pipeline import ServedModel


class LoadsLoraAdapters(Protocol):
    """Loads and unloads LoRA adapters on the workers of a frontend (frontend/lora_fleet.py); each
    returns the success message or raises RequestError saying what happened on which worker."""

    async def load(self, name: str, path: str, base: str | None) -> str: ...

    async def unload(self, name: str) -> str: ...


class ModelManager:
    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}
        self._created: dict[str, int] = {}
        self._changed: asyncio.Event | None = None  # created by the first waiter (needs a running loop)
        # a distributed frontend reports its workers here for /health
        self.instances: Callable[[], list[dict[str, Any]]] | None = None
        # a distributed frontend loads LoRA adapters on its workers through this
        self.loras: LoadsLoraAdapters | None = None

    def add(self, model: ServedModel) -> None:
        self._models[model.name] = model
        self._created.setdefault(model.name, int(time.time()))
        self._notify()

    def remove(self, name: str) -> ServedModel | None:
        self._created.pop(name, None)
        model = self._models.pop(name, None)
        self._notify()
        return model

    def get(self, name: str) -> ServedModel:
        model = self._models.get(name)
        if model is None:
            raise RequestError(
                f"The model '{name}' does not exist.", status=404, param="model", code="model_not_found"
            )
        return model

    def names(self) -> list[str]:
        return list(self._models)

    def created(self, name: str) -> int:
        return self._created.get(name, 0)

    def __len__(self) -> int:
        return len(self._models)

    async def wait_for_any(self) -> ServedModel:
        """The first model to appear (text and batch modes in front of remote workers)."""
        while not self._models:
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.clear()
            await self._changed.wait()
        return next(iter(self._models.values()))

    async def wait_until(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``condition()`` holds, checked whenever the models change (or :meth:`notify`);
        False if ``timeout`` seconds pass first."""
        try:
            async with asyncio.timeout(timeout):
                while not condition():
                    if self._changed is None:
                        self._changed = asyncio.Event()
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            return condition()
        return True

    def notify(self) -> None:
        """Something waiters may look at changed (discovery: a worker's entry came or went)."""
        self._notify()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

