"""Aggregated serving: the OpenAI frontend (round-robin over the workers) -> llama.cpp workers.

    cd examples/llm
    dynamo serve graphs.agg:Frontend -f configs/agg.yaml
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Hello"}]}'

``--Worker.engine=mocker`` simulates the engine (no llama.cpp needed), ``--Worker.ServiceArgs.workers=2``
runs two workers, ``--Frontend.router-mode=kv`` routes by KV overlap.
"""

from graphs.components import Frontend, Worker

__all__ = ["Frontend", "Worker"]
