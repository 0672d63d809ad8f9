# An Embedding worker written against the original's Python API only (`register_llm(ModelType.Embedding,
# ...)`, `serve_endpoint`), run as `python embedding_dyn_worker.py MODEL TEMPLATE`: it gets `token_ids` from the
# frontend and answers `{"embeddings", "prompt_tokens", "total_tokens"}`, as the spec defines the type.
# Each vector is [number of tokens, first token id, last token id], so the test can see what arrived.
# TEMPLATE goes to register_llm's custom_template_path: the frontend's /tokenize renders messages with it.
import asyncio
import sys

import uvloop

from dynamo.llm import ModelType, register_llm
from dynamo.runtime import DistributedRuntime, dynamo_worker


@dynamo_worker(static=False)
async def worker(runtime: DistributedRuntime):
    component = runtime.namespace("pyemb").component("embedder")
    await component.create_service()
    endpoint = component.endpoint("generate")
    await register_llm(ModelType.Embedding, endpoint, sys.argv[1], "py-emb", custom_template_path=sys.argv[2])
    await endpoint.serve_endpoint(generate)


async def generate(request):
    vectors = [[float(len(ids)), float(ids[0]), float(ids[-1])] for ids in request["token_ids"]]
    n = sum(len(ids) for ids in request["token_ids"])
    yield {"embeddings": vectors, "prompt_tokens": n, "total_tokens": n}


if __name__ == "__main__":
    uvloop.install()
    asyncio.run(worker())
