"""LLM serving graphs for ``dynamo serve`` (run from examples/llm: ``dynamo serve graphs.agg:Frontend -f configs/agg.yaml``)."""
