"""vLLM disaggregation, the request-level hand-over (no vLLM needed): the prefill request asks vLLM's
connector to keep its blocks for a remote decode and runs one token; the ``kv_transfer_params`` vLLM
returns ride to the decode request untouched; anything malformed means local prefill."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dynamo.disagg.handover import EngineParams, parse_hand_over
from dynamo.disagg.mode import DisaggregationMode
from dynamo.disagg.plan import DisaggStats, serve
from dynamo.disagg.transfer import Ticket, TransferError
from dynamo.engines.vllm import engine as vl
from dynamo.errors import UserError
from dynamo.llm.model_card import ModelCard
from dynamo.llm.protocols.common import PreprocessedRequest, StopConditions
from dynamo.run_config import RunConfig

NIXL = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
        "remote_block_ids": [3, 4], "remote_host": "10.0.0.2", "remote_port": 5600}


def request(**kw) -> PreprocessedRequest:
    return PreprocessedRequest(token_ids=list(range(300)), stop_conditions=StopConditions(max_tokens=50), **kw)


def test_a_prefill_request_runs_one_token_and_asks_for_a_remote_decode():
    params = vl.sampling_params(request())
    vl.disagg_params(DisaggregationMode.PREFILL, request(), params)
    assert params["max_tokens"] == 1 and params["min_tokens"] == 1
    assert params["extra_args"] == {"kv_transfer_params": {"do_remote_decode": True}}


def test_a_decode_request_carries_the_prefill_answer_back_to_vllm():
    params = vl.sampling_params(request())
    vl.disagg_params(DisaggregationMode.DECODE, request(disaggregated_params={"kv_transfer_params": NIXL}), params)
    assert params["extra_args"] == {"kv_transfer_params": NIXL} and params["max_tokens"] == 50
    plain = vl.sampling_params(request())
    vl.disagg_params(DisaggregationMode.DECODE, request(), plain)  # no hand-over: local prefill, as agg
    assert "extra_args" not in plain


def test_the_prefill_output_carries_vllms_kv_transfer_params():
    choice = SimpleNamespace(index=0, token_ids=[7], finish_reason="length", stop_reason=None, logprobs=None,
                             cumulative_logprob=None)
    out = SimpleNamespace(outputs=[choice], finished=True, kv_transfer_params=NIXL)
    assert vl.convert_output(out, [2], kv_transfer=True).disaggregated_params == {"kv_transfer_params": NIXL}
    assert vl.convert_output(out, [2]).disaggregated_params is None  # agg/decode workers hand nothing over
    out.kv_transfer_params = None  # a connector keyed by content: nothing to carry, the decode finds it
    assert vl.convert_output(out, [2], kv_transfer=True).disaggregated_params == {"kv_transfer_params": {}}
    params = vl.sampling_params(request())
    vl.disagg_params(DisaggregationMode.DECODE, request(disaggregated_params={"kv_transfer_params": {}}), params)
    assert "extra_args" not in params


def test_disaggregation_without_a_kv_connector_is_a_clear_error(tmp_path):
    card = ModelCard(display_name="m", path=tmp_path)
    with pytest.raises(UserError, match="kv_transfer_config"):
        vl.VllmEngine(RunConfig(output="vllm", disaggregation_mode="prefill"), card, {})
    engine = vl.VllmEngine(RunConfig(output="vllm", disaggregation_mode="decode"), card,
                           {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"}})
    assert engine.mode is DisaggregationMode.DECODE


def test_hand_overs_are_tickets_or_engine_params():
    t = Ticket("127.0.0.1:1", "k", 10, "00" * 32, 300, 5)
    assert parse_hand_over(t.to_dict()) == t
    assert parse_hand_over({"kv_transfer_params": NIXL}) == EngineParams(NIXL)
    assert parse_hand_over({"kv_transfer_params": None}) == EngineParams({})
    for bad in ({"kv_transfer_params": [1]}, {"key": "x"}, "x"):
        with pytest.raises(TransferError):
            parse_hand_over(bad)


async def test_the_frontend_passes_engine_params_through_to_the_decode_request():
    seen = []

    async def prefill(req):
        return {"kv_transfer_params": NIXL}

    async def decode(req, handed):
        seen.append(handed.to_dict() if handed is not None else None)
        yield "tok"

    st = DisaggStats()
    out = [x async for x in serve("r", prompt_tokens=300, decode_cached_tokens=0, prefill_workers=1,
                                  prefill=prefill, decode=decode, stats=st)]
    assert out == ["tok"] and seen == [{"kv_transfer_params": NIXL}] and st.remote == 1
