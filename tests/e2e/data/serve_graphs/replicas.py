"""A two-service graph for tests/e2e/test_dynamo_serve.py: Front (HTTP) -> Leaf (runtime endpoints).

Leaf answers with its process id, so a test sees which replica served; ``settings`` streams the Leaf
section of the config its own process received; ``slow`` streams with pauses, for a stop while in flight.
"""

from __future__ import annotations

import asyncio
import os

from pydantic import BaseModel

from dynamo.sdk import api, depends, dynamo_context, endpoint, service
from dynamo.sdk.lib.config import ServiceConfig


class Ask(BaseModel):
    text: str


@service(dynamo={"namespace": "servetest"})
class Leaf:
    def __init__(self) -> None:
        self.section = ServiceConfig.get_instance().get("Leaf") or {}
        self.message = self.section.get("message", "leaf-default")

    @endpoint()
    async def generate(self, req: Ask):
        yield {"pid": os.getpid(), "replica": dynamo_context["replica"], "text": f"{req.text}-{self.message}"}

    @endpoint()
    async def settings(self, req: dict):
        yield {"section": self.section, "common": ServiceConfig.get_instance().get("Common")}

    @endpoint()
    async def slow(self, req: Ask):
        for i in range(6):
            yield f"{req.text}{i};"
            await asyncio.sleep(0.3)


@service(dynamo={"namespace": "servetest"})
class Front:
    leaf = depends(Leaf)

    @api()
    async def generate(self, text: str) -> dict:
        async for item in self.leaf.generate(Ask(text=text)):
            return item
        raise RuntimeError("no answer")

    @api()
    async def settings(self) -> dict:
        async for item in self.leaf.settings({}):
            return item
        raise RuntimeError("no answer")

    @api()
    async def slow(self, text: str):
        async for item in self.leaf.slow(Ask(text=text)):
            yield item
