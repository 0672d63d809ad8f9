"""Scoring a replay: SLA attainment per 10 s window, worker-seconds, failed requests.

A window is the requests that *arrived* in it (by their trace time); it meets the SLA when its TTFT p90
and its ITL p90 are both at or under the targets and none of its requests failed.  Windows with no
request are not counted.  The planner's goal is relative to the static-maximum fleet: of the windows
that fleet meets, the planner must meet at least 90%, with at most 70% of its worker-seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from dynamo.planner.loadgen import RequestResult, percentile

WINDOW_S = 10.0


@dataclass
class Window:
    start_s: float
    requests: int = 0
    failed: int = 0
    ttft_p90_ms: float = math.nan
    itl_p90_ms: float = math.nan
    met: bool = False


@dataclass
class Score:
    fleet: str
    windows: list[Window]
    worker_seconds: float
    failed: int
    requests: int
    workers_over_time: list[tuple[float, int]] = field(default_factory=list)

    @property
    def attainment(self) -> float:
        counted = [w for w in self.windows if w.requests]
        return sum(w.met for w in counted) / len(counted) if counted else math.nan

    def met_set(self) -> set[int]:
        return {i for i, w in enumerate(self.windows) if w.requests and w.met}

    def to_json(self) -> dict:
        return {"fleet": self.fleet, "attainment": self.attainment, "worker_seconds": self.worker_seconds,
                "failed": self.failed, "requests": self.requests,
                "windows": [w.__dict__ for w in self.windows], "workers_over_time": self.workers_over_time}


def windows(results: Sequence[RequestResult], duration_s: float, ttft_ms: float, itl_ms: float,
            window_s: float = WINDOW_S) -> list[Window]:
    n = max(1, math.ceil(duration_s / window_s))
    out = [Window(i * window_s) for i in range(n)]
    groups: list[list[RequestResult]] = [[] for _ in range(n)]
    for r in results:
        groups[min(n - 1, int(r.sent_at // window_s))].append(r)
    for w, group in zip(out, groups, strict=True):
        w.requests = len(group)
        w.failed = sum(not r.ok for r in group)
        ttfts = [r.ttft_s * 1000 for r in group if r.ok and r.ttft_s is not None]
        itls = [r.itl_s * 1000 for r in group if r.ok and r.itl_s is not None]
        w.ttft_p90_ms = percentile(ttfts, 90)
        w.itl_p90_ms = percentile(itls, 90)
        w.met = bool(group) and w.failed == 0 and w.ttft_p90_ms <= ttft_ms and (not itls or w.itl_p90_ms <= itl_ms)
    return out


def worker_seconds(samples: Sequence[tuple[float, int]], duration_s: float) -> float:
    """The area under the sampled worker count over ``[0, duration_s]`` (each sample holds until the next)."""
    total = 0.0
    for (t, n), nxt in zip(samples, list(samples[1:]) + [(duration_s, 0)], strict=True):
        t0, t1 = max(0.0, t), min(duration_s, nxt[0])
        if t1 > t0:
            total += n * (t1 - t0)
    return total


def relative_goal(planner: Score, static_max: Score) -> dict:
    """The issue's goal: windows met (share of those static-max meets), worker-seconds (share), failures."""
    base = static_max.met_set()
    kept = len(base & planner.met_set()) / len(base) if base else math.nan
    share = planner.worker_seconds / static_max.worker_seconds if static_max.worker_seconds else math.nan
    return {"windows_met_of_static_max": kept, "worker_seconds_of_static_max": share,
            "failed": planner.failed, "goal_met": bool(kept >= 0.9 and share <= 0.7 and planner.failed == 0)}
