"""The worker side of disaggregation with a stand-in engine and the real TCP transfer: outputs equal to
aggregated serving, and every failure of the hand-over ends in a local prefill, never an error."""

import hashlib

import pytest

from dynamo.disagg.worker import DisaggWorkerEngine, StateIO
from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest, StopConditions


class StateEngine:
    """Tokens are a function of the whole sequence; the 'state' is the prompt, so a wrong state shows."""

    kind = "core"

    def __init__(self):
        self.prefilled = 0

    @staticmethod
    def state_of(prompt):
        return b"STATE" + b"".join(t.to_bytes(4, "little") for t in prompt) * 50

    async def generate(self, request, context, state_io: StateIO | None = None):
        seq = list(request.token_ids)
        io = state_io or StateIO()
        if io.state is not None:
            io.imported = io.state == self.state_of(seq)
        if not io.imported:
            self.prefilled += 1
        for i in range(request.stop_conditions.max_tokens):
            tok = io.first_token if (i == 0 and io.imported) else int(hashlib.sha256(repr(seq).encode()).hexdigest()[:4], 16)
            if i == 0 and io.export:
                io.state = self.state_of(seq)
            seq.append(tok)
            yield EngineOutput(token_ids=[tok], finish_reason="length" if i + 1 == request.stop_conditions.max_tokens else None)


def req(prompt, n, params=None):
    return PreprocessedRequest(token_ids=list(prompt), stop_conditions=StopConditions(max_tokens=n),
                               disaggregated_params=params)


async def run(engine, r):
    return [t for out in [o async for o in engine.generate(r, Context())] for t in out.token_ids]


@pytest.fixture
async def pair():
    pre = DisaggWorkerEngine(StateEngine(), "prefill", host="127.0.0.1")
    dec = DisaggWorkerEngine(StateEngine(), "decode", pull_timeout=5)
    await pre.start()
    yield pre, dec
    await pre.close()


async def _ticket(pre, prompt):
    outs = [o async for o in pre.generate(req(prompt, 50), Context())]
    assert len(outs) == 1 and outs[0].finish_reason == "length"
    return outs[0].disaggregated_params


async def test_prefill_then_decode_equals_aggregated(pair):
    pre, dec = pair
    prompt = list(range(100, 160))
    ticket = await _ticket(pre, prompt)
    assert ticket["n_tokens"] == 60 and len(pre.store) == 1
    got = await run(dec, req(prompt, 8, ticket))
    assert got == await run(StateEngine(), req(prompt, 8))
    assert dec.imported == 1 and dec.engine.prefilled == 0 and len(pre.store) == 0


@pytest.mark.parametrize("damage", ["digest", "size", "key", "prompt", "server_gone", "bad_state"])
async def test_failed_hand_over_prefills_locally(pair, damage):
    pre, dec = pair
    prompt = list(range(200, 240))
    ticket = await _ticket(pre, prompt)
    r = req(prompt, 5, ticket)
    if damage == "digest":
        ticket["sha256"] = hashlib.sha256(b"x").hexdigest()
    elif damage == "size":
        ticket["size"] -= 1
    elif damage == "key":
        ticket["key"] = "0" * 24
    elif damage == "prompt":  # a migrated request: prompt plus generated tokens
        r = req(prompt + [7], 5, ticket)
    elif damage == "server_gone":
        await pre.close()
    elif damage == "bad_state":  # intact transfer, but the engine refuses the state
        pre.store._items[ticket["key"]] = (1e18, b"junk", hashlib.sha256(b"junk").hexdigest())
        ticket["size"], ticket["sha256"] = 4, hashlib.sha256(b"junk").hexdigest()
    got = await run(dec, r)
    assert got == await run(StateEngine(), req(r.token_ids, 5))
    assert dec.imported == 0 and dec.fallbacks == 1 and dec.engine.prefilled == 1
