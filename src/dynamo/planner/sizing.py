"""The sizing math: predicted load and one worker's capacity -> how many prefill and decode workers.

Pure functions and two small state holders (:class:`OnlineCapacity`, :class:`Hysteresis`), no I/O, so all
of it is unit tested without servers.

**Per-worker capacity at the targets.**  A prefill worker meets the TTFT target while the prompt tokens
sent to it per second stay under some rate (``prefill_tok_s``); a decode worker meets the ITL target while
it runs at most some number of streams at once (``decode_concurrency``).  Both come from a profile of one
worker (``dynamo-planner profile``) or, without one, are learned online (:class:`OnlineCapacity`).

**Workers needed** for a predicted request rate ``r`` (req/s), mean input length ``isl`` and output
length ``osl``:

* prefill: ``ceil(r * isl / prefill_tok_s)``
* decode: a request decodes for ``osl * itl_target`` seconds, so by Little's law ``r * osl * itl`` streams
  run at once; ``ceil(r * osl * itl / decode_concurrency)``
* aggregated (one pool doing both): a worker's time is shared, so the fractions add up:
  ``ceil(r * isl / prefill_tok_s + r * osl * itl / decode_concurrency)``

then clamped: each pool at least ``--min-endpoint``, the pools together at most ``--max-workers`` (shared
in proportion to what each asked for).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Load:
    """Load over one adjustment interval (observed, or predicted for the next one)."""

    request_rate: float  # requests per second
    isl: float  # mean input tokens per request
    osl: float  # mean output tokens per request


class WorkerCapacity(Protocol):
    """What one worker sustains while meeting a latency target; ``None`` when not known (yet)."""

    def prefill_tok_s(self, ttft_ms: float, isl: float) -> float | None: ...

    def decode_concurrency(self, itl_ms: float) -> float | None: ...


def prefill_demand(load: Load, capacity_tok_s: float) -> float:
    """Prefill workers' worth of work (fractional)."""
    return load.request_rate * load.isl / capacity_tok_s if capacity_tok_s > 0 else 0.0


def decode_streams(load: Load, itl_ms: float) -> float:
    """Streams decoding at once when every token comes at the ITL target (Little's law)."""
    return load.request_rate * load.osl * itl_ms / 1000.0


def decode_demand(load: Load, itl_ms: float, capacity_streams: float) -> float:
    """Decode workers' worth of work (fractional)."""
    return decode_streams(load, itl_ms) / capacity_streams if capacity_streams > 0 else 0.0


def workers_for(demand: float) -> int:
    """Whole workers for a fractional demand (a hair over an integer is noise, not one more worker)."""
    return max(0, math.ceil(demand - 1e-6))


def clamp_pools(prefill: int, decode: int, min_endpoint: int, max_workers: int | None,
                disaggregated: bool) -> tuple[int, int]:
    """Each pool in use at least ``min_endpoint``; together at most ``max_workers``.

    Over the budget, the pools are cut in proportion to what each asked for, never below the minimum.  An
    aggregated fleet has no prefill pool (its count is 0).
    """
    if not disaggregated:
        decode = max(decode, min_endpoint)
        return 0, decode if max_workers is None else min(decode, max(max_workers, min_endpoint))
    prefill, decode = max(prefill, min_endpoint), max(decode, min_endpoint)
    if max_workers is None or prefill + decode <= max_workers:
        return prefill, decode
    budget = max(max_workers, 2 * min_endpoint)
    share = prefill / (prefill + decode)
    new_prefill = min(max(round(budget * share), min_endpoint), budget - min_endpoint)
    return new_prefill, budget - new_prefill


class OnlineCapacity:
    """A worker's capacity learned from live (load, latency) pairs, for a fleet without a profile.

    Each interval with traffic gives one pair per pool: prompt tokens per second per prefill worker against
    mean TTFT, and streams per decode worker against mean ITL.  From the recent pairs (``window``):

    * with at least three pairs whose loads differ by 10% or more, a least-squares line
      ``latency = a + b * load`` with ``b > 0`` gives the load at the target: ``(target - a) / b``;
    * otherwise (latency flat in the loads seen, or too few points) the highest load that met the target
      is a capacity proven in practice;
    * with neither, the capacity is unknown and the planner reacts to the latency instead
      (:func:`reactive_workers`).

    How fast: three intervals at different loads are enough for a line, so after the first change in load
    (a ramp, or the planner's own scale-up halving each worker's load) the capacity is known; it then
    follows the last ``window`` intervals, so a change in the workload (longer prompts) shows within that
    window.  A line fitted where latency is still flat overestimates capacity; the proven-load rule and the
    latency check in :func:`reactive_workers` catch the misses.
    """

    def __init__(self, window: int = 30) -> None:
        self.prefill: deque[tuple[float, float]] = deque(maxlen=window)
        self.decode: deque[tuple[float, float]] = deque(maxlen=window)

    def observe_prefill(self, tok_s_per_worker: float, ttft_ms: float) -> None:
        if tok_s_per_worker > 0 and ttft_ms > 0:
            self.prefill.append((tok_s_per_worker, ttft_ms))

    def observe_decode(self, streams_per_worker: float, itl_ms: float) -> None:
        if streams_per_worker > 0 and itl_ms > 0:
            self.decode.append((streams_per_worker, itl_ms))

    def prefill_tok_s(self, ttft_ms: float, isl: float) -> float | None:
        return load_at_target(self.prefill, ttft_ms)

    def decode_concurrency(self, itl_ms: float) -> float | None:
        return load_at_target(self.decode, itl_ms)


def load_at_target(pairs: "deque[tuple[float, float]] | list[tuple[float, float]]", target: float) -> float | None:
    """The load at which latency reaches ``target``, from (load, latency) pairs (see :class:`OnlineCapacity`)."""
    if not pairs:
        return None
    xs = [x for x, _ in pairs]
    ys = [y for _, y in pairs]
    n = len(xs)
    mean_x = sum(xs) / n
    if n >= 3 and (max(xs) - min(xs)) >= 0.1 * mean_x:
        mean_y = sum(ys) / n
        sxx = sum((x - mean_x) ** 2 for x in xs)
        sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
        slope = sxy / sxx
        if slope > 0:
            intercept = mean_y - slope * mean_x
            at_target = (target - intercept) / slope
            if at_target > 0:
                return at_target
    proven = [x for x, y in pairs if y <= target]
    return max(proven) if proven else None


def reactive_workers(current: int, observed_ms: float | None, target_ms: float) -> int:
    """Workers when capacity is unknown: over the target, grow in proportion (latency roughly follows load
    per worker), at least by one; at or under it, hold (scaling down needs a known capacity)."""
    if observed_ms is None or observed_ms <= target_ms:
        return current
    return max(current + 1, math.ceil(max(current, 1) * observed_ms / target_ms))


class Hysteresis:
    """Scale up at once, scale down only after ``down_after`` intervals in a row that all wanted fewer,
    and then only to the most any of them wanted, so one quiet interval does not shrink the fleet."""

    def __init__(self, down_after: int = 3) -> None:
        self.down_after = max(1, down_after)
        self.lower: list[int] = []

    def step(self, current: int, desired: int) -> int:
        if desired >= current:
            self.lower.clear()
            return desired
        self.lower.append(desired)
        if len(self.lower) < self.down_after:
            return current
        target = max(self.lower)
        self.lower.clear()
        return target
