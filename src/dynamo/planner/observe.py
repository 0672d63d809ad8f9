"""What the fleet sees, read from every frontend's ``/metrics`` (Prometheus text) once per interval.

Why scraping rather than the event plane: the frontend already counts everything the planner needs
(requests, input and output lengths, TTFT, ITL, requests in flight, and the workers' KV usage and queues
it follows), the text format is stable and the same for Dynamo's frontend, and a scrape of a frontend that
restarted simply starts its counters again (handled below).  prometheus_client's own parser reads it.

Per interval and over all frontends:

* arrivals = completed requests (``<prefix>_requests_total``) + the change in requests in flight;
* mean input and output lengths, mean TTFT and ITL: the change of each histogram's sum over the change of
  its count;
* requests in flight now, the workers' mean KV usage and their queued requests now.

A frontend process is known by its URL and its ``http_worker`` label (``--http-workers``: each process has
its own counters).  Its first scrape is a baseline; a counter that went down means the process restarted,
and its value since then is the interval's.  A frontend that does not answer is left out (logged once)
and starts from a new baseline when it answers again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Iterable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "dynamo_frontend"
SCRAPE_TIMEOUT_S = 2.0


@dataclass(slots=True)
class FrontendTotals:
    """One frontend process's counters (cumulative) and gauges (now), for the planner's model(s)."""

    requests: float = 0.0
    isl_sum: float = 0.0
    isl_count: float = 0.0
    osl_sum: float = 0.0
    osl_count: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    inflight: float = 0.0  # gauge
    waiting: float = 0.0  # gauge: requests queued in the workers
    kv_usage: list[float] = field(default_factory=list)  # gauge: each worker's KV usage 0..1

    COUNTERS = ("requests", "isl_sum", "isl_count", "osl_sum", "osl_count", "ttft_sum", "ttft_count",
                "itl_sum", "itl_count")


def _sample_fields(prefix: str) -> dict[str, str]:
    return {
        f"{prefix}_requests_total": "requests",
        f"{prefix}_input_sequence_tokens_sum": "isl_sum",
        f"{prefix}_input_sequence_tokens_count": "isl_count",
        f"{prefix}_output_sequence_tokens_sum": "osl_sum",
        f"{prefix}_output_sequence_tokens_count": "osl_count",
        f"{prefix}_time_to_first_token_seconds_sum": "ttft_sum",
        f"{prefix}_time_to_first_token_seconds_count": "ttft_count",
        f"{prefix}_inter_token_latency_seconds_sum": "itl_sum",
        f"{prefix}_inter_token_latency_seconds_count": "itl_count",
        f"{prefix}_inflight_requests": "inflight",
        f"{prefix}_worker_requests_waiting": "waiting",
    }


def parse_frontend_metrics(text: str, prefix: str = DEFAULT_PREFIX,
                           model: str | None = None) -> dict[str, FrontendTotals]:
    """A scrape's totals per frontend process (the ``http_worker`` label, ``""`` without one).

    ``model`` (compared lowercased, as the frontend labels it) keeps only that model's series."""
    wanted = _sample_fields(prefix)
    kv_name = f"{prefix}_worker_kv_cache_usage_ratio"
    out: dict[str, FrontendTotals] = {}
    want_model = model.lower() if model else None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = wanted.get(s.name)
            if name is None and s.name != kv_name:
                continue
            if want_model is not None and s.labels.get("model", want_model) != want_model:
                continue
            totals = out.setdefault(s.labels.get("http_worker", ""), FrontendTotals())
            if name is None:
                totals.kv_usage.append(float(s.value))
            else:
                setattr(totals, name, getattr(totals, name) + float(s.value))
    return out


def interval_delta(prev: FrontendTotals, cur: FrontendTotals) -> FrontendTotals:
    """The counters' change from ``prev`` to ``cur`` (all of ``cur`` when the process restarted) and the
    gauges now; ``inflight`` becomes its change, for arrivals."""
    restarted = any(getattr(cur, c) < getattr(prev, c) for c in FrontendTotals.COUNTERS)
    d = FrontendTotals(waiting=cur.waiting, kv_usage=list(cur.kv_usage))
    for c in FrontendTotals.COUNTERS:
        setattr(d, c, getattr(cur, c) - (0.0 if restarted else getattr(prev, c)))
    d.inflight = cur.inflight - (0.0 if restarted else prev.inflight)
    return d


@dataclass(frozen=True, slots=True)
class Observation:
    """One interval's load over every frontend; ``None`` where the interval had nothing to average."""

    seconds: float
    arrivals: float
    completed: float
    isl: float | None
    osl: float | None
    ttft_ms: float | None
    itl_ms: float | None
    inflight: float
    waiting: float
    kv_usage: float | None
    frontends: int

    @property
    def request_rate(self) -> float:
        return self.arrivals / self.seconds if self.seconds > 0 else 0.0


def combine(deltas: Iterable[FrontendTotals], inflight_now: float, seconds: float, frontends: int) -> Observation:
    """The interval's :class:`Observation` from each frontend process's :func:`interval_delta`."""
    total = FrontendTotals()
    for d in deltas:
        for f in fields(FrontendTotals):
            if f.name == "kv_usage":
                total.kv_usage.extend(d.kv_usage)
            else:
                setattr(total, f.name, getattr(total, f.name) + getattr(d, f.name))

    def mean(s: float, n: float, scale: float = 1.0) -> float | None:
        return s / n * scale if n > 0 else None

    return Observation(
        seconds=seconds, arrivals=max(0.0, total.requests + total.inflight), completed=total.requests,
        isl=mean(total.isl_sum, total.isl_count), osl=mean(total.osl_sum, total.osl_count),
        ttft_ms=mean(total.ttft_sum, total.ttft_count, 1000.0), itl_ms=mean(total.itl_sum, total.itl_count, 1000.0),
        inflight=inflight_now, waiting=total.waiting,
        kv_usage=sum(total.kv_usage) / len(total.kv_usage) if total.kv_usage else None, frontends=frontends)


class FrontendScraper:
    """Scrapes the frontends ``urls()`` names (``--frontend-url`` and the ones discovery found) each interval."""

    def __init__(self, urls: Callable[[], Iterable[str]], prefix: str = DEFAULT_PREFIX, model: str | None = None):
        self.urls = urls
        self.prefix = prefix
        self.model = model
        self.last: dict[tuple[str, str], FrontendTotals] = {}
        self.unreachable: set[str] = set()
        self.last_time: float | None = None
        self._session: aiohttp.ClientSession | None = None

    async def _scrape(self, url: str) -> dict[str, FrontendTotals] | None:
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
            for key in [k for k in self.last if k[0] == url]:
                del self.last[key]
            return None
        if url in self.unreachable:
            self.unreachable.discard(url)
            log.info("frontend %s answers again", url)
        return parse_frontend_metrics(text, self.prefix, self.model)

    async def observe(self) -> Observation:
        """The load since the last call (the first call only sets the baselines)."""
        now = time.monotonic()
        seconds = now - self.last_time if self.last_time is not None else 0.0
        self.last_time = now
        deltas: list[FrontendTotals] = []
        inflight = 0.0
        seen: set[tuple[str, str]] = set()
        answered = 0
        for url in sorted(set(self.urls())):
            scraped = await self._scrape(url)
            if scraped is None:
                continue
            answered += 1
            for process, totals in scraped.items():
                key = (url, process)
                seen.add(key)
                inflight += totals.inflight
                prev = self.last.get(key)
                self.last[key] = totals
                if prev is not None:
                    deltas.append(interval_delta(prev, totals))
        for key in set(self.last) - seen:
            del self.last[key]
        return combine(deltas, inflight, seconds, answered)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
