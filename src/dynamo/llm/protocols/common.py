"""The request and response between the pre-processor and a token-level (core) engine.

These are also the one wire format to Backend-type workers, ours and Dynamo 1.x's alike, and to ``pytok:``
engines: Dynamo 1.x's ``PreprocessedRequest`` and ``LLMEngineOutput``, their field names, places and order
(the request as 1.6.1's frontend sends it, nulls included; measured on the wire, tests/unit/runtime/data),
plus our own fields, which a 1.x worker ignores (serde skips unknown fields: checked against 1.6.1's
mocker in tests/dynamo1x); a 1.x frontend asks for none of the item's.  Our fields either ask a worker for more than the engine does
(``detokenize``, ``parsing``) or carry what 1.x has no place for; what would change the answer if a 1.x
worker ignored it is refused before it is sent to one (:mod:`.wire`).
"""

from __future__ import annotations

from typing import Any

import msgspec


class StopConditions(msgspec.Struct, omit_defaults=False):
    max_tokens: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None  # 1.x's: hidden unless also visible
    stop_token_ids_visible: list[int] | None = None  # stop on these, and show them
    stop_token_ids_hidden: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    max_thinking_tokens: int | None = None  # 1.x's; refused by our workers when set


class SamplingOptions(msgspec.Struct, omit_defaults=False):
    n: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    seed: int | None = None
    include_stop_str_in_output: bool | None = None
    guided_decoding: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None  # ours: token id (as a string, as in JSON) -> bias


class OutputOptions(msgspec.Struct, omit_defaults=False):
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool | None = None
    formatted_prompt: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # ours: the hidden stop token (EOS) that ends a choice keeps its logprob entry, as the legacy
    # completions shape has it (OpenAI, vLLM): a scorer reading "the prompt's entries, then one per
    # generated token" must find one for a token that was generated but not shown
    stop_token_logprobs: bool | None = None


class ResponseParsing(msgspec.Struct, omit_defaults=True):
    """How to parse the response (ours, not in the original): parser names from the model card, and
    the request's switches.  ``reasoning_started``: True when the prompt ends inside ``<think>``, False
    when the client turned thinking off (``chat_template_kwargs.enable_thinking``)."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    reasoning_started: bool | None = None
    parallel_tool_calls: bool | None = None
    forced_tool: str | None = None  # tool_choice under guided decoding: "required", or "function:NAME"
    resumed_tokens: int | None = None  # a migrated request: the last N prompt tokens were generated already


class ImageInput(msgspec.Struct):
    """One image of a prompt, as the frontend sends it to the engine (llm/image_prompt.py): the encoded file
    it loaded and checked once, the 64-bit hash of its decoded pixels, and the run of placeholder token ids
    that stands for it in ``token_ids`` (``offset``, ``length``)."""

    data: bytes  # the encoded image (PNG, JPEG, WEBP or GIF); base64 in JSON
    mm_hash: int
    offset: int
    length: int


class Routing(msgspec.Struct, omit_defaults=True):
    """1.x's routing hints (only the ones set are sent, as 1.6.1 sends them)."""

    backend_instance_id: int | None = None  # the client named the worker (``nvext.backend_instance_id``)
    dp_rank: int | None = None  # the engine's data-parallel rank; ours have one, 0
    lora_name: str | None = None  # 1.x's way to name a LoRA adapter (ours name it in ``model``)


class PreprocessedRequest(msgspec.Struct, kw_only=True, omit_defaults=False):
    model: str | None = None
    token_ids: list[int]
    stop_conditions: StopConditions = msgspec.field(default_factory=StopConditions)
    sampling_options: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    output_options: OutputOptions = msgspec.field(default_factory=OutputOptions)
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    mdc_sum: str | None = None
    annotations: list[str] = msgspec.field(default_factory=list)
    routing: Routing | None = None
    router_config_override: Any = None
    # 1.x's, which our workers cannot honour: refused when set (wire.py)
    prompt_embeds: Any = None
    mm_processor_kwargs: Any = None
    bootstrap_info: Any = None
    prefill_result: Any = None
    batch_token_ids: list[list[int]] | None = None
    # ours from here on
    estimated_prefix_hit_num_blocks: int | None = None  # the KV router's estimate (a tracing attribute)
    # ours: the worker sends text (detokenized, stop strings and max_tokens applied, parsed when ``parsing``
    # asks, logprob entries in ``logprobs_content``) where it has a tokenizer; without this a worker sends
    # token ids only and applies the stop conditions on ids, as a 1.x frontend (which never sets it) wants
    detokenize: bool | None = None
    # disaggregated serving: the prefill worker's KV transfer ticket (disagg/transfer.py), set by the
    # frontend on the request it sends to the decode worker
    disaggregated_params: dict[str, Any] | None = None
    # ours: another worker holding the prompt's prefix, named by the KV router for the chosen worker to
    # fetch that prefix's KV from instead of computing it (disagg/prefix_share.py): {"address", "tokens"}
    prefix_source: dict[str, Any] | None = None
    parsing: ResponseParsing | None = None  # ours: tool-call and reasoning parsing (parsers/stage.py)
    # images in the prompt (engines whose card has ``image_tokens``), in prompt order
    multi_modal_data: list[ImageInput] | None = None

    @property
    def backend_instance_id(self) -> int | None:
        return self.routing.backend_instance_id if self.routing is not None else None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PreprocessedRequest":
        return msgspec.convert(data, cls)


# Finish reasons an engine may report.  An error is ``{"error": msg}`` or ``"error: msg"``.
FINISH_EOS = "eos"
FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_CANCELLED = "cancelled"
FINISH_CONTENT_FILTER = "content_filter"


class EngineOutput(msgspec.Struct, omit_defaults=True):
    """One item of a core engine's stream, in 1.x's ``LLMEngineOutput`` layout (a worker sends it as
    :func:`dynamo.llm.protocols.wire.output_item` writes it; a frontend reads it with ``read_output``).

    ``text`` is set when the tokens were already detokenised (a worker did it, asked by ``detokenize``), in
    which case the frontend passes the item through.  ``finish_reason`` may be a string or ``{"error": msg}``.
    ``cached_tokens``: how many prompt tokens the engine found in its prefix cache, reported once (on the
    first item) by engines that know it; on the wire it travels in 1.x's ``completion_usage``.
    """

    token_ids: list[int] = msgspec.field(default_factory=list)
    tokens: list[str | None] | None = None
    text: str | None = None
    cum_log_probs: float | None = None
    log_probs: list[float] | None = None
    top_logprobs: list[Any] | None = None
    finish_reason: str | dict[str, str] | None = None
    index: int | None = None
    cached_tokens: int | None = None
    # a prefill worker's answer carries its KV transfer ticket here (disagg/transfer.py)
    disaggregated_params: dict[str, Any] | None = None
    completion_usage: dict[str, Any] | None = None  # 1.x's usage, on a worker's first and last items
    deltas: list[dict[str, Any]] | None = None  # ours: OpenAI deltas a worker parsed from the text
    # ours (llm/logprobs.py): the prompt's logprobs, aligned with the request's token_ids (None for the
    # first), sent once on the first item when ``output_options.prompt_logprobs`` asked for them
    prompt_logprobs: list[Any] | None = None
    # ours: a worker's OpenAI chat logprob entries of the tokens whose text this item carries
    # (hold-back and stop strings applied, so they match ``text``, not ``token_ids``)
    logprobs_content: list[dict[str, Any]] | None = None
    # the stop string that ended the answer, from a worker that detokenized (1.x's field, as vLLM's; the
    # frontend shows it as the choice's ``stop_reason`` and as Anthropic's ``stop_sequence``)
    stop_reason: str | int | None = None  # (1.x may name a stop token id here)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineOutput":
        return msgspec.convert(data, cls)


def finish_error_message(finish_reason: str | dict[str, str] | None) -> str | None:
    """The error text if this finish reason reports an engine error, else None."""
    if isinstance(finish_reason, dict):
        return str(finish_reason.get("error", finish_reason))
    if isinstance(finish_reason, str) and finish_reason.startswith("error"):
        return finish_reason.partition(":")[2].strip() or "engine error"
    return None
