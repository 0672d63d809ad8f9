"""The frontend's rule for where a prompt is prefilled, and its fallback to local prefill."""

import pytest

from dynamo.disagg.mode import DisaggregationMode
from dynamo.disagg.plan import DisaggStats, decide, serve
from dynamo.disagg.transfer import Ticket
from dynamo.errors import UserError

T = Ticket("127.0.0.1:1", "k", 10, "00" * 32, 300, 5)


def test_decide():
    assert not decide(2000, 0, 0, 128).remote  # no prefill worker
    assert not decide(100, 0, 1, 128).remote  # short prompt
    assert decide(2000, 0, 1, 128).remote
    r = decide(2000, 1900, 1, 128)  # mostly cached on the decode worker
    assert not r.remote and "cached" in r.reason
    assert decide(2000, 1800, 1, 128).remote
    assert decide(129, 0, 1, 128).remote and not decide(128, 0, 1, 128).remote


async def _collect(agen):
    return [x async for x in agen]


async def test_serve_remote_then_decode_with_the_ticket():
    seen = []

    async def prefill(req):
        return T.to_dict()

    async def decode(req, ticket):
        seen.append(ticket)
        yield "tok"

    st = DisaggStats()
    out = await _collect(serve("r", prompt_tokens=300, decode_cached_tokens=0, prefill_workers=1, prefill=prefill,
                               decode=decode, stats=st))
    assert out == ["tok"] and seen == [T] and st.remote == 1


@pytest.mark.parametrize("failure", ["raise", "bad_ticket"])
async def test_failed_prefill_falls_back_to_local(failure):
    seen = []

    async def prefill(req):
        if failure == "raise":
            raise ConnectionError("prefill worker gone")
        return {"key": "only"}

    async def decode(req, ticket):
        seen.append(ticket)
        yield "tok"

    st = DisaggStats()
    out = await _collect(serve("r", prompt_tokens=300, decode_cached_tokens=0, prefill_workers=1, prefill=prefill,
                               decode=decode, stats=st))
    assert out == ["tok"] and seen == [None] and st.fallbacks == 1 and st.local == 1


async def test_short_prompt_never_calls_prefill():
    async def prefill(req):
        raise AssertionError("must not be called")

    async def decode(req, ticket):
        yield ticket

    assert await _collect(serve("r", prompt_tokens=10, decode_cached_tokens=0, prefill_workers=2, prefill=prefill,
                                decode=decode)) == [None]


def test_mode_parse():
    assert DisaggregationMode.parse(None) is DisaggregationMode.AGG
    assert DisaggregationMode.parse("Prefill") is DisaggregationMode.PREFILL
    with pytest.raises(UserError, match="disaggregation-mode"):
        DisaggregationMode.parse("both")
