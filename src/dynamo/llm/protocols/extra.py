"""Request types of the endpoints beyond chat and completions: tokenize, detokenize, embeddings.

Kept out of ``openai.py`` (chat/completions) so each file changes for one reason.  Validation follows
the same rules: msgspec conversion, a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from dynamo.errors import RequestError
from dynamo.llm.protocols.openai import ChatMessage, convert_request


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` rendered through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def parse_tokenize_request(raw: Any) -> TokenizeRequest:
    req: TokenizeRequest = convert_request(raw, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("Give either 'prompt' or 'messages'", param="prompt")
    if req.messages is not None and not req.messages:
        raise RequestError("The 'messages' field cannot be empty.", param="messages")
    if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in raw:
        raise RequestError("continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
    return req


def parse_detokenize_request(raw: Any) -> DetokenizeRequest:
    return convert_request(raw, DetokenizeRequest)


def parse_embedding_request(raw: Any) -> tuple[EmbeddingRequest, list[str | list[int]]]:
    """The request and its inputs as a list (one string or one token-id list per input)."""
    req: EmbeddingRequest = convert_request(raw, EmbeddingRequest)
    inputs: list[str | list[int]]
    value = req.input
    if isinstance(value, str):
        inputs = [value]
    elif value and all(isinstance(v, str) for v in value):
        inputs = list(value)
    elif value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        inputs = [list(value)]
    elif value and all(isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
                       for v in value):
        inputs = [list(v) for v in value]
    else:
        raise RequestError("'input' must be a string, a list of strings, a list of token ids or a list of "
                           "token-id lists, and not empty", param="input")
    for item in inputs:
        if isinstance(item, str) and not item:
            raise RequestError("'input' cannot contain an empty string", param="input")
        if isinstance(item, list) and any(t < 0 for t in item):
            raise RequestError("token ids in 'input' must not be negative", param="input")
    if req.dimensions is not None and req.dimensions < 1:
        raise RequestError("dimensions must be at least 1", param="dimensions")
    return req, inputs
