"""Hello world of ``dynamo serve``: three services, each its own process, Frontend -> Middle -> Backend.

    cd examples/hello_world
    dynamo serve hello_world:Frontend -f config.yaml
    curl -X POST localhost:3000/generate -H 'Content-Type: application/json' -d '{"text": "test"}'
    # Frontend: Middle: Backend: test-mid-back

Backend and Middle are served on the runtime (``dyn://inference.Backend.generate``,
``dyn://inference.Middle.generate``); Frontend is an HTTP route.  Each appends its config's ``message``
and prefixes what comes back, so the answer shows the request going down and the stream coming up.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel

from dynamo.sdk import api, async_on_start, depends, dynamo_context, endpoint, service
from dynamo.sdk.lib.config import ServiceConfig

log = logging.getLogger(__name__)


class RequestType(BaseModel):
    text: str


@service(dynamo={"namespace": "inference"}, resources={"cpu": 1}, workers=1)
class Backend:
    def __init__(self) -> None:
        self.message = (ServiceConfig.get_instance().get("Backend") or {}).get("message", "back")

    @async_on_start
    async def started(self) -> None:
        log.info("Backend replica %s serving with message %r", dynamo_context["replica"], self.message)

    @endpoint()
    async def generate(self, req: RequestType):
        text = f"{req.text}-{self.message}"
        for token in text.split():
            yield f"Backend: {token}"


@service(dynamo={"namespace": "inference"})
class Middle:
    backend = depends(Backend)

    def __init__(self) -> None:
        self.message = (ServiceConfig.get_instance().get("Middle") or {}).get("message", "mid")

    @endpoint()
    async def generate(self, req: RequestType):
        request = RequestType(text=f"{req.text}-{self.message}")
        async for response in self.backend.generate(request.model_dump_json()):
            yield f"Middle: {response}"


@service(dynamo={"namespace": "inference"})
class Frontend:
    middle = depends(Middle)

    @api()
    async def generate(self, text: str):
        async for response in self.middle.generate(RequestType(text=text)):
            yield f"Frontend: {response}"
