"""The mocker's disaggregation simulation: prefill-only workers answer a ticket, decode workers import it
(no prefill computed, the prefill's first token first), unusable tickets mean a local prefill."""

from dynamo.engines.mocker import MockerEngine
from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import PreprocessedRequest, StopConditions

FAST = {"speedup_ratio": 10000.0, "block_size": 4, "num_gpu_blocks": 2048}


def request(tokens, max_tokens=None, **kw):
    return PreprocessedRequest(token_ids=list(tokens), stop_conditions=StopConditions(max_tokens=max_tokens), **kw)


async def collect(engine, req):
    return [item async for item in engine.generate(req, Context())]


async def test_prefill_then_decode():
    pre = MockerEngine(FAST, vocab_size=40, special_ids={0}, seed=1, mode="prefill")
    dec = MockerEngine(FAST, vocab_size=40, special_ids={0}, seed=2, mode="decode")
    await pre.start()
    await dec.start()
    try:
        prompt = list(range(3, 40)) * 54  # 1998 tokens: a simulated prefill of about 180 ms
        (out,) = await collect(pre, request(prompt, max_tokens=50))  # prefill workers answer one token
        ticket = out.disaggregated_params
        assert out.finish_reason == "length" and ticket["n_tokens"] == len(prompt)
        assert ticket["size"] == len(prompt) * 131072 and ticket["first_token"] == out.token_ids[0]
        items = await collect(dec, request(prompt, max_tokens=5, disaggregated_params=ticket))
        toks = [t for it in items for t in it.token_ids]
        assert len(toks) == 5 and toks[0] == ticket["first_token"] and dec.imported == 1
        # no prefill is simulated on the decode worker: one step of decode time (< 65 ms in the model),
        # where a local prefill of this prompt is modelled at about 180 ms
        fresh = MockerEngine(FAST, vocab_size=40, special_ids={0}, seed=3, mode="decode")
        await fresh.start()
        try:
            await collect(fresh, request(prompt, max_tokens=1, disaggregated_params=ticket))
            assert fresh.schedulers[0].simulated_ms < 65
            await collect(fresh, request(prompt[::-1], max_tokens=1))
            assert fresh.schedulers[0].simulated_ms > 150
        finally:
            await fresh.close()
        # a ticket for another prompt is not used: local prefill
        items = await collect(dec, request(prompt[:-1], max_tokens=2, disaggregated_params=ticket))
        assert dec.imported == 1 and len([t for it in items for t in it.token_ids]) == 2
    finally:
        await pre.close()
        await dec.close()
