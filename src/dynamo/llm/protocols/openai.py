"""OpenAI request types, validated with msgspec.

The HTTP body is decoded once into a dict (kept as ``raw`` because chat templates need the messages
exactly as sent, extra keys included) and converted into these structs to validate types and ranges.
Unknown top-level fields are ignored, as vLLM and the original do.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping

import msgspec

from dynamo.errors import RequestError
from dynamo.llm.media import MediaError, check_image_count, current_policy, image_parts


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class NvExt(msgspec.Struct):
    """NVIDIA extensions (``nvext``); root-level copies of the same fields take precedence."""

    ignore_eos: bool | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    greed_sampling: bool | None = None
    use_raw_prompt: bool | None = None
    annotations: list[str] | None = None
    backend_instance_id: int | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    guided_decoding_backend: str | None = None


class ImageUrl(msgspec.Struct, forbid_unknown_fields=False):
    """An ``image_url`` part's object form.  ``detail`` (OpenAI's resolution hint) is accepted and has no
    effect: the model's own image encoder fixes how many tokens an image becomes."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(msgspec.Struct, forbid_unknown_fields=False):
    type: str
    text: str | None = None
    image_url: str | ImageUrl | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by chat and completions requests."""

    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM-style extensions at the root
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    guided_decoding_backend: str | None = None
    nvext: NvExt | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None
    # vLLM's: the last (assistant) message is continued, not closed: the prompt ends where its content ends
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


MAX_STOP_SEQUENCES = 4
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit (chat's top_logprobs: 20)
MAX_CHOICES = 16  # n: each choice is an engine request of its own (llm/fanout.py)


def parse_chat_request(raw: Any) -> ChatCompletionRequest:
    req = convert_request(raw, ChatCompletionRequest)
    if not req.messages:
        raise RequestError(
            "The 'messages' field cannot be empty. At least one message is required.", param="messages"
        )
    check_image_count(image_parts(raw["messages"]), current_policy())  # --limit-mm-per-prompt
    _validate_common(req)
    if req.continue_final_message and req.add_generation_prompt:  # vLLM's answer, word for word
        raise RequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                           param="continue_final_message")
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        raise RequestError("max_completion_tokens must be at least 1", param="max_completion_tokens")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise RequestError("top_logprobs must be between 0 and 20", param="top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    _check_min_max(req)
    return req


def parse_completion_request(raw: Any) -> CompletionRequest:
    req = convert_request(raw, CompletionRequest)
    if isinstance(req.prompt, list):
        if len(req.prompt) == 0:
            raise RequestError("The 'prompt' field cannot be empty.", param="prompt")
        if not (
            all(isinstance(p, str) for p in req.prompt)
            or all(isinstance(p, int) and not isinstance(p, bool) for p in req.prompt)
            or all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in req.prompt)
        ):
            raise RequestError(
                "'prompt' must be a string, a list of strings, a list of token ids or a list of "
                "token-id lists",
                param="prompt",
            )
    _validate_common(req)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise RequestError(f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}", param="logprobs")
    _check_min_max(req)
    return req


def _check_min_max(req: "ChatCompletionRequest | CompletionRequest") -> None:
    max_tokens = max_tokens_of(req)
    if req.min_tokens is not None and max_tokens is not None and req.min_tokens > max_tokens:
        raise RequestError(
            f"min_tokens ({req.min_tokens}) must be less than or equal to max_tokens ({max_tokens})",
            param="min_tokens",
        )


def convert_request(raw: Any, cls: type) -> Any:
    """The JSON body ``raw`` as the request type ``cls``; a shape error is a RequestError naming the field."""
    if not isinstance(raw, dict):
        raise RequestError("The request body must be a JSON object.")
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as e:
        text = str(e)
        param = None
        if " - at `$." in text:
            text, _, where = text.partition(" - at `$.")
            param = where.rstrip("`")
            text = f"{text} at '{param}'"
        elif "missing required field `" in text:
            param = text.split("`")[1]
        raise RequestError(f"Invalid request: {text}", param=param) from None


_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "frequency_penalty": (-2.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
    "min_p": (0.0, 1.0),
}


def check_ranges(req: Any, ranges: Mapping[str, tuple[float, float]]) -> None:
    """Each named float field of ``req`` that is set lies in its closed range (NaN never does)."""
    for field, (lo, hi) in ranges.items():
        value = getattr(req, field)
        if value is not None and (math.isnan(value) or not lo <= value <= hi):
            raise RequestError(
                f"Error validating {field}: Value {value} is out of range [{lo}, {hi}]", param=field
            )


def _validate_common(req: _SamplingFields) -> None:
    check_ranges(req, _RANGES)
    rep = req.repetition_penalty if req.repetition_penalty is not None else (
        req.nvext.repetition_penalty if req.nvext else None
    )
    if rep is not None and not 0 < rep <= 2:
        raise RequestError(
            f"Error validating repetition_penalty: Value {rep} is out of range (0, 2]",
            param="repetition_penalty",
        )
    if req.max_tokens is not None and req.max_tokens < 1:
        # 0 with echo: the prompt alone, with its logprobs (how eval harnesses score a text)
        if not (req.max_tokens == 0 and isinstance(req, CompletionRequest) and req.echo):
            raise RequestError("max_tokens must be at least 1 (0 only with echo on /v1/completions)",
                               param="max_tokens")
    if req.min_tokens is not None and req.min_tokens < 0:
        raise RequestError("min_tokens must be at least 0", param="min_tokens")
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise RequestError(f"n must be between 1 and {MAX_CHOICES}", param="n")
    stops = stop_list(req.stop)
    if stops and len(stops) > MAX_STOP_SEQUENCES:
        raise RequestError(
            f"At most {MAX_STOP_SEQUENCES} stop sequences are allowed", param="stop"
        )
    guided = [
        g
        for g in ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
        if getattr(req, g) is not None or (req.nvext is not None and getattr(req.nvext, g) is not None)
    ]
    if len(guided) > 1:
        raise RequestError(
            "Only one of json, regex, choice, or grammar can be set for guided decoding",
            param=guided[1],
        )


def stop_list(stop: str | list[str] | None) -> list[str] | None:
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else list(stop)
    items = [s for s in items if s]
    return items or None


def ignore_eos(req: _SamplingFields) -> bool:
    if req.ignore_eos is not None:
        return req.ignore_eos
    return bool(req.nvext and req.nvext.ignore_eos)


def max_tokens_of(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def include_usage(req: _SamplingFields) -> bool:
    """Whether the answer carries usage: a stream when ``stream_options.include_usage`` asks, a whole answer
    always. The usage chunk then travels with a whole answer too, so that a frontend in front of a remote
    Chat worker (a Processor) reports the worker's counts rather than counting chunks itself."""
    if not req.stream:
        return True
    return bool(req.stream_options and req.stream_options.include_usage)


def last_user_text(req: ChatCompletionRequest) -> str:
    """The text of the last message, which must be the user's (what echo_full echoes)."""
    msg = req.messages[-1]
    if msg.role != "user":
        raise RequestError("Invalid request type, expected User message", param="messages")
    return content_text(msg.content)


def content_text(content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type == "image_url":
            raise MediaError("This model does not accept images (image_url parts)")
        if part.type != "text" or part.text is None:
            raise RequestError(
                f"Content parts of type '{part.type}' are not supported by this model", param="messages"
            )
        parts.append(part.text)
    return "\n".join(parts)


def prompt_text(prompt: str | list[str] | list[int] | list[list[int]]) -> str:
    """A completions prompt as text (what echo_full echoes): string arrays joined by spaces."""
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(p, str) for p in prompt):
        return " ".join(prompt)  # type: ignore[arg-type]
    if all(isinstance(p, int) for p in prompt):
        return " ".join(str(p) for p in prompt)
    return " | ".join(" ".join(str(t) for t in p) for p in prompt)  # type: ignore[union-attr]
