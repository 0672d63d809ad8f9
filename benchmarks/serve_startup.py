"""``dynamo serve graphs.agg:Frontend -f configs/agg.yaml``: start-up to the first chat completion.

For each start: a fresh file store, spawn ``dynamo serve`` in examples/llm (the Dynamo README's quick
start, on a free port), read its log as it comes, and poll ``POST /v1/chat/completions`` (non-streaming,
``max_tokens`` 1) until one is answered 200.  Besides the total, the times at which the log showed: the
Worker service ready (its process serves; the supervisor starts the Frontend on it), the worker's
engine serving the model (llama.cpp loaded), the frontend listing the model.  Printed per start, then
median [min-max] of each, and the load average before and after.

    PYTHONPATH=src .venv/bin/python -m benchmarks.serve_startup [--repeats 5] [--config configs/agg.yaml]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.machine import describe

ROOT = Path(__file__).resolve().parents[1]
LLM = ROOT / "examples" / "llm"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
MARKS = {  # phase -> a line of the log that ends it
    "worker service ready": "service Worker replica 0 ready",
    "engine serving": "worker dyn://dynamo.backend.generate serving",
    "frontend lists model": f"added model {MODEL}",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answered(port: int) -> bool:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status == 200
    except OSError:
        return False


def one_start(config: str, timeout: float = 180) -> dict[str, float]:
    port = free_port()
    with tempfile.TemporaryDirectory() as store:
        env = {**os.environ, "DYN_FILE_KV": store, "ETCD_ENDPOINTS": "", "NATS_SERVER": ""}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "dynamo.sdk.cli", "serve", "graphs.agg:Frontend", "-f", config,
                                 f"--Frontend.port={port}"], cwd=LLM, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        seen: dict[str, float] = {}

        def read() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                for phase, mark in MARKS.items():
                    if phase not in seen and mark in line:
                        seen[phase] = time.monotonic() - start

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            while not ("frontend lists model" in seen and answered(port)):
                if proc.poll() is not None:
                    raise SystemExit("dynamo serve exited before answering")
                if time.monotonic() - start > timeout:
                    raise SystemExit("no answer")
                time.sleep(0.02)
            seen["first answer"] = time.monotonic() - start
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            reader.join(5)
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--config", default="configs/agg.yaml", help="relative to examples/llm")
    args = p.parse_args()
    print(describe())
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    runs = []
    for i in range(args.repeats):
        run = one_start(args.config)
        runs.append(run)
        print(f"start {i + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in run.items()))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    for phase in [*MARKS, "first answer"]:
        values = [r[phase] for r in runs if phase in r]
        if values:
            print(f"{phase}: median {statistics.median(values):.2f}s [{min(values):.2f}-{max(values):.2f}] "
                  f"over {len(values)}")


if __name__ == "__main__":
    main()
