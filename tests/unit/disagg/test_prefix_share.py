"""Workers lending cached prefixes: the query and answer on the wire, and what a fetch does when the
holder has nothing, lies, stalls, is gone, or is a stranger."""

import asyncio
import os
import struct

import pytest

from dynamo.disagg.prefix_share import PrefixShareServer, PrefixSharingEngine, fetch_prefix
from dynamo.disagg.transfer import TransferError
from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest

CACHE = list(range(100, 400))  # what the holder has cached: 300 tokens
STATE = os.urandom(300_000)


async def holder_export(tokens: list[int]) -> tuple[int, int, bytes] | None:
    shared = 0
    while shared < min(len(tokens), len(CACHE)) and tokens[shared] == CACHE[shared]:
        shared += 1
    return (len(CACHE), shared, STATE) if shared >= 16 else None


async def _server(export=holder_export, **kw) -> PrefixShareServer:
    srv = PrefixShareServer(export, chunk=8192, **kw)
    await srv.start()
    return srv


async def test_a_fetch_gets_the_state_and_how_much_of_it_is_shared():
    srv = await _server()
    try:
        prompt = CACHE[:200] + [7, 8, 9]
        got = await fetch_prefix(srv.address, prompt)
        assert (got.n_state, got.n_shared, got.data) == (300, 200, STATE)
        with pytest.raises(TransferError, match="no longer holds"):  # nothing shared: a clear miss
            await fetch_prefix(srv.address, [1, 2, 3] * 20)
        assert (srv.served, srv.missed) == (1, 1)
    finally:
        await srv.close()


async def test_a_holder_claiming_more_than_was_asked_is_not_believed():
    async def liar(tokens):
        return (10, 50, b"x" * 100)  # 50 shared tokens of a 10-token state

    srv = await _server(liar)
    try:
        with pytest.raises(TransferError, match="claims 50 shared tokens"):
            await fetch_prefix(srv.address, list(range(60)))
    finally:
        await srv.close()


async def test_a_stalled_holder_costs_the_timeout_and_no_more():
    stalled = asyncio.Event()

    async def stuck(tokens):
        stalled.set()
        await asyncio.sleep(30)

    srv = await _server(stuck)
    try:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(TransferError, match="timed out"):
            await fetch_prefix(srv.address, CACHE, timeout=0.3)
        assert stalled.is_set() and asyncio.get_running_loop().time() - t0 < 5
    finally:
        await srv.close()


async def test_a_gone_holder_is_a_transfer_error():
    srv = await _server()
    address = srv.address
    await srv.close()
    with pytest.raises(TransferError, match="failed"):
        await fetch_prefix(address, CACHE, timeout=2)


async def test_garbage_and_huge_claims_do_not_reach_the_engine():
    asked: list[int] = []

    async def export(tokens):
        asked.append(len(tokens))
        return None

    srv = await _server(export)
    try:
        host, _, port = srv.address.rpartition(":")
        for junk in (b"GET / HTTP/1.1\r\n\r\n", b"DKVQ" + struct.pack(">I", 1 << 30), b"DKVQ\x00\x00"):
            r, w = await asyncio.open_connection(host, int(port))
            w.write(junk)
            await w.drain()
            w.write_eof()
            assert await asyncio.wait_for(r.read(), 5) == b""  # dropped without an answer
            w.close()
        assert asked == []
        with pytest.raises(TransferError, match="no longer holds"):
            await fetch_prefix(srv.address, CACHE[:20])
        assert asked == [20]
    finally:
        await srv.close()


async def test_with_a_fleet_secret_only_members_get_a_state():
    from dynamo.runtime.fleet_auth import FleetAuth

    member, stranger = FleetAuth(b"the fleet's secret for KV prefixes"), FleetAuth(b"another fleet's secret!!")
    asked: list[int] = []

    async def export(tokens):
        asked.append(len(tokens))
        return await holder_export(tokens)

    srv = await _server(export, auth=member)
    try:
        for auth in (stranger, None):
            with pytest.raises(TransferError):
                await fetch_prefix(srv.address, CACHE, timeout=5, auth=auth)
        assert asked == []  # a stranger's query never reached the engine
        assert (await fetch_prefix(srv.address, CACHE, auth=member)).data == STATE
    finally:
        await srv.close()


class _Engine:
    """A core engine that records what it was given: a prefix state, or none."""

    kind = "core"

    def __init__(self) -> None:
        self.given: list[object] = []

    async def export_prefix(self, tokens):
        return await holder_export(tokens)

    keeping = False

    def keep_states_to_lend(self):
        self.keeping = True

    async def generate(self, request, context, prefix_state=None):
        self.given.append(await asyncio.wrap_future(prefix_state) if prefix_state is not None else None)
        yield EngineOutput(token_ids=[1], finish_reason="length")


async def test_the_engine_gets_the_state_or_computes_the_prompt_itself():
    lender = PrefixSharingEngine(_Engine())
    borrower = PrefixSharingEngine(_Engine(), timeout=2)
    await lender.start()
    await borrower.start()
    try:
        assert borrower.runtime_config["kv_prefix_share"] == borrower.server.address
        assert lender.engine.keeping  # a lending engine keeps what it may lend (the llama.cpp one: finished turns)

        async def run(source):
            r = PreprocessedRequest(token_ids=CACHE[:64] + [1, 2], prefix_source=source)
            return [o async for o in borrower.generate(r, Context())]

        await run({"address": lender.server.address, "tokens": 64})
        state = borrower.engine.given[-1]
        assert state is not None and (state.n_shared, state.data) == (64, STATE)
        # the router's count (complete blocks) is no limit: the holder lends all it shares of the prompt
        await run({"address": lender.server.address, "tokens": 32})
        assert borrower.engine.given[-1].n_shared == 64
        for bad in ({"address": "127.0.0.1:1", "tokens": 64}, {"tokens": "many"}, None):
            await run(bad)
            assert borrower.engine.given[-1] is None  # answered all the same, from its own prefill
        assert (borrower.fetched, borrower.failed) == (2, 1)
    finally:
        await lender.close()
        await borrower.close()
