"""A mixed fleet and our fleet secret, with real processes: the secret stays between our own processes.

A worker of ours started with ``DYN_FLEET_SECRET`` is still listed by Dynamo 1.6.1's frontend (its records are
1.x's), but the frontend's requests are refused at the worker's port, in one line that names 1.x, and the
client gets an error, not a hang; and its events are CURVE (1.x's event plane has no authentication): the
worker's channels are announced in ``v1/event_channels`` as any worker's, but the 1.6.1 KV router's
subscriptions fail their handshake at the worker's publisher, which says so in one line.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from harness.dynamo1x import d16_env, d16_frontend
from harness.dynamo1x_kv import SRC
from harness.proc import DynamoWorker
from harness.wait import wait_until

SECRET = "a-fleet-secret-of-ours-0123456789"


def test_our_worker_with_a_fleet_secret_refuses_a_d16_frontend_in_one_line(tiny_chat_5k: Path, store: Path) -> None:
    theirs = d16_env(store)
    ours = dict(theirs, PYTHONPATH=SRC, DYN_FLEET_SECRET=SECRET)
    worker = DynamoWorker("in=dyn://sec.backend.generate", "out=mocker", str(tiny_chat_5k), "--model-name",
                          "tiny-chat", env=ours, startup_timeout=60).start()
    try:
        with d16_frontend(theirs, "--router-mode", "kv", model="tiny-chat") as frontend:
            started = time.monotonic()
            reply = httpx.post(f"{frontend.url}/v1/completions", timeout=60,
                               json={"model": "tiny-chat", "prompt": "hello", "max_tokens": 2})
            assert reply.status_code >= 500, reply.text
            assert time.monotonic() - started < 30
            named = "a request without the fleet-secret handshake"
            wait_until(lambda: named in worker.stderr_text(), 10, "the worker's refusal line")
            lines = [line for line in worker.stderr_text().splitlines() if named in line]
            assert "refused a connection from 127.0.0.1:" in lines[0] and "DYN_FLEET_SECRET" in lines[0], lines
            wait_until(lambda: "events: refused a subscriber on tcp://127.0.0.1:" in worker.stderr_text(), 30,
                       "the worker's publisher refusing the 1.6.1 router's subscription")
        assert any((store / "v1" / "event_channels").rglob("*")), "the worker's channels are announced"
    finally:
        worker.stop()
