"""``dynamo serve``: start-up to the first answer, and the cost of one ``depends`` hop.

Starts examples/hello_world (Frontend -> Middle -> Backend, each its own process, on the
zero-infrastructure default in a fresh file store) and measures:

* start-up: from spawning ``dynamo serve`` to the first ``POST /generate`` answered;
* per hop: sequential requests from this process straight to ``dyn://inference.Backend.generate``
  and to ``dyn://inference.Middle.generate`` (which makes one ``depends`` call to Backend per request);
  the difference of the medians is what a ``depends`` call adds (one process boundary, both ways).

    PYTHONPATH=src .venv/bin/python -m benchmarks.serve_hops [--requests 500]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.machine import describe

ROOT = Path(__file__).resolve().parents[1]


def first_answer(port: int, proc: subprocess.Popen, timeout: float = 120) -> float:
    start = time.monotonic()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=b'{"text": "test"}',
                                 headers={"Content-Type": "application/json"})
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit("dynamo serve exited before answering")
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.read().decode() == "Frontend: Middle: Backend: test-mid-back":
                    return time.monotonic() - start
        except OSError:
            time.sleep(0.02)
    raise SystemExit("no answer")


async def latencies(endpoint: str, n: int) -> list[float]:
    from dynamo.runtime import DistributedRuntime

    rt = await DistributedRuntime.connect()
    try:
        ns, comp, ep = endpoint.split(".")
        client = await rt.namespace(ns).component(comp).endpoint(ep).client()
        await client.wait_for_instances(30)
        out = []
        for i in range(n + 20):
            t = time.perf_counter()
            async for _ in client.round_robin({"text": f"t{i}"}):
                pass
            if i >= 20:  # the first ones open connections
                out.append(time.perf_counter() - t)
        return out
    finally:
        await rt.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=500)
    args = p.parse_args()
    store = tempfile.mkdtemp(prefix="serve_hops")
    env = {**os.environ, "DYN_FILE_KV": store, "ETCD_ENDPOINTS": "", "NATS_SERVER": "", "DYN_LOG": "warn"}
    os.environ.update({k: env[k] for k in ("DYN_FILE_KV", "ETCD_ENDPOINTS", "NATS_SERVER", "DYN_LOG")})
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(x) for x in env.get("PYTHONPATH", "").split(os.pathsep) if x)
    port = 3999
    proc = subprocess.Popen([sys.executable, "-m", "dynamo.sdk.cli", "serve", "hello_world:Frontend", "-f", "config.yaml",
                             f"--Frontend.port={port}"], cwd=ROOT / "examples" / "hello_world", env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        startup = first_answer(port, proc)
        backend = asyncio.run(latencies("inference.Backend.generate", args.requests))
        middle = asyncio.run(latencies("inference.Middle.generate", args.requests))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    b, m = statistics.median(backend) * 1e3, statistics.median(middle) * 1e3
    m_ = describe()
    print(f"machine: {m_.get('cpu_model', '?')}, {m_['cpus']} cpus, load {m_['loadavg_at_start']}, rev {m_['git_rev']}")
    print(f"start-up to the first answer: {startup:.2f} s")
    print(f"direct dyn:// to Backend: median {b:.3f} ms; to Middle (+1 depends hop): median {m:.3f} ms; "
          f"one hop adds {m - b:.3f} ms ({args.requests} sequential requests each)")


if __name__ == "__main__":
    main()
