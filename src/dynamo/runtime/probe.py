"""Is an instance that was set aside reachable again, on every path a request takes?

A request takes two paths: out over the request plane (NATS, or a TCP connection to the worker) and back
over the response path (the worker's call-home to this process's listener). They can fail apart: a link
cut between a frontend's host and a worker's host leaves NATS delivering requests and acks both ways
(both hosts reach NATS's) while the worker's response streams vanish. A plain ping over the request plane
then says "answers" at once, the instance is routed to again, and every request sent to it waits out the
call-home bound before moving on (measured across network namespaces: a ping answered 0.25 s after the
cut, and each of the next requests waited 15 s).

So the probe is a request like any other, marked :data:`~.transport.PROBE_KEY` and with no body: the
worker acks it and answers with an empty stream over the response path, and only an empty stream that
arrived whole counts. Dynamo 1.x workers know no such probe: they get the plain ping.
"""

from __future__ import annotations

import asyncio
import uuid

from .request_plane import RequestPlane
from .response_streams import Receiver
from .transport import PING, StreamState, encode_request
from .v1_wire import is_v1_address


async def reachable(requests: RequestPlane, receiver: Receiver | None, subject: str, instance_id: int,
                    bound: float) -> bool:
    """True when the instance at ``subject`` acked a probe and its empty answer came back, each within
    ``bound`` seconds; False when it refused. Raises what the request plane raises (timeout, no
    responders, NATS away): all "not yet"."""
    if receiver is None or is_v1_address(subject):
        return not await requests.send(subject, PING, bound)
    state = StreamState(f"probe-{uuid.uuid4().hex[:12]}", instance_id)
    conn = receiver.register(state)
    try:
        if await requests.send(subject, encode_request(state.request_id, conn, b"", probe=True), bound, state):
            return False  # refused: draining
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound
        while not state.finished:  # the empty stream ends at once; anything else in it is not ours to read
            await asyncio.wait_for(state.new_waiter(), max(0.0, deadline - loop.time()))
        return state.error is None
    finally:
        if not state.finished:
            state.fail(TimeoutError())
        receiver.unregister(state)
