"""Disaggregated serving: the OpenAI frontend -> a decode worker -> a prefill worker (docs/disaggregation.md).

    cd examples/llm
    dynamo serve graphs.disagg:Frontend -f configs/disagg.yaml           # round-robin
    dynamo serve graphs.disagg:Frontend -f configs/disagg_router.yaml    # KV-aware routing
    dynamo serve graphs.disagg:Frontend -f configs/disagg_mocker.yaml    # simulated engines

The frontend sends a prompt longer than its ``max-local-prefill-length`` (after what the decode worker has
cached) to the prefill worker first; the decode worker pulls the prompt's KV state and continues.
"""

from graphs.components import Frontend, PrefillWorker, Worker

Worker.link(PrefillWorker)

__all__ = ["Frontend", "PrefillWorker", "Worker"]
