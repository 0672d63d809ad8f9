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
arrived whole counts. The worker's ack says it will answer (:data:`~.transport.ACK_PROBE`): Dynamo 1.x
workers know no such probe (1.6.1 acks it as taken and sends nothing back, observed), and for them the
ack alone counts, as a plain ping's would.
"""

from __future__ import annotations

import asyncio
import uuid

from .request_plane import RequestPlane
from .response_streams import Receiver
from .transport import ACK_PROBE, PING, StreamState, encode_request


async def reachable(requests: RequestPlane, receiver: Receiver | None, subject: str, instance_id: int,
                    bound: float) -> bool:
    """True when the instance at ``subject`` acked a probe and its empty answer came back, each within
    ``bound`` seconds; False when it refused. Raises what the request plane raises (timeout, no
    responders, NATS away): all "not yet"."""
    if receiver is None:
        return not await requests.send(subject, PING, bound)
    state = StreamState(f"probe-{uuid.uuid4().hex[:12]}", instance_id)
    conn = receiver.register(state)
    try:
        ack = await requests.send(subject, encode_request(state.request_id, conn, b"", probe=True), bound, state)
        if ack and ack != ACK_PROBE:
            return False  # refused: draining
        if not ack and not state.connected and not state.finished:
            return True  # taken, and no answer begun: a worker that knows no probes (a ping's answer)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound
        while not state.finished:  # the empty stream ends at once; anything else in it is not ours to read
            await asyncio.wait_for(state.new_waiter(), max(0.0, deadline - loop.time()))
        return state.error is None
    finally:
        if not state.finished:
            state.fail(TimeoutError())
        receiver.unregister(state)
