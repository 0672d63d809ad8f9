"""A graph with a cycle in its edges, A -> B -> C -> A: refused before anything starts."""

from dynamo.sdk import depends, endpoint, service


@service(dynamo={"namespace": "servetest"})
class C:
    @endpoint()
    async def generate(self, req: str):
        yield req


@service(dynamo={"namespace": "servetest"})
class B:
    c = depends(C)

    @endpoint()
    async def generate(self, req: str):
        yield req


@service(dynamo={"namespace": "servetest"})
class A:
    b = depends(B)

    @endpoint()
    async def generate(self, req: str):
        yield req


C.link(A)
