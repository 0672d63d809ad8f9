"""An outside orchestrator for ``dynamo-planner --environment virtual``: it carries out the planner's
decisions by starting and stopping ``dynamo-run`` worker processes on this machine.

This is the pattern for any orchestrator (a cluster scheduler, a cloud autoscaler): wait for the planner's
next decision, make the fleet that size, and acknowledge it, which lets the planner decide again::

    client = VirtualConnectorClient(runtime, namespace)
    while True:
        decision = await client.wait()          # the next decision not yet carried out
        ...start or stop workers until the counts match...
        await client.complete(decision)         # acknowledged: the planner may write the next one

A worker counts once it is registered in discovery (its instance key under ``instances/<namespace>/
<component>/``), so the acknowledgement means "the fleet serves at that size".  Scaling down sends the
newest worker SIGTERM: a ``dynamo-run`` worker revokes its lease (the frontends stop routing to it),
finishes what it runs and exits.  On Ctrl-C (or SIGTERM) the orchestrator stops the workers it started.

Run it next to etcd, NATS, a frontend and the planner::

    dynamo-planner --environment virtual --namespace dynamo --adjustment-interval 10 --itl 40 ...
    python examples/planner_virtual_orchestrator.py --namespace dynamo \\
        --decode-cmd "dynamo-run in=dyn://dynamo.backend.generate out=mocker Qwen/Qwen3-0.6B"

``--prefill-cmd`` (with the planner's ``--prefill-component``) for a disaggregated fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dynamo.errors import UserError
from dynamo.planner.virtual_connector import PlannerDecision, VirtualConnectorClient, registered_workers
from dynamo.runtime.distributed import connect_runtime

log = logging.getLogger("orchestrator")

READY_TIMEOUT_S = 120.0  # a worker that is not registered by then is reported; the decision waits on
STOP_TIMEOUT_S = 60.0  # a worker still draining after this long is killed


@dataclass
class Pool:
    """One kind of worker: how to start one, and the ones running."""

    name: str
    component: str
    cmd: list[str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


class Orchestrator:
    def __init__(self, runtime: object, namespace: str, pools: list[Pool], log_dir: Path) -> None:
        self.client = VirtualConnectorClient(runtime, namespace)
        self.store = self.client.store
        self.namespace = namespace
        self.pools = {p.name: p for p in pools}
        self.log_dir = log_dir

    def start_worker(self, pool: Pool) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"{pool.name}-{int(time.time() * 1000)}.log"
        with path.open("ab") as out:
            proc = subprocess.Popen(pool.cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        pool.procs.append(proc)
        log.info("started %s worker pid %d (log %s)", pool.name, proc.pid, path)

    async def stop_worker(self, pool: Pool) -> None:
        proc = pool.procs.pop()  # the newest
        log.info("stopping %s worker pid %d (SIGTERM: it drains and exits)", pool.name, proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("%s worker pid %d still running after %.0f s; killing it", pool.name, proc.pid,
                        STOP_TIMEOUT_S)
            proc.kill()
            await asyncio.to_thread(proc.wait)

    async def settle(self, pool: Pool, want: int) -> None:
        """Replace workers that died, start or stop workers until ``want`` run, then wait until ``want``
        are registered."""
        alive = []
        for proc in pool.procs:
            if proc.poll() is None:
                alive.append(proc)
            else:
                log.warning("%s worker pid %d exited (status %s)", pool.name, proc.pid, proc.returncode)
        pool.procs = alive
        while len(pool.procs) < want:
            self.start_worker(pool)
        while len(pool.procs) > want:
            await self.stop_worker(pool)
        deadline = time.monotonic() + READY_TIMEOUT_S
        warned = False
        while await registered_workers(self.store, self.namespace, pool.component) != want:
            if time.monotonic() > deadline and not warned:
                log.warning("%s: %d worker(s) wanted, %d registered after %.0f s; still waiting", pool.name,
                            want, await registered_workers(self.store, self.namespace, pool.component),
                            READY_TIMEOUT_S)
                warned = True
            await asyncio.sleep(0.2)

    async def carry_out(self, decision: PlannerDecision) -> None:
        log.info("decision %d: %d prefill, %d decode worker(s)", decision.decision_id,
                 decision.num_prefill_workers, decision.num_decode_workers)
        wanted = {"prefill": decision.num_prefill_workers, "decode": decision.num_decode_workers}
        for name, want in wanted.items():
            pool = self.pools.get(name)
            if pool is None:
                if want:
                    log.warning("decision %d asks for %d %s worker(s) but no --%s-cmd was given", decision.decision_id,
                                want, name, name)
                continue
            await self.settle(pool, want)
        await self.client.complete(decision)
        log.info("decision %d carried out", decision.decision_id)

    async def run(self, stop: asyncio.Event) -> None:
        current = await self.client.get()
        if current is not None:  # an orchestrator that starts again makes the fleet the current decision's
            await self.carry_out(current)
        while not stop.is_set():
            waiting = asyncio.ensure_future(self.client.wait())
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                waiting.cancel()
                break
            stopping.cancel()
            await self.carry_out(waiting.result())

    async def shutdown(self) -> None:
        for pool in self.pools.values():
            while pool.procs:
                await self.stop_worker(pool)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--namespace", default="dynamo")
    p.add_argument("--decode-cmd", required=True, help="the command of one decode (or aggregated) worker")
    p.add_argument("--prefill-cmd", default=None, help="the command of one prefill worker")
    p.add_argument("--decode-component", default="backend", help="the decode workers' component (default backend)")
    p.add_argument("--prefill-component", default="prefill", help="the prefill workers' component (default prefill)")
    p.add_argument("--log-dir", type=Path, default=Path("orchestrator-logs"))
    return p.parse_args(argv)


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pools = [Pool("decode", args.decode_component, shlex.split(args.decode_cmd))]
    if args.prefill_cmd:
        pools.append(Pool("prefill", args.prefill_component, shlex.split(args.prefill_cmd)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        runtime = await connect_runtime()
    except UserError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    orchestrator = Orchestrator(runtime, args.namespace, pools, args.log_dir)
    log.info("orchestrating namespace %s for the planner (pid %d)", args.namespace, os.getpid())
    try:
        await orchestrator.run(stop)
    finally:
        await orchestrator.shutdown()
        await runtime.close()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(asyncio.run(main()))
