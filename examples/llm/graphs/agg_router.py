"""Aggregated serving with KV-aware routing: the same services as ``agg``; ``configs/agg_router.yaml`` runs
two workers and sets the frontend's ``router-mode: kv`` (the frontend picks the worker whose cache holds
most of the prompt, from the workers' KV events).

    cd examples/llm
    dynamo serve graphs.agg_router:Frontend -f configs/agg_router.yaml
"""

from graphs.components import Frontend, Worker

__all__ = ["Frontend", "Worker"]
