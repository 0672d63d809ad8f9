"""``GET /debug/memory``: what a frontend holds, for finding what grows under load.  Off unless
``DYN_DEBUG_MEMORY`` is set (``1``: structure sizes and object counts; ``tracemalloc``: also allocation
traces, which slow a process about 2x, so only for a hunt).

Answers JSON: ``rss_mb``; ``structures`` (dynamo.bounds: every structure that lives across requests, by
name, with its size); ``objects`` (live objects by type, the 60 most numerous, after a full collection
unless ``gc=0``) and ``objects_total``; with ``top=N`` and tracemalloc on, the N source lines whose
allocations grew most since the previous call (the first call takes the baseline).  benchmarks/soak.py
records it at the end of warm-up and at the end; the memory test reads ``structures`` and
``objects_total``.
"""

from __future__ import annotations

import gc
import os
import tracemalloc
from collections import Counter
from typing import Any

from aiohttp import web

from dynamo.bounds import sizes

ENV = "DYN_DEBUG_MEMORY"


def enabled() -> str:
    return os.environ.get(ENV, "").strip().lower()


class DebugMemoryRoute:
    def __init__(self) -> None:
        self.mode = enabled()
        self.previous: tracemalloc.Snapshot | None = None
        if self.mode == "tracemalloc" and not tracemalloc.is_tracing():
            tracemalloc.start(8)

    def install(self, router: web.UrlDispatcher) -> None:
        if self.mode and self.mode not in ("0", "false", "no"):
            router.add_get("/debug/memory", self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        if request.query.get("gc", "1") != "0":
            gc.collect()
        objects = gc.get_objects()
        counts = Counter(type(o).__qualname__ for o in objects)
        total = len(objects)
        del objects
        body: dict[str, Any] = {
            "rss_mb": _rss_mb(),
            "structures": sizes(),
            "objects_total": total,
            "objects": dict(counts.most_common(60)),
        }
        top = int(request.query.get("top", "0"))
        if tracemalloc.is_tracing():
            snap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)])
            body["traced_mb"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 2)
            if self.previous is not None and top > 0:
                body["top"] = [_stat(s) for s in snap.compare_to(self.previous, "traceback")[:top]]
            self.previous = snap
        return web.json_response(body)


def _stat(stat: tracemalloc.StatisticDiff) -> dict[str, Any]:
    return {"size_diff_kb": round(stat.size_diff / 1024, 1), "count_diff": stat.count_diff,
            "size_kb": round(stat.size / 1024, 1),
            "where": [f"{f.filename.rsplit('/src/', 1)[-1]}:{f.lineno}" for f in stat.traceback]}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0
