"""What the tests and the benchmarks both need, in one place: real etcd and nats-server processes
(``servers``), ``dynamo-run`` processes (``proc``), model folders built offline in milliseconds
(``tiny_model``), the real Qwen3 tokenizer (``qwen3``) and the SmolLM2 GGUF (``smollm2``), a deterministic
token engine for fault runs (``det_engine``), and waiting for a condition (``wait``).

It lives at the top of the checkout, beside ``tests/`` and ``benchmarks/``, because both import it and
neither may import the other; it is not part of the installed package.  Run from the checkout's root
(``python -m pytest``, ``python -m benchmarks.X``), which puts it on the path.
"""
