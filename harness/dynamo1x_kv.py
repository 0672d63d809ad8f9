"""What the interop tier's tests share (tests/dynamo1x): prompts as token ids, the routing
decisions each side's frontend logs, and a fleet's environments on each discovery and event plane.

Both routers hash the token ids they are sent, so a prompt sent as ids is hashed exactly as written; 1.6.1's
frontend says where it routed in its log (``route request completed ... overlap_blocks=N ... worker_id=W``),
ours in its decision log (``DYN_ROUTER_LOG``, docs/routing.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

import dynamo
from harness.dynamo1x import d16_env
from harness.servers import EtcdServer, NatsServer

__all__ = ["BLOCK", "KV_PLANES", "SRC", "complete", "decisions", "fleet_envs", "plain_log", "prompts", "routed"]

SRC = str(Path(dynamo.__file__).resolve().parents[1])  # this checkout's code, in our child processes
BLOCK = 64  # the block size of 1.6.1's mocker and of ours, by default
KV_PLANES = ["file+zmq", "etcd+zmq", "etcd+nats"]
_ROUTED = re.compile(r"route request completed.*?overlap_blocks=(\d+).*?worker_id=(\d+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextmanager
def fleet_envs(name: str, store: Path) -> Iterator[tuple[dict[str, str], dict[str, str], Path | None]]:
    """(1.6.1's environment, ours, the file store or None) of one fleet on ``name``: ``file`` or ``etcd``
    discovery, with ``+zmq`` or ``+nats`` its event plane (KV_PLANES; ZMQ when not named)."""
    discovery, _, plane = name.partition("+")
    if discovery == "file":
        theirs = d16_env(store)
        yield theirs, dict(theirs, PYTHONPATH=SRC), store
        return
    with EtcdServer() as etcd, ExitStack() as stack:
        extra = {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": etcd.url, "DYN_EVENT_PLANE": plane or "zmq"}
        if plane == "nats":
            extra["NATS_SERVER"] = stack.enter_context(NatsServer()).url
        theirs = d16_env(None, extra)
        yield theirs, dict(theirs, PYTHONPATH=SRC), None


def plain_log(proc) -> str:
    """A 1.6.1 process's log without its colours."""
    return _ANSI.sub("", proc.stderr_text())


def routed(frontend) -> list[tuple[str, str]]:
    """(overlap_blocks, worker_id) of every request 1.6.1's frontend has routed, from its log."""
    return _ROUTED.findall(_ANSI.sub("", frontend.stderr_text()))


def decisions(path: Path) -> list[dict]:
    """Every line of our router's decision log so far."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prompts(n: int, first: int = 0) -> list[list[int]]:
    """``n`` prompts of 4 full blocks and 7 tokens, no two sharing a first block."""
    return [[1000 + (i * 31 + k * 997) % 3000 for i in range(4 * BLOCK + 7)] for k in range(first, first + n)]


def complete(url: str, prompt: list[int], model: str = "tiny-chat") -> dict:
    reply = httpx.post(f"{url}/v1/completions", timeout=30, json={"model": model, "prompt": prompt, "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    return reply.json()
