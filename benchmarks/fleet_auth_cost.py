#!/usr/bin/env python3
"""What the fleet secret costs on the TCP request plane, measured where it acts, in one process on loopback.

    .venv/bin/python -m benchmarks.fleet_auth_cost [--rounds 5] [--connections 200] [--requests 5000] [--batch 100]

Why beside dist_compare: the secret adds one handshake per connection and nothing per request or token
(after the handshake the connection belongs to the plane's own protocol object, unchanged), so
tokens/s through a whole fleet moves by less than the noise of a shared 2-core machine. This measures
the two things that could move, alternating with and without the secret in every round (background load
hits both alike; which runs first alternates too), and prints the median and the spread (min-max) of each:

  handshake CPU   both sides' handshake computed in memory (HMACs, nonces), microseconds
  first request   a fresh client: connect (and handshake) + one request and its ack, milliseconds
  next requests   requests on an established connection, one at a time, microseconds each
  CPU per request the process's CPU time (client and worker are both in it) per request on an established
                  connection, microseconds
  interleaved     both fleets (with and without the secret) in one event loop, requests sent in batches of
                  --batch alternating between them, each side's CPU time summed: whatever the machine's
                  other load does, it does to both within milliseconds, so this ratio is the sharpest
                  measure of a per-request cost (by construction there is none)
  ZMQ event CPU   a KV event (two frames: subject, a --event-bytes payload) published and received over ZMQ
                  on loopback, plain and under CURVE (what the secret turns on), CPU microseconds of the
                  process (both sockets and libzmq's I/O threads are in it): unlike the TCP planes, CURVE
                  costs something per message, so this is the secret's one per-token cost (a worker
                  publishes an event per KV block it fills: one per block-size tokens of each sequence)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import zmq
from zmq.utils import z85

from dynamo.runtime.fleet_auth import DIALER, LISTENER, FleetAuth
from dynamo.runtime.tcp_request_plane import TcpRequestPlane

SECRET = b"fleet_auth_cost's secret, 32 chars"


def handshake_us(n: int) -> float:
    auth = FleetAuth(SECRET)
    start = time.process_time()
    for _ in range(n):
        d = auth.handshake(DIALER, "127.0.0.1:4000")
        li = auth.handshake(LISTENER, "127.0.0.1:4000")
        proof_l, _ = li.feed(d.hello)
        proof_d, _ = d.feed(li.hello + proof_l)
        li.feed(proof_d)
        assert d.done and li.done
    return (time.process_time() - start) / n * 1e6


async def ack(request) -> None:
    await request.respond(b"")


async def plane_round(auth: FleetAuth | None, connections: int, requests: int) -> tuple[float, float, float]:
    worker = TcpRequestPlane("127.0.0.1", auth=auth)
    address = (await worker.serve("bench", "gen", ack)).address
    try:
        start = time.perf_counter()
        for _ in range(connections):
            client = TcpRequestPlane(auth=auth)
            await client.send(address, b"x", 5)
            await client.close()
        first_ms = (time.perf_counter() - start) / connections * 1e3
        client = TcpRequestPlane(auth=auth)
        await client.send(address, b"x", 5)
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(requests):
            await client.send(address, b"x", 5)
        next_us = (time.perf_counter() - start) / requests * 1e6
        cpu_us = (time.process_time() - cpu) / requests * 1e6
        await client.close()
    finally:
        await worker.close()
    return first_ms, next_us, cpu_us


async def interleaved_round(requests: int, batch: int) -> dict[str, float]:
    """CPU microseconds per request on an established connection, with and without the secret, measured in
    alternating batches in one loop."""
    sides = {}
    for name, auth in (("no secret", None), ("secret", FleetAuth(SECRET))):
        worker = TcpRequestPlane("127.0.0.1", auth=auth)
        address = (await worker.serve("bench", "gen", ack)).address
        client = TcpRequestPlane(auth=auth)
        await client.send(address, b"x", 5)  # connected (and, with the secret, authenticated) before timing
        sides[name] = (worker, client, address)
    cpu = dict.fromkeys(sides, 0.0)
    try:
        names = list(sides)
        for i in range(requests // batch):
            for name in names if i % 2 == 0 else names[::-1]:
                _, client, address = sides[name]
                start = time.process_time()
                for _ in range(batch):
                    await client.send(address, b"x", 5)
                cpu[name] += time.process_time() - start
    finally:
        for worker, client, _ in sides.values():
            await client.close()
            await worker.close()
    return {name: total / (requests // batch * batch) * 1e6 for name, total in cpu.items()}


def event_us(curve: bool, n: int, size: int) -> float:
    """CPU microseconds per event published and received, plain or under CURVE (keys as the plane derives)."""
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        if curve:
            auth = FleetAuth(SECRET)
            server_secret = z85.encode(auth.derive("zmq curve publisher"))
            client_secret = z85.encode(auth.derive("zmq curve subscriber"))
            pub.curve_secretkey, pub.curve_publickey = server_secret, zmq.curve_public(server_secret)
            pub.curve_server = True
            sub.curve_secretkey, sub.curve_publickey = client_secret, zmq.curve_public(client_secret)
            sub.curve_serverkey = zmq.curve_public(server_secret)
        pub.setsockopt(zmq.SNDHWM, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        while True:  # until the handshake is done and a message gets through
            pub.send_multipart([b"warm\0", b""])
            if sub.poll(50):
                break
        while sub.poll(50):
            sub.recv_multipart()
        payload = os.urandom(size)
        start = time.process_time()
        for _ in range(n):
            pub.send_multipart([b"kv_events\0", payload])
        for _ in range(n):
            sub.recv_multipart()
        return (time.process_time() - start) / n * 1e6
    finally:
        pub.close(linger=0)
        sub.close(linger=0)
        ctx.term()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--connections", type=int, default=200)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=100, help="requests per batch in the interleaved measurement")
    ap.add_argument("--events", type=int, default=20000, help="ZMQ events per round and side")
    ap.add_argument("--event-bytes", type=int, default=200, help="a KV event's payload (a stored event of a "
                    "few blocks is 150-300 bytes of JSON)")
    args = ap.parse_args()
    hs = [handshake_us(2000) for _ in range(args.rounds)]
    print(f"handshake CPU, both sides: {spread(hs)} us")
    results: dict[str, list[tuple[float, float, float]]] = {"no secret": [], "secret": []}
    for i in range(args.rounds):
        order = [("no secret", None), ("secret", FleetAuth(SECRET))]
        for name, auth in order if i % 2 == 0 else order[::-1]:  # neither always runs second
            results[name].append(asyncio.run(plane_round(auth, args.connections, args.requests)))
    for name, runs in results.items():
        print(f"{name:>9}: first request on a new connection {spread([r[0] for r in runs])} ms; "
              f"next requests {spread([r[1] for r in runs])} us each, CPU {spread([r[2] for r in runs])} us each")
    pairs = list(zip(results["secret"], results["no secret"], strict=True))
    print(f"next requests, secret / no secret, per round: wall {spread([s[1] / n[1] for s, n in pairs])}, "
          f"CPU {spread([s[2] / n[2] for s, n in pairs])}")
    inter = [asyncio.run(interleaved_round(args.requests, args.batch)) for _ in range(args.rounds)]
    print(f"interleaved CPU per request: no secret {spread([r['no secret'] for r in inter])} us, secret "
          f"{spread([r['secret'] for r in inter])} us; secret / no secret per round "
          f"{spread([r['secret'] / r['no secret'] for r in inter])}")
    events = [(event_us(False, args.events, args.event_bytes), event_us(True, args.events, args.event_bytes))
              for _ in range(args.rounds)]
    print(f"ZMQ event CPU ({args.event_bytes}-byte payload, publisher and subscriber): plain "
          f"{spread([e[0] for e in events])} us, CURVE {spread([e[1] for e in events])} us; CURVE adds "
          f"{spread([e[1] - e[0] for e in events])} us per event")


if __name__ == "__main__":
    main()
