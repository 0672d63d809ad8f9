"""The token-level request and response on the wire, between any frontend and any Backend worker, ours or
Dynamo 1.x's: reading a request (refusing what a worker cannot honour), writing and reading one
``LLMEngineOutput`` item, and what must not be sent to a worker that ignores our fields.

One shape for every peer (:mod:`.common`): 1.x's fields in 1.x's places and words, ours beside them.  A 1.x
worker ignores our fields; where ignoring one would change the answer (images, ``logit_bias``, a batch of
prompts) the request is refused before it is sent, naming it (:class:`PeerRequest`).  What one of our
workers cannot honour of 1.x's (prompt embeddings, 1.x's image URLs, thinking budgets, other data-parallel
ranks) is refused by the worker, naming it: a request that ran without what it asked for would be a wrong
answer.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dynamo.errors import RequestError

from .common import EngineOutput, PreprocessedRequest, StopConditions, finish_error_message

_UNSUPPORTED = ("prompt_embeds", "mm_processor_kwargs", "bootstrap_info", "prefill_result")


def _refuse(what: str) -> RequestError:
    return RequestError(f"{what} is not supported by this worker (a dynamo-run worker)", status=400)


def read_request(data: Any) -> PreprocessedRequest:
    """A request as a worker receives it (a dict decoded from msgpack or JSON), checked."""
    if not isinstance(data, dict):
        raise RequestError("the request is not an object", status=400)
    for key in _UNSUPPORTED:
        if data.get(key) is not None:
            raise _refuse(key)
    if isinstance(data.get("multi_modal_data"), dict):  # 1.x's: image URLs by modality; ours is a list
        raise _refuse("multi_modal_data in Dynamo 1.x's form (image URLs)")
    try:
        req = PreprocessedRequest.from_dict(data)
    except Exception as exc:  # msgspec.ValidationError names the field
        raise RequestError(f"invalid request: {exc}", status=400) from None
    stop = req.stop_conditions
    if stop.max_thinking_tokens is not None:
        raise _refuse("stop_conditions.max_thinking_tokens")
    routing = req.routing
    if routing is not None:
        if routing.dp_rank not in (None, 0):
            raise _refuse(f"routing.dp_rank {routing.dp_rank} (this worker has one data-parallel rank, 0)")
        if routing.lora_name:  # the adapter to run: our workers select it by the model's name
            req.model = routing.lora_name
    if stop.stop_token_ids or stop.stop_token_ids_visible:
        req.stop_conditions = _hidden_and_visible(stop)
    return req


def _hidden_and_visible(stop: StopConditions) -> StopConditions:
    """1.x's ``stop_token_ids`` are hidden unless also listed as visible; a visible id is never hidden."""
    visible = stop.stop_token_ids_visible or []
    hidden = list(stop.stop_token_ids_hidden or [])
    for tid in stop.stop_token_ids or []:
        if tid not in hidden:
            hidden.append(tid)
    hidden = [t for t in hidden if t not in visible]
    return msgspec.structs.replace(stop, stop_token_ids=None, stop_token_ids_hidden=hidden or None)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    """1.x's ``completion_usage``."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"audio_tokens": None, "cached_tokens": cached_tokens}}


def finish_reason_on_wire(reason: Any) -> Any:
    """Our finish reason in 1.x's words: the same words, and an error always ``{"error": msg}``."""
    message = finish_error_message(reason)
    if message is not None:
        return {"error": message}
    return reason


def top_logprobs_on_wire(tops: list[Any] | None) -> list[Any] | None:
    """An engine's alternatives (``[[{"token_id", "logprob"}]]`` per token) as 1.x's ``TopLogprob`` lists
    (rank from 1); readers take ``token_id`` and ``logprob`` from either."""
    if tops is None:
        return None
    return [[{"rank": i + 1, "token_id": t.get("token_id"), "token": None, "logprob": t.get("logprob")}
             for i, t in enumerate(alts or [])] for alts in tops]


MIN_PROMPT_LOGPROB = -9999.0  # OpenAI's floor (JSON has no -inf; 1.x reads these through serde_json)


def prompt_logprobs_on_wire(token_ids: list[int], ours: list[Any]) -> list[Any]:
    """An engine's prompt logprobs (per prompt token: None for the first, else ``{"logprob", "top_logprobs":
    [{"token_id", "logprob"}]}``) as 1.x's ``PromptLogprobs``, vLLM's shape: per prompt token None, or
    ``{"<token id>": {"logprob", "rank"}}`` of the token itself and the alternatives (ranks from 1 among
    those; the token's own rank only where it is among them).  1.x's frontend reads them from the item's
    ``engine_data["prompt_logprobs"]`` (keys must be strings there: it reads ``engine_data`` as JSON)."""
    out: list[Any] = []
    for i, tid in enumerate(token_ids):
        entry = ours[i] if i < len(ours) else None
        if entry is None:
            out.append(None)
            continue
        alts = sorted(entry.get("top_logprobs") or (), key=lambda a: -(a.get("logprob") or MIN_PROMPT_LOGPROB))
        row = {str(a["token_id"]): {"logprob": _floor(a.get("logprob")), "rank": r + 1} for r, a in enumerate(alts)}
        if str(tid) not in row:
            row[str(tid)] = {"logprob": _floor(entry.get("logprob"))}
        out.append(row)
    return out


def _floor(lp: Any) -> float:
    lp = float(lp) if lp is not None else MIN_PROMPT_LOGPROB
    return lp if lp >= MIN_PROMPT_LOGPROB else MIN_PROMPT_LOGPROB  # also -inf and NaN


def output_item(token_ids: list[int], finish_reason: Any, completion_usage: dict[str, Any] | None, *,
                out: EngineOutput | None = None) -> dict[str, Any]:
    """One token item, ``LLMEngineOutput`` as 1.6.1's workers write it (its fields, in its order: byte for
    byte).  ``out``: the engine's item whose logprobs, index and KV transfer ticket go with it (None: an
    item the worker made, the last one)."""
    item: dict[str, Any] = {"token_ids": token_ids, "tokens": None, "text": None, "output_type": "text"}
    if out is None:
        item.update(cum_log_probs=None, log_probs=None, top_logprobs=None,
                    finish_reason=finish_reason_on_wire(finish_reason), index=None)
    else:
        item.update(cum_log_probs=out.cum_log_probs, log_probs=out.log_probs,
                    top_logprobs=top_logprobs_on_wire(out.top_logprobs),
                    finish_reason=finish_reason_on_wire(finish_reason), index=out.index)
    if completion_usage is not None:
        item["completion_usage"] = completion_usage
    if out is not None and out.disaggregated_params is not None:  # a prefill worker's KV transfer ticket
        item["disaggregated_params"] = out.disaggregated_params
    return item


def read_output(item: dict[str, Any]) -> EngineOutput:
    """A worker's item (ours or 1.x's) as the frontend works with it: ``cached_tokens`` from
    ``completion_usage``, 1.x's ``abort`` as ``cancelled``."""
    out = msgspec.convert(item, EngineOutput)
    u = out.completion_usage
    if u is not None:
        details = u.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            out.cached_tokens = details["cached_tokens"]
    if out.finish_reason == "abort":
        out.finish_reason = "cancelled"
    return out


class PeerRequest(dict[str, Any]):
    """A request on its way to a worker chosen by the router: the one body every worker takes (it *is*
    that dict).  A 1.x worker ignores our fields, so :meth:`v1_body` (the runtime client asks for it when the
    worker is a 1.x one: ``runtime.client.PeerBody``) refuses, naming it, what it would ignore and so answer
    differently: the client then gets a 400, not another answer."""

    __slots__ = ("request",)

    def __init__(self, request: PreprocessedRequest) -> None:
        super().__init__(request.to_dict())
        self.request = request

    def body(self) -> dict[str, Any]:
        return self

    def v1_body(self) -> dict[str, Any]:
        req = self.request
        if req.multi_modal_data:
            raise RequestError("images cannot be sent to a Dynamo 1.x worker (it takes no image bytes over this "
                               "wire); serve the model with a dynamo-run worker", param="messages")
        if req.sampling_options.logit_bias:
            raise RequestError("logit_bias is not applied by a Dynamo 1.x worker", param="logit_bias")
        if req.batch_token_ids:
            raise RequestError("a batch of prompts in one engine request cannot be sent to a Dynamo 1.x worker",
                               param="prompt")
        return self
