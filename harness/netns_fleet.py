"""A dynamo fleet on the hosts of a :class:`harness.netns.Topology`, and what its tests ask of it.

:class:`Fleet` starts workers and frontends on the topology's hosts with the settings docs/runtime.md
tells a user to set on each machine (``DYN_TCP_RPC_HOST``: the host's own address; ``ETCD_ENDPOINTS``
and ``NATS_SERVER``: the infra hosts'); everything it started is killed at the end. The rest are the
questions tests/netns asks a frontend from the test process's leg of the switch: which instances it
lists, a chat, a streamed chat counted token by token, a metric, and how many file descriptors it holds
(``/proc/PID/fd``: namespaces of the network share the machine's ``/proc``).
"""

from __future__ import annotations

import json
import os
import random
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from harness.fleet import WORKER_LOG, sse_events
from harness.netns import Topology
from harness.proc import DynamoRun, DynamoWorker, cli_command

__all__ = ["NATS_CONFIG", "NATS_STALE_S", "Fleet", "StreamResult", "chat", "instances", "metric", "open_fds", "prompt", "sees", "stream_chat"]

# nats-server drops a client that answered none of its pings for about 3 x 2 s (its default: 2 x 2 min), so
# a test can cut a worker from NATS for longer than that: the server forgets it and it must reconnect
NATS_STALE_S = 6
NATS_CONFIG = 'ping_interval: "2s"\nping_max: 2\n'


class Fleet:
    """Workers and frontends on a topology's hosts; :meth:`stop` kills them all (the fixture calls it)."""

    def __init__(self, topology: Topology, env: dict[str, str], model: Path, args_file: Path) -> None:
        self.topology = topology
        self.env = env
        self.model = model
        self.args_file = args_file
        self.started: list[DynamoWorker | DynamoRun] = []

    def host_env(self, host: str, **extra: str) -> dict[str, str]:
        """What every process on ``host`` gets: the infra's addresses and ``DYN_TCP_RPC_HOST``."""
        return {**self.env, "DYN_TCP_RPC_HOST": self.topology[host].address, **extra}

    def worker(self, host: str, endpoint: str, model: str, *flags: str, env: dict[str, str] | None = None,
               engine: tuple[str, ...] | None = None, wait: bool = True,
               startup_timeout: float = 30.0) -> DynamoWorker:
        """A worker on ``host``: the mocker on the fleet's tiny model unless ``engine`` says otherwise
        (``("out=llamacpp", gguf)``)."""
        out = engine if engine is not None else (
            "out=mocker", str(self.model), "--extra-engine-args", str(self.args_file))
        w = DynamoWorker(f"in=dyn://{endpoint}", *out, "--model-name", model, *flags,
                         env=env if env is not None else self.host_env(host, **WORKER_LOG),
                         command=[*self.topology[host].prefix, *cli_command()], startup_timeout=startup_timeout)
        self.started.append(w)
        return w.start(wait=wait)

    def frontend(self, *flags: str, host: str = "fe", env: dict[str, str] | None = None) -> DynamoRun:
        fe = DynamoRun("out=dyn", *flags, env=env if env is not None else self.host_env(host),
                       host=self.topology[host].address, command_prefix=self.topology[host].prefix)
        self.started.append(fe)
        return fe.start()

    def stop(self) -> None:
        for p in reversed(self.started):
            p.kill()


def prompt(words: int = 120) -> str:
    """A prompt no earlier request of the run shares a prefix with (the KV router sees it as new)."""
    rng = random.Random(uuid.uuid4().int)
    return " ".join(rng.choice(["alpha", "bravo", "charlie", "delta", "echo", "fox", "golf", "hotel"])
                    for _ in range(words))


def instances(fe: DynamoRun, endpoint: str) -> list[int]:
    """The instance ids of ``dyn://endpoint`` the frontend's ``/health`` lists (a duplicate shows twice)."""
    doc = httpx.get(fe.base_url + "/health", timeout=5).json()
    return [i["instance_id"] for i in doc.get("instances", []) if i["endpoint"] == f"dyn://{endpoint}"]


def sees(fe: DynamoRun, endpoint: str, workers: list[DynamoWorker]) -> bool:
    return set(instances(fe, endpoint)) >= {w.instance_id for w in workers}


def chat(fe: DynamoRun, model: str, text: str, rid: str, max_tokens: int = 8, **extra: Any) -> httpx.Response:
    return httpx.post(fe.api_url + "/chat/completions", headers={"x-request-id": rid}, timeout=60,
                      json={"model": model, "messages": [{"role": "user", "content": text}],
                            "max_tokens": max_tokens, **extra})


def metric(url: str, name: str) -> float:
    """The sum of series ``name`` over its labels at a ``/metrics`` URL."""
    total = 0.0
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def open_fds(proc: DynamoRun | DynamoWorker) -> int:
    """How many file descriptors the process holds now (sockets, pipes, files, the loop's own)."""
    return len(os.listdir(f"/proc/{proc.pid}/fd"))


@dataclass
class StreamResult:
    rid: str
    status: int = 0
    tokens: int = 0  # the usage's completion tokens
    done: int = 0  # how many [DONE] lines
    errors: list[Any] | None = None  # error events in the stream
    failure: str | None = None  # what went wrong on the client's side (a timeout, a reset)

    @property
    def whole(self) -> bool:
        """Answered once, completely, without an error."""
        return self.status == 200 and self.done == 1 and not self.errors and self.failure is None


def stream_chat(fe: DynamoRun, model: str, text: str, rid: str, max_tokens: int, read_timeout: float,
                on_chunk: Callable[[int], None] | None = None) -> StreamResult:
    """A streamed chat of exactly ``max_tokens`` tokens, counted; ``on_chunk(n)`` after the n-th content
    chunk (a test cuts a cable there). ``read_timeout`` is the longest silence the client accepts."""
    result = StreamResult(rid, errors=[])
    body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "stream_options": {"include_usage": True}}
    chunks = 0
    try:
        with httpx.stream("POST", fe.api_url + "/chat/completions", json=body, headers={"x-request-id": rid},
                          timeout=httpx.Timeout(30, read=read_timeout)) as resp:
            result.status = resp.status_code
            for data in sse_events(resp):
                if data == "[DONE]":
                    result.done += 1
                    continue
                event = json.loads(data)
                if "error" in event:
                    result.errors.append(event)  # type: ignore[union-attr]
                if event.get("usage"):
                    result.tokens = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0]["delta"].get("content"):
                    chunks += 1
                    if on_chunk is not None:
                        on_chunk(chunks)
    except httpx.HTTPError as exc:
        result.failure = f"{type(exc).__name__}: {exc}"
    return result

