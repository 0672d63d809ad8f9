"""A graph whose leaf cannot start: its ``__init__`` raises (tests/e2e/test_dynamo_serve.py)."""

from dynamo.sdk import api, depends, endpoint, service


@service(dynamo={"namespace": "servetest"})
class Broken:
    def __init__(self) -> None:
        raise ValueError("no model here")

    @endpoint()
    async def generate(self, req: str):
        yield req


@service(dynamo={"namespace": "servetest"})
class Top:
    broken = depends(Broken)

    @api()
    async def generate(self, text: str):
        async for item in self.broken.generate(text):
            yield item
