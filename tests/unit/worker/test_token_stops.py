"""A core engine (the echo engine, which repeats the prompt's tokens) served by the Backend handler to a
frontend that does not ask for text (a Dynamo 1.x frontend; worker/token_stops.py) and to one that does (ours):
1.x's items either way, visible stop ids honoured, what we cannot honour refused by name, and a worker's
items read back by the frontend (llm/protocols/wire.py)."""

from __future__ import annotations

import pytest

from dynamo.engines.echo import EchoCoreEngine
from dynamo.errors import RequestError
from dynamo.llm.model_card import ModelCard
from dynamo.llm.protocols.wire import finish_reason_on_wire, read_output, read_request
from dynamo.runtime.context import Context as RtContext
from dynamo.worker.handlers import backend_handler


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


async def collect(request: dict, card: ModelCard | None = None) -> list[dict]:
    handler = backend_handler(card or ModelCard(display_name="m"), EchoCoreEngine(delay=0))
    return [x async for x in handler(request, RtContext("r1"))]


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
    req = read_request(request)
    assert req.backend_instance_id == 42
    assert req.stop_conditions.stop_token_ids_hidden == [2, 7] and req.stop_conditions.stop_token_ids_visible == [8]


async def test_an_engines_prompt_logprobs_go_in_1xs_place_to_a_1x_frontend_and_in_ours_to_ours():
    """A 1.x frontend reads them from the last item's ``engine_data`` in 1.x's shape
    (tests/dynamo1x/test_d16_prompt_logprobs.py); ours from our field on the item that carried them."""
    from dynamo.llm.protocols.common import EngineOutput

    class PromptLogprobs:
        async def generate(self, request, context):
            yield EngineOutput(token_ids=[5], prompt_logprobs=[None, {"logprob": -1.0, "top_logprobs": []}])
            yield EngineOutput(token_ids=[], finish_reason="stop")

    handler = backend_handler(ModelCard(display_name="m"), PromptLogprobs())  # type: ignore[arg-type]
    items = [x async for x in handler(v1_request([1, 6]), RtContext("r1"))]
    assert "prompt_logprobs" not in items[0] and "engine_data" not in items[0]
    assert items[-1]["engine_data"] == {"prompt_logprobs": [None, {"6": {"logprob": -1.0}}]}
    assert list(items[0])[:4] == ["token_ids", "tokens", "text", "output_type"]
    ours = dict(v1_request([1, 6]), detokenize=True)  # our frontend, to a worker without a tokenizer
    items = [x async for x in handler(ours, RtContext("r2"))]
    assert items[0]["prompt_logprobs"] == [None, {"logprob": -1.0, "top_logprobs": []}]
    assert all("engine_data" not in item for item in items)


def test_a_lora_named_in_routing_is_the_model_the_worker_checks():
    """1.x names an adapter in ``routing.lora_name``: the worker runs that adapter, or refuses it, never the
    base model in its place."""
    request = v1_request([1])
    request["routing"] = {"lora_name": "my-adapter"}
    assert read_request(request).model == "my-adapter"


def test_finish_reasons_both_ways():
    assert finish_reason_on_wire("error: boom") == {"error": "boom"}
    assert finish_reason_on_wire({"error": "x"}) == {"error": "x"} and finish_reason_on_wire("length") == "length"
    assert read_output({"token_ids": [], "finish_reason": "abort", "output_type": "text"}).finish_reason \
        == "cancelled"
    out = read_output({"token_ids": [3], "output_type": "text", "top_logprobs": [[
        {"rank": 1, "token_id": 3, "token": None, "logprob": -0.5}]],
        "completion_usage": {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}})
    assert out.cached_tokens == 2 and out.top_logprobs[0][0]["token_id"] == 3
    assert out.top_logprobs[0][0]["logprob"] == -0.5


async def test_a_request_that_asks_for_text_gets_it_in_the_same_items(tiny_model):
    """Our frontend's request (``detokenize``) and a 1.x frontend's differ by that one field: the items are
    1.x's either way (a text item leaves out 1.x's null fields), text only where asked."""
    from dynamo.llm.model_card import load_hf_folder
    from dynamo.llm.tokenizer import Tokenizer

    card = load_hf_folder(tiny_model)
    prompt = Tokenizer(card.tokenizer_json).encode("hello world")  # type: ignore[arg-type]
    plain = await collect(v1_request(prompt), card)
    asked = await collect({**v1_request(prompt), "detokenize": True}, card)
    assert all(i["text"] is None for i in plain)
    assert "".join(i["text"] for i in asked) == "hello world"
    assert all(i["output_type"] == "text" for i in plain)
    assert all(set(i) <= {"token_ids", "text", "finish_reason", "completion_usage"} for i in asked)
    for items in (plain, asked):
        assert items[0]["completion_usage"]["prompt_tokens"] == len(prompt)
        assert items[-1]["completion_usage"]["completion_tokens"] == len(prompt)


def test_our_request_as_a_1x_worker_reads_it():
    """The frontend's one request: 1.x's fields in 1.x's places (the instance under ``routing``), ours beside
    them; what a 1.x worker would ignore and so answer differently is refused by name before it is sent."""
    from dynamo.llm.protocols.common import ImageInput, PreprocessedRequest, Routing, SamplingOptions
    from dynamo.llm.protocols.wire import PeerRequest

    req = PreprocessedRequest(token_ids=[1, 2], model="m", routing=Routing(backend_instance_id=7),
                              prefix_source={"address": "x"})
    body = PeerRequest(req).v1_body()
    assert body["routing"] == {"backend_instance_id": 7} and body["token_ids"] == [1, 2] and body["model"] == "m"
    assert list(body)[:10] == list(v1_request([1]))
    assert PeerRequest(req).body() == req.to_dict() == body
    with pytest.raises(RequestError, match="images"):
        PeerRequest(PreprocessedRequest(token_ids=[1], multi_modal_data=[ImageInput(b"x", 1, 0, 1)])).v1_body()
    with pytest.raises(RequestError, match="logit_bias"):
        PeerRequest(PreprocessedRequest(token_ids=[1],
                                        sampling_options=SamplingOptions(logit_bias={"3": 1.0}))).v1_body()
