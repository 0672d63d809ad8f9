"""A process that tries to join a fleet with whatever ``DYN_FLEET_SECRET`` its environment gives it (the
fleet-secret tests run it as a stranger, and as a member to show the same code works with the right one).

    python fleet_peer.py ask <ns.comp.ep>
        asks every instance of the endpoint directly (its request-plane address from discovery) for a
        few tokens; prints {"instances": n, "tokens": t, "errors": [...]}
    python fleet_peer.py listen <ns.comp> <worker instance hex> <frontend api url> <model> <secret>...
        one runtime per secret ("-": none) subscribes to the component's KV events; once the first has
        finished its handshake with the worker's publisher and every other has failed its own, a chat
        request through the frontend makes the worker publish; prints the events each runtime read:
        {"read": [n per secret], "failures": [messages]}

Discovery is the file store of ``DYN_FILE_KV``; the planes are the default rule's (TCP and ZMQ).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Any

import httpx

from dynamo.runtime import DistributedRuntime
from dynamo.runtime.config import RuntimeSettings
from dynamo.runtime.v1_event_wire import EVENT_CHANNELS, EVENT_SOURCES, EndpointScope, parse_channel

REQUEST = {"token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "stop_conditions": {"max_tokens": 3}}


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def ask(endpoint: str) -> dict[str, Any]:
    ns, comp, ep = endpoint.split(".")
    rt = await DistributedRuntime.connect()
    out: dict[str, Any] = {"instances": 0, "tokens": 0, "errors": []}
    try:
        client = await rt.namespace(ns).component(comp).endpoint(ep).client()
        ids = await client.wait_for_instances(10)
        out["instances"] = len(ids)
        for iid in ids:
            try:
                async for item in client.direct(REQUEST, iid):
                    out["tokens"] += len(item.get("token_ids") or [])
            except Exception as exc:  # noqa: BLE001 - what the stranger gets is the result
                out["errors"].append(f"{type(exc).__name__}: {exc}")
    finally:
        await rt.close()
    return out


async def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)


async def listen(component: str, worker_hex: str, url: str, model: str, secrets: list[str]) -> dict[str, Any]:
    recorder = Recorder()
    logging.getLogger("dynamo.runtime.fleet_auth").addHandler(recorder)
    logging.getLogger("dynamo.runtime.fleet_auth").setLevel(logging.DEBUG)
    ns, comp = component.split(".")
    scope = EndpointScope(ns, comp, "generate")
    runtimes: list[DistributedRuntime] = []
    read: list[int] = []
    try:
        for i, secret in enumerate(secrets):
            settings = RuntimeSettings.from_env()
            settings.fleet_secret = None if secret == "-" else secret.encode()
            rt = await DistributedRuntime.connect(settings)
            runtimes.append(rt)
            read.append(0)

            def count(_env: Any, i: int = i) -> None:
                read[i] += 1

            await rt.event_plane().subscribe(scope, "kv-events", count)
        # the worker's kv-events publisher: its EventSource record names it
        store = runtimes[0].discovery()
        sources = [json.loads(kv.value)["metadata"] for kv in
                   await store.get_prefix(scope.key_prefix(EVENT_SOURCES, "kv-events"))]
        publisher_id = next(m["publisher_id"] for m in sources if m["worker"]["worker_id"] == int(worker_hex, 16))
        channel = await store.get(scope.key(EVENT_CHANNELS, "kv-events", publisher_id))
        publisher = parse_channel(channel.value).address
        # the member has met the worker's publisher, every stranger has been turned away by it
        await wait_for(lambda: runtimes[0].event_plane().reconnects > 0, 20, "the member's handshake")
        await wait_for(lambda: sum(f"cannot subscribe to {publisher}" in m for m in recorder.messages)
                       >= len(secrets) - 1, 20, "every stranger's failed handshake")
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(url + "/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "events " * 64}], "max_tokens": 2})
            r.raise_for_status()
        await wait_for(lambda: read[0] > 0, 20, "the member's first KV event")
        return {"read": read, "failures": [m for m in recorder.messages if publisher in m]}
    finally:
        for rt in runtimes:
            await rt.close()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    mode, *args = sys.argv[1:]
    result = asyncio.run(ask(args[0]) if mode == "ask" else listen(args[0], args[1], args[2], args[3], args[4:]))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
