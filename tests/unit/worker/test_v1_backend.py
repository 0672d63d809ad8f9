"""A core engine (the echo engine, which repeats the prompt's tokens) served to a Dynamo 1.x frontend
(worker/v1_backend.py): 1.x's items, its visible stop ids honoured, what we cannot honour refused by name,
and a 1.x worker's items read back as ours (llm/protocols/v1.py)."""

from __future__ import annotations

import pytest

from dynamo.engines.echo import EchoCoreEngine
from dynamo.errors import RequestError
from dynamo.llm.engine import Context
from dynamo.llm.protocols.v1 import engine_output_from_v1, request_from_v1, v1_finish_reason
from dynamo.worker.handlers import backend_handler
from dynamo.worker.v1_backend import v1_token_stream


def v1_request(token_ids, **stop) -> dict:
    """A 1.x PreprocessedRequest as its frontend sends it (nulls included)."""
    return {"model": "m", "token_ids": token_ids,
            "stop_conditions": {"max_tokens": None, "stop": None, "stop_token_ids": None,
                                "stop_token_ids_visible": None, "stop_token_ids_hidden": [2],
                                "min_tokens": None, "ignore_eos": None, "max_thinking_tokens": None, **stop},
            "sampling_options": {"n": None, "temperature": None, "include_stop_str_in_output": None,
                                 "guided_decoding": None},
            "output_options": {"logprobs": None, "prompt_logprobs": None, "skip_special_tokens": None,
                               "formatted_prompt": None, "return_tokens_as_token_ids": None},
            "eos_token_ids": [2], "mdc_sum": "x", "annotations": [], "routing": {"dp_rank": 0},
            "router_config_override": None}


async def collect(request: dict) -> list[dict]:
    return [x async for x in v1_token_stream(EchoCoreEngine(delay=0), request, Context())]


async def test_token_ids_only_with_usage_on_the_first_and_the_last_item():
    items = await collect(v1_request([5, 6, 7]))
    assert [i["token_ids"] for i in items] == [[5], [6], [7], []]
    assert all(i["text"] is None and i["output_type"] == "text" for i in items)
    assert [i["finish_reason"] for i in items] == [None, None, None, "stop"]
    assert [("completion_usage" in i) for i in items] == [True, False, False, True]
    assert items[0]["completion_usage"]["completion_tokens"] == 1
    assert items[-1]["completion_usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                             "prompt_tokens_details": {"audio_tokens": None, "cached_tokens": None}}


async def test_a_visible_stop_id_is_shown_and_ends_the_answer():
    items = await collect(v1_request([5, 9, 7], stop_token_ids_visible=[9]))
    assert [i["token_ids"] for i in items] == [[5], [9]]
    assert items[-1]["finish_reason"] == "stop" and items[-1]["completion_usage"]["completion_tokens"] == 2


async def test_max_tokens_ends_the_answer_with_length():
    """A 1.x frontend does not cut the answer at max_tokens: the worker must (echo_core would echo on)."""
    items = await collect(v1_request([5, 6, 7, 8], max_tokens=2))
    assert [i["token_ids"] for i in items] == [[5], [6]]
    assert items[-1]["finish_reason"] == "length" and items[-1]["completion_usage"]["completion_tokens"] == 2


async def test_end_of_sequence_ends_the_answer_unless_ignored_or_too_early():
    items = await collect(v1_request([5, 2, 7]))  # 2 is the end of sequence: not shown, finish "eos"
    assert [i["token_ids"] for i in items] == [[5], []]
    assert items[-1]["finish_reason"] == "eos" and items[-1]["completion_usage"]["completion_tokens"] == 1
    ignored = await collect(v1_request([5, 2, 7], ignore_eos=True, stop_token_ids_hidden=None))
    assert [i["token_ids"] for i in ignored][:3] == [[5], [2], [7]]
    early = await collect(v1_request([2, 5, 2, 7], min_tokens=2))  # the first 2 comes before min_tokens
    assert [i["token_ids"] for i in early] == [[2], [5], []]


@pytest.mark.parametrize("change, named", [
    ({"stop_conditions": {"max_thinking_tokens": 10}}, "max_thinking_tokens"),
    ({"prompt_embeds": b"\x00"}, "prompt_embeds"),
    ({"multi_modal_data": {"image_url": []}}, "multi_modal_data"),
    ({"routing": {"dp_rank": 2}}, "dp_rank 2"),
])
async def test_what_we_cannot_honour_is_refused_by_name(change, named):
    request = v1_request([5])
    for key, value in change.items():
        request[key] = {**request[key], **value} if isinstance(request.get(key), dict) else value
    with pytest.raises(RequestError, match=named):
        await collect(request)


def test_routing_and_stop_ids_map_to_ours():
    request = v1_request([1], stop_token_ids=[7, 8], stop_token_ids_visible=[8])
    request["routing"] = {"backend_instance_id": 42, "dp_rank": 0}
    v1 = request_from_v1(request)
    assert v1.request.backend_instance_id == 42
    assert v1.request.stop_conditions.stop_token_ids_hidden == [2, 7] and v1.visible_stop_ids == {8}


def test_finish_reasons_both_ways():
    assert v1_finish_reason("error: boom") == {"error": "boom"}
    assert v1_finish_reason({"error": "x"}) == {"error": "x"} and v1_finish_reason("length") == "length"
    assert engine_output_from_v1({"token_ids": [], "finish_reason": "abort", "output_type": "text"}).finish_reason \
        == "cancelled"
    out = engine_output_from_v1({"token_ids": [3], "output_type": "text", "top_logprobs": [[
        {"rank": 1, "token_id": 3, "token": None, "logprob": -0.5}]],
        "completion_usage": {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}})
    assert out.cached_tokens == 2 and out.top_logprobs == [[{"token_id": 3, "logprob": -0.5}]]


class _RuntimeContext:
    """What the runtime hands a handler for a request from a 1.x peer (runtime/context.py)."""

    def __init__(self) -> None:
        from dynamo.runtime.context import Context as RtContext

        self.ctx = RtContext("r1")
        self.ctx.v1_peer = True


async def test_the_backend_handler_answers_a_v1_peer_with_tokens_only(tmp_path):
    from dynamo.llm.model_card import ModelCard

    card = ModelCard(display_name="m")
    handler = backend_handler(card, EchoCoreEngine(delay=0))
    items = [x async for x in handler(v1_request([5, 6]), _RuntimeContext().ctx)]
    assert [i["token_ids"] for i in items] == [[5], [6], []] and items[0]["text"] is None


def test_our_request_as_a_1x_worker_reads_it():
    """The frontend's request in 1.x's shape: our own fields gone, the instance under ``routing``; what a 1.x
    worker would ignore and so answer differently is refused by name."""
    from dynamo.llm.protocols.common import ImageInput, PreprocessedRequest, SamplingOptions
    from dynamo.llm.protocols.v1 import PeerRequest, request_to_v1

    req = PreprocessedRequest(token_ids=[1, 2], model="m", backend_instance_id=7, prefix_source={"address": "x"})
    body = request_to_v1(req)
    assert body["routing"] == {"backend_instance_id": 7} and body["token_ids"] == [1, 2] and body["model"] == "m"
    assert not {"prefix_source", "parsing", "backend_instance_id", "multi_modal_data"} & set(body)
    assert "logit_bias" not in body["sampling_options"]
    assert PeerRequest(req).body() == req.to_dict()
    with pytest.raises(RequestError, match="images"):
        request_to_v1(PreprocessedRequest(token_ids=[1], multi_modal_data=[ImageInput(b"x", 1, 0, 1)]))
    with pytest.raises(RequestError, match="logit_bias"):
        request_to_v1(PreprocessedRequest(token_ids=[1], sampling_options=SamplingOptions(logit_bias={"3": 1.0})))
