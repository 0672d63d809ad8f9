"""The OpenAI frontend: HTTP service (one module per route), model discovery, routing to
workers (round-robin, random, KV-aware) and disaggregated prefill.  Model logic (cards,
templates, tokenizers, pre/post-processing, parsers, KV events) lives in :mod:`dynamo.llm`;
this package depends on it, never the other way round."""
