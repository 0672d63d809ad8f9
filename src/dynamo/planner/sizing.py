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

**Latency** is the p90 over the interval (the frontends' histograms), both for the check against the
targets and for the (load, latency) pairs the online capacity learns from: sizing for the mean would leave
one request in ten over the target.

**The workers' own load** (:func:`worker_load_floor`) is a floor under the decode (or aggregated) pool:
requests queued inside the workers mean every one of them is at its slot or KV limit, which the latency
shows only once the queue has grown; a KV cache nearly full means pre-emptions are next.  Either gives
more workers at once; a fleet that queues or is over 70% KV is never shrunk.

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


Sample = tuple[float, float, float]  # (load per worker, mean latency ms, p90 latency ms)


class OnlineCapacity:
    """A worker's capacity learned from live (load, latency) samples, for a fleet without a profile.

    Each interval with traffic gives one sample per pool: prompt tokens per second per prefill worker against
    TTFT, and streams per decode worker against ITL, each latency as its mean and its p90.  Why both: the
    mean is exact (the histograms' sums) but the target is on the p90, and the p90 comes from the
    frontend's buckets (Dynamo's: ITL 25 ms, 50 ms, 100 ms...), where a tight distribution anywhere inside
    a bucket reads as 90% of the way up it, so a curve fitted to p90s is a staircase.  So, over the recent
    samples (``window``):

    * the curve's shape from the means: with two samples or more whose loads differ by 10% or more, a
      least-squares line ``mean = a + b * load`` with ``b > 0`` gives the load where the mean reaches the
      target;
    * bounded by what the p90s proved: no lower than the highest load whose p90 met the target (nor than
      that load scaled by how far under the target its p90 was: latency grows at most in proportion to
      load where the curve is still flat), never over twice the highest load seen (latency curves bend up:
      TTFT explodes once prefill saturates), and under the lowest load whose p90 missed the target (95%);
    * with neither a line nor a load that met the target, unknown: the planner reacts to the latency
      instead (:func:`reactive_workers`).

    How fast: two intervals at different loads are enough for a line, so after the first change in load
    (a ramp, or the planner's own scale-up halving each worker's load) the capacity is known; it then
    follows the last ``window`` intervals, so a change in the workload (longer prompts) shows within that
    window.  Where the latency stays far under the target the capacity doubles at most per step down of
    the fleet: the planner probes (one scale-down after ``--scale-down-after`` intervals), and a p90 over
    the target there sets the bound, so it does not probe there again within the window.
    """

    def __init__(self, window: int = 30) -> None:
        self.prefill: deque[Sample] = deque(maxlen=window)
        self.decode: deque[Sample] = deque(maxlen=window)

    def observe_prefill(self, tok_s_per_worker: float, ttft_ms: float, ttft_p90_ms: float | None = None) -> None:
        if tok_s_per_worker > 0 and ttft_ms > 0:
            self.prefill.append((tok_s_per_worker, ttft_ms, ttft_p90_ms if ttft_p90_ms is not None else ttft_ms))

    def observe_decode(self, streams_per_worker: float, itl_ms: float, itl_p90_ms: float | None = None) -> None:
        if streams_per_worker > 0 and itl_ms > 0:
            self.decode.append((streams_per_worker, itl_ms, itl_p90_ms if itl_p90_ms is not None else itl_ms))

    def prefill_tok_s(self, ttft_ms: float, isl: float) -> float | None:
        return load_at_target(self.prefill, ttft_ms)

    def decode_concurrency(self, itl_ms: float) -> float | None:
        return load_at_target(self.decode, itl_ms)


MISSED_MARGIN = 0.95  # the capacity stays this far under a load per worker whose p90 missed the target
EXTRAPOLATE = 2.0  # the capacity is never more than this times the highest load per worker seen


def load_at_target(samples: "deque[Sample] | list[Sample] | list[tuple[float, float]]", target: float) -> float | None:
    """The load per worker at the latency ``target``, from (load, mean[, p90]) samples (see
    :class:`OnlineCapacity`; without a p90 the mean stands for it)."""
    if not samples:
        return None
    xs = [s[0] for s in samples]
    ys = [s[1] for s in samples]
    p90s = [s[2] if len(s) > 2 else s[1] for s in samples]
    n = len(xs)
    mean_x = sum(xs) / n
    fitted = None
    if n >= 2 and (max(xs) - min(xs)) >= 0.1 * mean_x:
        mean_y = sum(ys) / n
        sxx = sum((x - mean_x) ** 2 for x in xs)
        sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
        slope = sxy / sxx
        if slope > 0:
            at_target = (target - (mean_y - slope * mean_x)) / slope
            fitted = at_target if at_target > 0 else None
    met = [(x, p) for x, p in zip(xs, p90s, strict=True) if p <= target]
    missed = [x for x, p in zip(xs, p90s, strict=True) if p > target]
    candidates = [fitted] if fitted is not None else []
    if met:
        x_met, p_met = max(met)
        candidates += [x_met, x_met * min(EXTRAPOLATE, target / p_met)]  # latency at most proportional to load
    if not candidates:
        return None
    capacity = min(max(candidates), EXTRAPOLATE * max(xs))
    if missed:
        capacity = min(capacity, MISSED_MARGIN * min(missed))
    return capacity


def reactive_workers(current: int, observed_ms: float | None, target_ms: float) -> int:
    """Workers when capacity is unknown: over the target, grow in proportion (latency roughly follows load
    per worker), at least by one; at or under it, hold (scaling down needs a known capacity)."""
    if observed_ms is None or observed_ms <= target_ms:
        return current
    return max(current + 1, math.ceil(max(current, 1) * observed_ms / target_ms))


KV_FULL = 0.9  # the workers' mean KV usage at which pre-emption is near: one more worker
KV_BUSY = 0.7  # over this, or with requests queued, the pool is not shrunk
QUEUED_SHARE = 0.25  # queued requests, as a share of those in flight, that call for more workers


def worker_load_floor(current: int, inflight: float, waiting: float, kv_usage: float | None) -> tuple[int, str]:
    """The fewest decode (or aggregated) workers the workers' own load allows, and why.

    * requests queued in the workers (at least 2, and a quarter of those in flight): enough workers that
      what is in flight would all be running at today's running count per worker,
      ``ceil(current * inflight / (inflight - waiting))``;
    * mean KV usage of at least ``KV_FULL``: one more worker;
    * any request queued, or KV usage over ``KV_BUSY``: no fewer than now.
    """
    if current <= 0:
        return 0, ""
    if waiting >= 2 and waiting >= QUEUED_SHARE * inflight:
        running = max(1.0, inflight - waiting)
        return max(current + 1, math.ceil(current * inflight / running)), f"{waiting:.0f} requests queued in the workers"
    if kv_usage is not None and kv_usage >= KV_FULL:
        return current + 1, f"workers' KV cache {kv_usage:.0%} full"
    if waiting > 0 or (kv_usage is not None and kv_usage > KV_BUSY):
        return current, "the workers are busy (queue or KV usage): not shrinking"
    return 0, ""


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
