# The seeds' "Writing your own engine in Python" example worker, run as `python seed_dyn_worker.py MODEL`.
#
# Kept as the docs write it, with three changes only: the indentation is fixed (and the imports the
# example uses are added), model_path comes from the command line (a tiny local model folder in the
# tests instead of "Qwen/Qwen3-0.6B"), and the request handler is real: a Backend engine that echoes the
# prompt's token ids back, one per response, then finishes.
import asyncio
import sys

import uvloop

from dynamo.llm import ModelType, register_llm
from dynamo.runtime import DistributedRuntime, dynamo_worker


# 1. Decorate a function to get the runtime
#
@dynamo_worker(static=False)
async def worker(runtime: DistributedRuntime):

    # 2. Register ourselves on the network
    #
    component = runtime.namespace("namespace").component("component")
    await component.create_service()
    model_path = sys.argv[1]  # "Qwen/Qwen3-0.6B" or "/data/models/Qwen3-0.6B"
    model_type = ModelType.Backend
    endpoint = component.endpoint("endpoint")
    # Optional last param to register_llm is model_name. If not present derives it from model_path
    await register_llm(model_type, endpoint, model_path)

    # Initialize your engine here
    engine = EchoTokens()

    # 3. Attach request handler
    #
    await endpoint.serve_endpoint(RequestHandler(engine).generate)


class EchoTokens:
    """Stands in for a real engine: the 'generated' tokens are the prompt's tokens."""

    async def generate(self, token_ids):
        for token_id in token_ids:
            await asyncio.sleep(0)
            yield token_id


class RequestHandler:

    def __init__(self, engine):
        self.engine = engine

    async def generate(self, request):
        # Call the engine
        # yield result dict
        async for token_id in self.engine.generate(request["token_ids"]):
            yield {"token_ids": [token_id]}
        yield {"token_ids": [], "finish_reason": "stop"}


if __name__ == "__main__":
    uvloop.install()
    asyncio.run(worker())
