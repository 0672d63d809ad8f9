"""``dynamo serve`` as a test starts it: ``python -m dynamo.sdk.cli serve ...`` (the ``dynamo`` console
script's code) in the background, on the zero-infrastructure default with a file store of its own, ready
once every expected replica logged its ready line (through the supervisor, prefixed ``[Service:replica]``).
stdout (the LLM frontend's served-model table) goes to the same log as stderr."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Sequence

import httpx
import pytest

from harness.fleet import NO_INFRA_ENV
from harness.proc import DynamoWorker
from harness.wait import wait_until

SERVE = [sys.executable, "-m", "dynamo.sdk.cli", "serve"]
STARTED = re.compile(r"dynamo serve: started (\w+):(\d+) \(pid (\d+)\)")


def env_for(tmp_path: Path) -> dict[str, str]:
    return {**NO_INFRA_ENV, "DYN_FILE_KV": str(tmp_path / "store"), "DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT": "10"}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Graph(DynamoWorker):
    """``dynamo serve`` in the background; :meth:`wait_replicas` until the replicas are ready."""

    stdout_to_log = True

    def __init__(self, *args: str, cwd: Path, env: dict[str, str], port: int, host: str = "127.0.0.1",
                 prefix: Sequence[str] = ()) -> None:
        """``host``: where the entry service's routes are reached; ``prefix``: before the command (a network
        namespace's ``ip netns exec``)."""
        self.http_port = port
        self.http_host = host
        super().__init__(*args, command=[*prefix, *SERVE], ready=None, cwd=cwd, env=env)

    def ready_count(self, service: str, replica: int) -> int:
        return len(re.findall(rf"service {service} replica {replica} ready", self.stderr_text()))

    def wait_replicas(self, want: dict[str, int], timeout: float = 60) -> None:
        def missing() -> list[str]:
            # the replica's own "ready" line can reach the log before the supervisor's "started ... pid"
            pids = self.pids()
            return [f"{s}:{i}" for s, n in want.items() for i in range(n)
                    if not (self.ready_count(s, i) >= 1 and f"{s}:{i}" in pids)]

        def ok() -> bool:
            assert self.running, f"dynamo serve exited:\n{self.stderr_text()}"
            return not missing()
        try:
            wait_until(ok, timeout, f"replicas {want} ready")
        except pytest.fail.Exception as e:  # say which replicas, and what the graph logged
            tail = "\n".join(self.stderr_text().splitlines()[-40:])
            pytest.fail(f"{e}: not ready {missing()}; the graph's log ends:\n{tail}")

    def pids(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for m in STARTED.finditer(self.stderr_text()):
            out.setdefault(f"{m.group(1)}:{m.group(2)}", []).append(int(m.group(3)))
        return out

    def post(self, route: str, body: dict, timeout: float = 30) -> httpx.Response:
        return httpx.post(f"http://{self.http_host}:{self.http_port}/{route}", json=body, timeout=timeout)


class GraphStarter:
    """A test fixture's body: ``start(MODULE:Service, args..., cwd=, want=)`` starts a graph on a free port
    (``--<Service>.port``) and waits for its replicas; :meth:`stop_all` (or leaving its ``with`` block)
    stops every graph it started."""

    def __init__(self, tmp_path: Path, default_cwd: Path) -> None:
        self.tmp_path = tmp_path
        self.default_cwd = default_cwd
        self.started: list[Graph] = []

    def __call__(self, *args: str, cwd: Path | None = None, want: dict[str, int] | None = None,
                 timeout: float = 60, env: dict[str, str] | None = None) -> Graph:
        """``env``: more variables for the graph's processes (the tracing exporter's, say)."""
        from harness.proc import free_port

        port = free_port()
        service = args[0].split(":")[1]
        g = Graph(*args, f"--{service}.port={port}", cwd=cwd or self.default_cwd,
                  env={**env_for(self.tmp_path), **(env or {})},
                  port=port)
        g.start()
        self.started.append(g)
        g.wait_replicas(want or {service: 1}, timeout)
        return g

    def stop_all(self) -> None:
        for g in self.started:
            g.stop(timeout=60)

    def __enter__(self) -> "GraphStarter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
