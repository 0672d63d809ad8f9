"""The request text and batch modes send: a streaming chat with the conversation so far."""

from __future__ import annotations

from typing import Any

from dynamo.llm.protocols.openai import ChatCompletionRequest, parse_chat_request

# Sampling for interactive and batch use, as the original: a little randomness, no output cap beyond
# the context window.
DEFAULT_TEMPERATURE = 0.7


def chat_request(model: str, messages: list[dict[str, Any]], *, ignore_eos: bool = False,
                 temperature: float = DEFAULT_TEMPERATURE) -> tuple[ChatCompletionRequest, dict[str, Any]]:
    raw: dict[str, Any] = {"model": model, "messages": messages, "stream": True, "temperature": temperature}
    if ignore_eos:
        raw["ignore_eos"] = True
    return parse_chat_request(raw), raw
