"""Dynamo 1.x's token-level request and response (``PreprocessedRequest``, ``LLMEngineOutput``) beside ours
(:mod:`.common`), both ways: a 1.x frontend's request served by one of our core engines, and a 1.x
worker's items read by our frontend.

Why a mapping rather than the same structs: ours and 1.x's share most fields and names (they have one
ancestor), but 1.x moved some (``routing.backend_instance_id``, usage as ``completion_usage``), added some
(visible stop ids, ``max_thinking_tokens``, ``output_type``) and a 1.x frontend preprocesses and
detokenizes itself (its card says ``model_input: Tokens``), so it wants token ids only and counts
nothing it can be told. What we cannot honour is refused with a message naming it (a
:class:`~dynamo.errors.RequestError`), never ignored: a request that runs without what it asked for would
be a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynamo.errors import RequestError

from .common import EngineOutput, PreprocessedRequest, finish_error_message

V1_OUTPUT_KEY = "output_type"  # every 1.x LLMEngineOutput has it ("text"); ours never do


@dataclass
class V1Request:
    """A 1.x request as one of our engines runs it, and what the worker itself must do on top."""

    request: PreprocessedRequest
    visible_stop_ids: frozenset[int]  # stop on these, and show them (1.x's stop_token_ids_visible)


def _refuse(what: str) -> RequestError:
    return RequestError(f"{what} is not supported by this worker (a dynamo-run worker serving a Dynamo 1.x "
                        "frontend)", status=400)


def request_from_v1(data: dict[str, Any]) -> V1Request:
    """Our request from a 1.x ``PreprocessedRequest`` (a dict, decoded from msgpack or JSON)."""
    if not isinstance(data, dict):
        raise RequestError("the request is not an object", status=400)
    for key in ("prompt_embeds", "multi_modal_data", "mm_processor_kwargs", "bootstrap_info", "prefill_result"):
        if data.get(key) is not None:
            raise _refuse(key)
    stop = dict(data.get("stop_conditions") or {})
    if stop.get("max_thinking_tokens") is not None:
        raise _refuse("stop_conditions.max_thinking_tokens")
    hidden = list(stop.get("stop_token_ids_hidden") or [])
    for tid in stop.get("stop_token_ids") or []:  # hidden unless also listed as visible
        if tid not in hidden:
            hidden.append(tid)
    visible = frozenset(stop.get("stop_token_ids_visible") or [])
    hidden = [t for t in hidden if t not in visible]
    out = dict(data.get("output_options") or {})
    routing = data.get("routing") or {}
    body = {
        "token_ids": data.get("token_ids") or [],
        "model": data.get("model"),
        "stop_conditions": {"max_tokens": stop.get("max_tokens"), "stop": stop.get("stop"),
                            "stop_token_ids_hidden": hidden or None, "min_tokens": stop.get("min_tokens"),
                            "ignore_eos": stop.get("ignore_eos")},
        "sampling_options": {k: v for k, v in (data.get("sampling_options") or {}).items()
                             if k != "include_stop_str_in_output"},  # stop strings: the 1.x frontend's job
        "output_options": {"logprobs": out.get("logprobs"), "prompt_logprobs": out.get("prompt_logprobs"),
                           "skip_special_tokens": out.get("skip_special_tokens"),
                           "formatted_prompt": out.get("formatted_prompt")},
        "eos_token_ids": data.get("eos_token_ids") or [],
        "mdc_sum": data.get("mdc_sum"),
        "annotations": data.get("annotations") or [],
        "backend_instance_id": routing.get("backend_instance_id") if isinstance(routing, dict) else None,
    }
    try:
        request = PreprocessedRequest.from_dict(body)
    except Exception as exc:  # msgspec.ValidationError names the field
        raise RequestError(f"invalid request: {exc}", status=400) from None
    if isinstance(routing, dict) and routing.get("dp_rank") not in (None, 0):
        raise _refuse(f"routing.dp_rank {routing['dp_rank']} (this worker has one data-parallel rank, 0)")
    return V1Request(request, visible)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    """1.x's ``completion_usage``."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"audio_tokens": None, "cached_tokens": cached_tokens}}


def v1_finish_reason(reason: Any) -> Any:
    """Our finish reason as 1.x's: the same words, and an error always ``{"error": msg}``."""
    message = finish_error_message(reason)
    if message is not None:
        return {"error": message}
    return reason


def v1_top_logprobs(tops: list[Any] | None) -> list[Any] | None:
    """Ours (``[[{"token_id", "logprob"}]]`` per token) as 1.x's ``TopLogprob`` lists (rank from 1)."""
    if tops is None:
        return None
    return [[{"rank": i + 1, "token_id": t.get("token_id"), "token": None, "logprob": t.get("logprob")}
             for i, t in enumerate(alts or [])] for alts in tops]


def v1_output(out: EngineOutput, token_ids: list[int], finish_reason: Any,
              completion_usage: dict[str, Any] | None) -> dict[str, Any]:
    """One ``LLMEngineOutput``: token ids only (a 1.x frontend detokenizes), in 1.x's field order."""
    item: dict[str, Any] = {
        "token_ids": token_ids, "tokens": None, "text": None, "output_type": "text",
        "cum_log_probs": out.cum_log_probs, "log_probs": out.log_probs,
        "top_logprobs": v1_top_logprobs(out.top_logprobs),
        "finish_reason": v1_finish_reason(finish_reason), "index": out.index,
    }
    if completion_usage is not None:
        item["completion_usage"] = completion_usage
    return item


def engine_output_from_v1(item: dict[str, Any]) -> EngineOutput:
    """A 1.x worker's ``LLMEngineOutput`` as our EngineOutput: its token ids (our frontend detokenizes),
    its finish reason, and the prompt tokens its prefix cache held (``cached_tokens``)."""
    usage_block = item.get("completion_usage")
    cached = None
    if isinstance(usage_block, dict):
        details = usage_block.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached = details.get("cached_tokens")
    reason = item.get("finish_reason")
    if reason == "abort":  # 1.x's alias of cancelled
        reason = "cancelled"
    tops = item.get("top_logprobs")
    return EngineOutput(
        token_ids=list(item.get("token_ids") or []),
        text=item.get("text"),
        cum_log_probs=item.get("cum_log_probs"),
        log_probs=item.get("log_probs"),
        top_logprobs=None if tops is None else [[{"token_id": t.get("token_id"), "logprob": t.get("logprob")}
                                                 for t in (alts or [])] for alts in tops],
        finish_reason=reason,
        index=item.get("index"),
        cached_tokens=cached if isinstance(cached, int) else None,
        disaggregated_params=item.get("disaggregated_params"),
    )


# ours, with no 1.x field: what the frontend needs (parsing), or hints a 1.x worker may ignore without
# changing the answer (the router's prefix estimate, a prefix to fetch, our disaggregation ticket: without it
# the worker computes the prompt itself)
_OURS_ONLY = ("parsing", "prefix_source", "estimated_prefix_hit_num_blocks", "disaggregated_params",
              "batch_token_ids", "backend_instance_id", "multi_modal_data")


def request_to_v1(req: PreprocessedRequest) -> dict[str, Any]:
    """Our request as a 1.x worker's ``PreprocessedRequest``.  What it would ignore and so answer wrongly
    (images, ``logit_bias``) is refused, naming it: the client then gets a 400, not another answer."""
    if req.multi_modal_data:
        raise RequestError("images cannot be sent to a Dynamo 1.x worker (it takes no image bytes over this "
                           "wire); serve the model with a dynamo-run worker", param="messages")
    if req.sampling_options.logit_bias:
        raise RequestError("logit_bias is not applied by a Dynamo 1.x worker", param="logit_bias")
    if req.batch_token_ids:
        raise RequestError("a batch of prompts in one engine request cannot be sent to a Dynamo 1.x worker",
                           param="prompt")
    body = req.to_dict()
    for key in _OURS_ONLY:
        body.pop(key, None)
    body["sampling_options"].pop("logit_bias", None)
    body["output_options"].pop("stop_token_logprobs", None)
    body["routing"] = {"backend_instance_id": req.backend_instance_id} if req.backend_instance_id is not None \
        else None
    return body


class PeerRequest(dict[str, Any]):
    """A request on its way to a worker chosen by the router: the dict our workers take (it *is* that dict,
    so whoever looks at the body sent sees the usual fields), and 1.x's for a 1.x worker (the runtime client
    asks for the one it needs: ``runtime.client.PeerBody``)."""

    __slots__ = ("request",)

    def __init__(self, request: PreprocessedRequest) -> None:
        super().__init__(request.to_dict())
        self.request = request

    def body(self) -> dict[str, Any]:
        return self

    def v1_body(self) -> dict[str, Any]:
        return request_to_v1(self.request)
