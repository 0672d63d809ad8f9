"""The servers benchmarks/llamacpp_compare.py compares: their names, command lines and readiness (a
``/v1/models`` that answers), and waiting for a quiet machine before a run."""
from __future__ import annotations

import http.client
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks import echo_compare, loadgen

OURS = "ours"
THEIRS = "llama_cpp.server"
ANCHOR = "llama-server"


class Server(echo_compare.Server):
    """echo_compare's subprocess handling; readiness = /v1/models answers 200 (any model)."""

    model_id: str = ""

    def wait_ready(self, timeout: float = 180.0) -> dict[str, Any]:  # type: ignore[override]
        deadline = self.t_spawn + timeout
        while time.perf_counter() < deadline:
            self._check_alive()
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/v1/models")
                resp = c.getresponse()
                body = resp.read()
                c.close()
                if resp.status == 200:
                    t_ready = time.perf_counter()
                    self.model_id = json.loads(body)["data"][0]["id"]
                    return {"startup_s": t_ready - self.t_spawn,
                            "startup_cpu_s": sum(loadgen.tree_cpu_seconds(self.proc.pid).values()),
                            "rss_ready_mib": loadgen.tree_rss_kib(self.proc.pid) / 1024}
            except (OSError, ValueError, KeyError, IndexError):
                pass
            time.sleep(0.02)
        raise echo_compare.ServerError(f"{self.name} did not answer /v1/models in {timeout}s; "
                                       f"log:\n{self.log_tail()}")


def ours_cmd(gguf: Path, extra: str) -> Callable[[int, str], list[str]]:
    exe = Path(sys.executable).parent / "dynamo-run"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "dynamo.cli"]
    return lambda port, _model: base + ["in=http", "out=llamacpp", str(gguf), "--http-host", "127.0.0.1",
                                        "--http-port", str(port)] + shlex.split(extra)


def anchor_cmd(exe: Path, gguf: Path, slots: int, threads: int, ctx_total: int,
               extra: str) -> Callable[[int, str], list[str]]:
    """llama.cpp's C++ server with ours' slots and KV cells: ``-np`` slots sharing ``-c`` cells (a cache
    stream per slot, as ours has: llama-server unifies the cache only when -np is left to choose)."""
    return lambda port, _model: [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                                 "-np", str(slots), "-t", str(threads), "-c", str(ctx_total)] + shlex.split(extra)


def theirs_cmd(gguf: Path, extra: str) -> Callable[[int, str], list[str]]:
    # --interrupt_requests False: by default a new request cuts the stream in progress short (the client
    # sees the connection end without the last chunk); queueing them is the behaviour to compare with
    return lambda port, _model: [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
                                 "--host", "127.0.0.1", "--port", str(port),
                                 "--interrupt_requests", "False"] + shlex.split(extra)
