"""What kind of requests a registered endpoint takes (Dynamo's ``ModelType`` names)."""

from __future__ import annotations

import enum


class ModelType(enum.Enum):
    Backend = "Backend"  # pre-processed token requests; the frontend templates, tokenizes, detokenizes
    Chat = "Chat"  # OpenAI chat requests in, chat chunks out
    Completion = "Completion"  # OpenAI completions requests in, completion chunks out
    Embedding = "Embedding"
    # a prefill worker of a Backend model (``--disaggregation-mode prefill``): takes pre-processed requests,
    # computes the prompt's KV state and the first token, hands the state to a decode worker (Dynamo 1.x's
    # ModelType.Prefill); frontends route to it before the model's Backend workers
    Prefill = "Prefill"

    @classmethod
    def parse(cls, value: "ModelType | str") -> "ModelType":
        if isinstance(value, ModelType):
            return value
        for member in cls:
            if member.value.lower() == str(value).lower():
                return member
        raise ValueError(f"unknown model type {value!r}; one of {[m.value for m in cls]}")
