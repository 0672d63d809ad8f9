"""RemoteCoreEngine migration rewrites only the migrated request: n > 1 choices share structs.

A stand-in client (no runtime) whose first stream dies after two tokens, as a killed worker's does; the
frontend resends prompt + generated tokens with fewer tokens to go.  The real kill -9 path is covered by
tests/chaos and tests/e2e/test_distributed.py; this pins the bookkeeping that the fan-out relies on.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dynamo.frontend.remote import RemoteCoreEngine, SimpleRouter
from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import PreprocessedRequest, ResponseParsing, StopConditions
from dynamo.runtime.errors import StreamIncompleteError


class _Stream:
    def __init__(self, items: list[dict[str, Any]], die: bool):
        self.items, self.die, self.instance_id = items, die, 1

    async def start(self) -> None:
        pass

    def __aiter__(self) -> "_Stream":
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.items:
            return self.items.pop(0)
        if self.die:
            raise StreamIncompleteError()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        pass


class _Client:
    """First stream: two tokens, then the worker 'dies'; later streams finish."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def instance_ids(self) -> list[int]:
        return [1, 2]

    def round_robin(self, body: dict[str, Any], context: Any = None) -> _Stream:
        self.bodies.append(body)
        if len(self.bodies) == 1:
            return _Stream([{"token_ids": [7]}, {"token_ids": [8]}], die=True)
        return _Stream([{"token_ids": [9], "finish_reason": "length"}], die=False)


async def test_migration_leaves_a_sibling_choice_untouched() -> None:
    base = PreprocessedRequest(token_ids=[1, 2, 3], stop_conditions=StopConditions(max_tokens=10),
                               parsing=ResponseParsing())
    sibling = msgspec.structs.replace(base)  # how the fan-out makes choice 2: the same nested structs
    client = _Client()
    engine = RemoteCoreEngine(client, SimpleRouter("round-robin"), migration_limit=1)
    tokens = [t async for out in engine.generate(base, Context("r-0")) for t in out.token_ids]

    assert tokens == [7, 8, 9]
    resent = client.bodies[1]
    assert resent["token_ids"] == [1, 2, 3, 7, 8]
    assert resent["stop_conditions"]["max_tokens"] == 8
    # the other choice still asks for its full budget and has no resumed tokens
    assert sibling.stop_conditions.max_tokens == 10
    assert sibling.parsing is not None and not sibling.parsing.resumed_tokens
