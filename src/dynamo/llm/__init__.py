"""LLM serving: model cards, pre/post-processing, the HTTP service, discovery.

The names the original's Python API exports (``ModelType``, ``register_llm``) load lazily, so
importing a submodule such as ``dynamo.llm.engine`` does not pull in the distributed runtime.
"""

from typing import Any

__all__ = ["ModelType", "register_llm"]


def __getattr__(name: str) -> Any:
    if name == "ModelType":
        from dynamo.llm.model_type import ModelType

        return ModelType
    if name == "register_llm":
        from dynamo.llm.register import register_llm

        return register_llm
    raise AttributeError(f"module 'dynamo.llm' has no attribute {name!r}")
