"""Garbage-collector probe for the benchmarks' server processes (not part of dynamo-run).

    PYTHONPATH=src:benchmarks/gcprobe .venv/bin/python -m benchmarks.dist_compare --only ours --scenarios b

Python imports ``sitecustomize`` at start-up from the path, so every Python process started with this
PYTHONPATH (frontend, worker, the benchmark itself) times each collector pass through ``gc.callbacks``
and, at exit, writes one line per generation (passes, total and longest pause, objects collected) to
benchmarks/results/gc-<pid>.txt.  This is how the frontend's full-collection stalls were found
(docs/performance.md, "Why the distributed path stalled").
"""

import atexit
import gc
import os
import sys
import time

_start = [0.0]
_stats: dict[int, list[float]] = {}


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _start[0] = time.perf_counter()
        return
    took = time.perf_counter() - _start[0]
    s = _stats.setdefault(info["generation"], [0, 0.0, 0.0, 0])
    s[0] += 1
    s[1] += took
    s[2] = max(s[2], took)
    s[3] += info.get("collected", 0)


def _report() -> None:
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", f"gc-{os.getpid()}.txt")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(" ".join(sys.argv) + f"  threshold={gc.get_threshold()}\n")
        for gen, (n, total, longest, collected) in sorted(_stats.items()):
            f.write(f"gen{gen}: passes={n} total={total * 1000:.1f}ms longest={longest * 1000:.2f}ms "
                    f"collected={collected}\n")


gc.callbacks.append(_on_gc)
atexit.register(_report)
