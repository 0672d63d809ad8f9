"""What the fleet sees, read from every frontend's ``/metrics`` (Prometheus text) once per interval.

Why scraping rather than the event plane: the frontend already counts everything the planner needs
(requests, input and output lengths, TTFT, ITL, requests in flight, and the workers' KV usage and queues
it follows), the text format is stable and the same for Dynamo's frontend, and a scrape of a frontend that
restarted simply starts its counters again (handled below).  prometheus_client's own parser reads it.

Per interval and over all frontends:

* arrivals = completed requests (``<prefix>_requests_total``) + the change in requests in flight;
* mean input and output lengths: the change of each histogram's sum over the change of its count;
* TTFT and ITL: their means the same way, and their **p90** from the change of each bucket's count over
  the interval, interpolated inside the bucket as Prometheus's ``histogram_quantile`` does (the benchmark
  scores windows by p90, so the planner sizes by it);
* requests in flight now; the workers' load now, one value per worker whichever frontends report it: the
  mean KV usage and the requests queued in the workers.

A frontend process (and each model's series on it) is known by its URL and its ``http_worker`` label (``--http-workers``: each process has
its own counters, and a scrape is answered by one of them).  Its first scrape is a baseline; a counter that
went down means the process restarted, and its value since then is the interval's.  A frontend that does
not answer is left out (logged once) and starts from a new baseline when it answers again; one whose URL
is no longer listed is forgotten.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "dynamo_frontend"
SCRAPE_TIMEOUT_S = 2.0
QUANTILE = 0.9

Buckets = dict[float, float]  # upper bound (le) -> cumulative count


class Counter(enum.Enum):
    """A frontend's cumulative counters the planner reads; the value is the sample's name after the prefix."""

    REQUESTS = "requests_total"
    ISL_SUM = "input_sequence_tokens_sum"
    ISL_COUNT = "input_sequence_tokens_count"
    OSL_SUM = "output_sequence_tokens_sum"
    OSL_COUNT = "output_sequence_tokens_count"
    TTFT_SUM = "time_to_first_token_seconds_sum"
    TTFT_COUNT = "time_to_first_token_seconds_count"
    ITL_SUM = "inter_token_latency_seconds_sum"
    ITL_COUNT = "inter_token_latency_seconds_count"


class Histogram(enum.Enum):
    """The latency histograms whose buckets give the p90; the value is the bucket sample's name."""

    TTFT = "time_to_first_token_seconds_bucket"
    ITL = "inter_token_latency_seconds_bucket"


class WorkerGauge(enum.Enum):
    """Gauges the frontend reports per worker it follows; the value is the sample's name."""

    WAITING = "worker_requests_waiting"  # requests queued in the worker
    KV_USAGE = "worker_kv_cache_usage_ratio"  # 0..1


INFLIGHT = "inflight_requests"  # a gauge of the frontend itself


def _counters() -> dict[Counter, float]:
    return dict.fromkeys(Counter, 0.0)


def _histograms() -> dict[Histogram, Buckets]:
    return {h: {} for h in Histogram}


def _worker_gauges() -> dict[WorkerGauge, dict[str, float]]:
    return {g: {} for g in WorkerGauge}


@dataclass(slots=True)
class FrontendTotals:
    """One frontend process's counters (cumulative) and gauges (now), for the planner's model(s).

    Every :class:`Counter`, :class:`Histogram` and :class:`WorkerGauge` has its entry (zero or empty until
    a sample names it), so the code that adds and subtracts them walks the enums instead of naming each."""

    counters: dict[Counter, float] = field(default_factory=_counters)
    histograms: dict[Histogram, Buckets] = field(default_factory=_histograms)
    inflight: float = 0.0  # gauge
    workers: dict[WorkerGauge, dict[str, float]] = field(default_factory=_worker_gauges)  # gauge per worker

    def __post_init__(self) -> None:  # the ones a caller left out are zero or empty
        self.counters = _counters() | self.counters
        self.histograms = _histograms() | self.histograms
        self.workers = _worker_gauges() | self.workers


def parse_frontend_metrics(text: str, prefix: str = DEFAULT_PREFIX,
                           models: set[str] | None = None) -> dict[tuple[str, str], FrontendTotals]:
    """A scrape's totals per frontend process (the ``http_worker`` label, ``""`` without one) and model:
    each model's series get their own baseline, so a model that starts to count (its first worker in the
    namespace registered) does not bring its whole history into one interval.

    ``models`` (lowercased, as the frontend labels them) keeps only those models' series; ``None`` keeps
    every model's."""
    counters = {f"{prefix}_{c.value}": c for c in Counter}
    histograms = {f"{prefix}_{h.value}": h for h in Histogram}
    per_worker = {f"{prefix}_{g.value}": g for g in WorkerGauge}
    inflight = f"{prefix}_{INFLIGHT}"
    out: dict[tuple[str, str], FrontendTotals] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name not in counters and s.name not in histograms and s.name not in per_worker \
                    and s.name != inflight:
                continue
            model = s.labels.get("model", "")
            if models is not None and model not in models:
                continue
            totals = out.setdefault((s.labels.get("http_worker", ""), model), FrontendTotals())
            value = float(s.value)
            if s.name == inflight:
                totals.inflight += value
            elif s.name in counters:
                totals.counters[counters[s.name]] += value
            elif s.name in histograms:
                hist = totals.histograms[histograms[s.name]]
                le = float(s.labels["le"])
                hist[le] = hist.get(le, 0.0) + value
            else:
                worker = f"{s.labels.get('worker_id', '')}/{s.labels.get('dp_rank', '')}"
                gauge = totals.workers[per_worker[s.name]]
                gauge[worker] = max(gauge.get(worker, 0.0), value)
    return out


def _restarted(prev: FrontendTotals, cur: FrontendTotals) -> bool:
    if any(cur.counters[c] < prev.counters[c] for c in Counter):
        return True
    return any(cur.histograms[h].get(le, 0.0) < n for h in Histogram for le, n in prev.histograms[h].items())


def interval_delta(prev: FrontendTotals, cur: FrontendTotals) -> FrontendTotals:
    """The counters' change from ``prev`` to ``cur`` (all of ``cur`` when the process restarted: a counter
    or bucket went down) and the gauges now; ``inflight`` becomes its change, for arrivals."""
    base = FrontendTotals() if _restarted(prev, cur) else prev
    return FrontendTotals(
        counters={c: cur.counters[c] - base.counters[c] for c in Counter},
        histograms={h: {le: n - base.histograms[h].get(le, 0.0) for le, n in cur.histograms[h].items()}
                    for h in Histogram},
        inflight=cur.inflight - base.inflight,
        workers={g: dict(cur.workers[g]) for g in WorkerGauge})


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """The ``q`` quantile of a cumulative histogram, as Prometheus's ``histogram_quantile`` computes it:
    linear inside the bucket the rank falls in (from 0 for the first bucket); in the ``+Inf`` bucket, the
    highest finite bound.  ``None`` when the histogram is empty."""
    bounds = sorted(buckets)
    if not bounds or not math.isinf(bounds[-1]):
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


@dataclass(frozen=True, slots=True)
class Observation:
    """One interval's load over every frontend; ``None`` where the interval had nothing to average."""

    seconds: float
    arrivals: float
    completed: float
    isl: float | None
    osl: float | None
    ttft_ms: float | None  # mean
    itl_ms: float | None  # mean
    inflight: float
    waiting: float  # requests queued in the workers, now
    kv_usage: float | None  # the workers' mean KV usage now, 0..1
    frontends: int
    ttft_p90_ms: float | None = None
    itl_p90_ms: float | None = None
    workers_reporting: int = 0  # workers whose load (KV usage) the frontends report

    @property
    def request_rate(self) -> float:
        return self.arrivals / self.seconds if self.seconds > 0 else 0.0


def combine(deltas: Iterable[FrontendTotals], inflight_now: float, seconds: float, frontends: int) -> Observation:
    """The interval's :class:`Observation` from each frontend process's :func:`interval_delta`."""
    total = FrontendTotals()
    for d in deltas:
        for c in Counter:
            total.counters[c] += d.counters[c]
        total.inflight += d.inflight
        for h in Histogram:
            mine = total.histograms[h]
            for le, n in d.histograms[h].items():
                mine[le] = mine.get(le, 0.0) + n
        for g in WorkerGauge:
            mine_g = total.workers[g]
            for worker, v in d.workers[g].items():  # the same worker seen by several frontends counts once
                mine_g[worker] = max(mine_g.get(worker, 0.0), v)

    def mean(s: Counter, n: Counter, scale: float = 1.0) -> float | None:
        count = total.counters[n]
        return total.counters[s] / count * scale if count > 0 else None

    def p90_ms(h: Histogram) -> float | None:
        value = histogram_quantile(QUANTILE, total.histograms[h])
        return None if value is None else value * 1000.0

    completed = total.counters[Counter.REQUESTS]
    kv = total.workers[WorkerGauge.KV_USAGE]
    return Observation(
        seconds=seconds, arrivals=max(0.0, completed + total.inflight), completed=completed,
        isl=mean(Counter.ISL_SUM, Counter.ISL_COUNT), osl=mean(Counter.OSL_SUM, Counter.OSL_COUNT),
        ttft_ms=mean(Counter.TTFT_SUM, Counter.TTFT_COUNT, 1000.0),
        itl_ms=mean(Counter.ITL_SUM, Counter.ITL_COUNT, 1000.0),
        inflight=inflight_now, waiting=sum(total.workers[WorkerGauge.WAITING].values()),
        kv_usage=sum(kv.values()) / len(kv) if kv else None, frontends=frontends,
        ttft_p90_ms=p90_ms(Histogram.TTFT), itl_p90_ms=p90_ms(Histogram.ITL), workers_reporting=len(kv))


class ObservationUnavailable(Exception):
    """This interval cannot be observed at all (e.g. which models count is not known): the planner skips
    it, deciding nothing, rather than read it as an interval without load."""


class FrontendScraper:
    """Scrapes the frontends ``urls()`` names (``--frontend-url`` and the ones discovery found) each interval.

    ``models()``, when given, names the models whose series count this interval (see
    :mod:`.frontends`); ``None`` from it, or no ``models``, counts every model."""

    def __init__(self, urls: Callable[[], Iterable[str]], prefix: str = DEFAULT_PREFIX,
                 models: Callable[[], Awaitable[set[str] | None]] | None = None):
        self.urls = urls
        self.prefix = prefix
        self.models = models
        self.last: dict[tuple[str, str, str], FrontendTotals] = {}  # (url, process, model) -> last totals
        self.unreachable: set[str] = set()
        self.last_time: float | None = None
        self._session: aiohttp.ClientSession | None = None

    async def _scrape(self, url: str, models: set[str] | None) -> dict[tuple[str, str], FrontendTotals] | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S))
        try:
            async with self._session.get(url.rstrip("/") + "/metrics") as resp:
                resp.raise_for_status()
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            if url not in self.unreachable:
                log.warning("frontend %s did not answer its /metrics (%s); left out until it does", url, e)
                self.unreachable.add(url)
            self._forget(lambda key: key[0] == url)
            return None
        if url in self.unreachable:
            self.unreachable.discard(url)
            log.info("frontend %s answers again", url)
        return parse_frontend_metrics(text, self.prefix, models)

    def _forget(self, which: Callable[[tuple[str, str, str]], bool]) -> None:
        for key in [k for k in self.last if which(k)]:
            del self.last[key]

    async def observe(self) -> Observation:
        """The load since the last call (the first call only sets the baselines)."""
        models = await self.models() if self.models is not None else None  # first: it may raise
        now = time.monotonic()
        seconds = now - self.last_time if self.last_time is not None else 0.0
        self.last_time = now
        deltas: list[FrontendTotals] = []
        inflight = 0.0
        answered = 0
        urls = sorted(set(self.urls()))
        self._forget(lambda key: key[0] not in urls)
        self.unreachable &= set(urls)
        for url in urls:
            scraped = await self._scrape(url, models)
            if scraped is None:
                continue
            answered += 1
            for (process, model), totals in scraped.items():
                key = (url, process, model)
                inflight += totals.inflight
                prev = self.last.get(key)
                self.last[key] = totals
                if prev is not None:
                    deltas.append(interval_delta(prev, totals))
        return combine(deltas, inflight, seconds, answered)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
