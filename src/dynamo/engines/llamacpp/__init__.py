"""``out=llamacpp``: llama.cpp through llama-cpp-python, one module per job (arrows point down):

* engine.py: :class:`~.engine.LlamaCppEngine`, the asyncio face (start, close, generate, attach, load
  metrics, runtime config);
* scheduler.py: continuous batching on one thread that owns every llama.cpp call;
* slots.py: the sequence slots and their KV caches (prefix reuse, copies, offload and restore), with the
  host-memory and disk tiers of host_tier.py and disk_tier.py;
* sampling.py: sampler chains, guided decoding (grammar.py's GBNF), logprobs;
* threads.py: the thread count, tuned while serving;
* model.py: loading and freeing the model and its context, llama.cpp's log;
* embed.py: ``--embedding``, a separate engine with its own model and context.
"""
