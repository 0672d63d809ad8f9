"""Micro-benchmark of the response transports: TCP call-home (multiplexed, or a connection per stream)
vs NATS inbox.

    .venv/bin/python tests/integration/runtime/bench_transport.py [--streams 64 256] [--items 200] [--uvloop]
                                                                 [--transports tcp tcp-per-stream nats]

Starts its own etcd and nats-server, one worker subprocess serving a handler that yields small items
(``{"token_ids": [i]}``), and drives it from this process with N concurrent streams of M items, once per
transport. By default the handler awaits between items (``asyncio.sleep(0)``), as an engine does, so
each item leaves in its own event-loop turn; ``--burst`` lets it yield without awaiting. Prints items/s
(all items of all streams divided by wall time), the median time to the first item, and the CPU time
per item of this process (the client) and of the worker over the measured rounds (less sensitive to a
busy machine than the rates). Bounded: every
run is a fixed number of requests against loopback servers it started itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from dynamo.runtime import DistributedRuntime  # noqa: E402
from dynamo.runtime.config import RuntimeSettings  # noqa: E402

NS, COMP, EP = "bench", "worker", "generate"


async def run_worker(burst: bool) -> None:
    runtime = await DistributedRuntime.connect()

    async def handler(request):
        n = request["n"]
        for i in range(n):
            if not burst:
                await asyncio.sleep(0)
            yield {"token_ids": [i]}

    endpoint = runtime.namespace(NS).component(COMP).endpoint(EP)
    await endpoint.component.create_service()
    print("ready", flush=True)
    try:
        await endpoint.serve_endpoint(handler)
    finally:
        await runtime.close()


def _cpu_s(pid: int | None = None) -> float:
    """utime + stime of a process (this one when None), from /proc."""
    fields = Path(f"/proc/{pid or os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(transport: str, streams: int, items: int, rounds: int,
                worker_pid: int) -> tuple[float, float, float, float]:
    settings = RuntimeSettings.from_env()
    settings.response_transport = "tcp" if transport == "tcp-per-stream" else transport
    settings.tcp_mux = transport != "tcp-per-stream"
    runtime = await DistributedRuntime.connect(settings)
    try:
        client = await runtime.namespace(NS).component(COMP).endpoint(EP).client()
        await client.wait_for_instances(10)
        ttfts: list[float] = []

        async def one() -> int:
            start = time.perf_counter()
            count = 0
            async for _ in client.round_robin({"n": items}):
                if count == 0:
                    ttfts.append(time.perf_counter() - start)
                count += 1
            return count

        await asyncio.gather(*[one() for _ in range(min(streams, 16))])  # warm-up
        best = 0.0
        ttfts.clear()
        cpu0 = (_cpu_s(), _cpu_s(worker_pid))
        for _ in range(rounds):
            t0 = time.perf_counter()
            counts = await asyncio.gather(*[one() for _ in range(streams)])
            elapsed = time.perf_counter() - t0
            assert sum(counts) == streams * items, counts
            best = max(best, streams * items / elapsed)
        total = rounds * streams * items
        client_us = (_cpu_s() - cpu0[0]) / total * 1e6
        worker_us = (_cpu_s(worker_pid) - cpu0[1]) / total * 1e6
        await client.close()
        return best, statistics.median(ttfts), client_us, worker_us
    finally:
        await runtime.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=["tcp", "tcp-per-stream", "nats"],
                        choices=["tcp", "tcp-per-stream", "nats"])
    parser.add_argument("--burst", action="store_true")
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop
        uvloop.install()
    if args.worker:
        asyncio.run(run_worker(args.burst))
        return

    from harness.servers import EtcdServer, NatsServer

    with EtcdServer() as etcd, NatsServer() as nats:
        env = dict(os.environ, ETCD_ENDPOINTS=etcd.url, NATS_SERVER=nats.url)
        os.environ.update(ETCD_ENDPOINTS=etcd.url, NATS_SERVER=nats.url)
        cmd = [sys.executable, __file__, "--worker"] + (["--burst"] if args.burst else []) + (
            ["--uvloop"] if args.uvloop else [])
        worker = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
            loop_name = "uvloop" if args.uvloop else "asyncio"
            mode = "burst" if args.burst else "await-per-item"
            print(f"# {os.cpu_count()} cores, {loop_name}, handler {mode}, {args.items} items/stream")
            print(f"{'transport':<16}{'streams':>8}{'items/s':>12}{'median ttft ms':>16}"
                  f"{'client CPU us/item':>20}{'worker CPU us/item':>20}")
            for streams in args.streams:
                for transport in args.transports:
                    rate, ttft, client_us, worker_us = asyncio.run(
                        drive(transport, streams, args.items, args.rounds, worker.pid))
                    print(f"{transport:<16}{streams:>8}{rate:>12,.0f}{ttft * 1000:>16.1f}{client_us:>20.2f}"
                          f"{worker_us:>20.2f}", flush=True)
        finally:
            worker.terminate()
            worker.wait(30)


if __name__ == "__main__":
    main()
