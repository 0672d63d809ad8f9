"""LLM serving: model cards, pre/post-processing, the HTTP service, discovery.

The names the original's Python API exports (``ModelType``, ``register_llm``, and the KV index's
``RadixTree``, ``OverlapScores``, ``compute_block_hash_for_seq``) load lazily, so importing a
submodule such as ``dynamo.llm.engine`` does not pull in the distributed runtime or the KV router.
"""

from typing import Any

__all__ = ["ModelType", "register_llm", "RadixTree", "OverlapScores", "compute_block_hash_for_seq"]

# defined in dynamo.kv.api, imported on first use
_KV_API = {"RadixTree", "OverlapScores", "compute_block_hash_for_seq"}


def __getattr__(name: str) -> Any:
    if name == "ModelType":
        from dynamo.llm.model_type import ModelType

        return ModelType
    if name == "register_llm":
        from dynamo.llm.register import register_llm

        return register_llm
    if name in _KV_API:
        from dynamo.kv import api

        return getattr(api, name)
    raise AttributeError(f"module 'dynamo.llm' has no attribute {name!r}")
