"""A real worker process for tests, written the way users write one (``@dynamo_worker``).

    python worker_app.py <namespace> [--graceful-timeout S]

Serves ``<namespace>.backend.generate`` with a handler that yields ``{"i", "pid"}`` items, ``n`` of them,
sleeping ``delay`` seconds before each. Prints ``READY <instance hex>`` once registered (then
``system=<port>`` when its status server runs: the port it bound, ``DYN_SYSTEM_PORT=0`` letting the
kernel pick) and ``EXITED`` when the worker function returns.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))

from dynamo.runtime import DistributedRuntime, dynamo_worker  # noqa: E402


@dynamo_worker(static=False)
async def worker(runtime: DistributedRuntime, namespace: str) -> None:
    component = runtime.namespace(namespace).component("backend")
    await component.create_service()
    endpoint = component.endpoint("generate")

    async def generate(request):
        for i in range(request.get("n", 1)):
            await asyncio.sleep(request.get("delay", 0))
            yield {"i": i, "pid": os.getpid()}

    ready = asyncio.Event()

    async def announce() -> None:
        await ready.wait()
        system = f" system={runtime.system.port}" if runtime.system is not None else ""
        print(f"READY {endpoint.lease_id():x}{system}", flush=True)

    announcer = asyncio.create_task(announce())
    await endpoint.serve_endpoint(generate, ready=ready)
    announcer.cancel()
    print("EXITED", flush=True)


if __name__ == "__main__":
    asyncio.run(worker(sys.argv[1]))
