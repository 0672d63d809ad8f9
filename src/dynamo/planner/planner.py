"""The planner's loop: every ``--adjustment-interval`` seconds observe, predict, size, decide, act.

1. **Observe** the interval's load on every frontend (:mod:`.observe`) and the fleet (the connector).
2. **Predict** the next interval's request rate, input and output lengths (:mod:`.predictors`).
3. **Size** each pool for the TTFT and ITL targets (:mod:`.sizing`) with the worker's capacity from its
   profile, or learned online; when the capacity is not known yet, or the latency seen is over a target
   anyway, react to the latency (grow in proportion to how far over it is).
4. **Decide** with hysteresis: up at once, down only after ``--scale-down-after`` intervals in a row that
   wanted fewer.  Starting workers count as capacity already, so a worker that takes a minute to load is
   not started again every interval.
5. **Act** through the connector, unless ``--no-operation``; either way one log line per decision with
   its reason, and the ``dynamo_planner_*`` metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from dynamo.planner.connector import DECODE, PREFILL, Connector, FleetState, PoolState
from dynamo.planner.metrics import PlannerMetrics
from dynamo.planner.observe import FrontendScraper, Observation, ObservationUnavailable
from dynamo.planner.predictors import make_predictor
from dynamo.planner.sizing import (
    Hysteresis,
    Load,
    OnlineCapacity,
    WorkerCapacity,
    clamp_pools,
    decode_demand,
    prefill_demand,
    reactive_workers,
    worker_load_floor,
    workers_for,
)
from dynamo.runtime.errors import DynamoRuntimeError

log = logging.getLogger(__name__)


@dataclass
class PlannerConfig:
    namespace: str
    environment: str = "local"
    adjustment_interval: float = 30.0
    ttft_ms: float = 500.0
    itl_ms: float = 50.0
    min_endpoint: int = 1
    max_workers: int | None = None
    load_predictor: str = "constant"
    profile_results_dir: Path | None = None
    no_operation: bool = False
    frontend_urls: list[str] = field(default_factory=list)
    decode_cmd: str | None = None
    prefill_cmd: str | None = None
    model: str | None = None
    metrics_port: int | None = None
    scale_down_after: int = 3
    prefill_component: str | None = None  # virtual: the prefill pool's component (none: aggregated)
    decode_component: str = "backend"
    state_dir: Path = Path(".")
    log_dir: Path = Path(".")
    drain_timeout: float = 60.0
    stop_workers_on_exit: bool = False
    discovery_backend: str | None = None  # "etcd", "file", or None: the runtime's rule (docs/runtime.md)

    @property
    def disaggregated(self) -> bool:
        if self.environment == "virtual":
            return self.prefill_component is not None
        return self.prefill_cmd is not None


@dataclass(frozen=True, slots=True)
class Decision:
    prefill: int
    decode: int
    reason: str


def size_pools(pred: Load, obs: Observation, fleet: FleetState, capacity: WorkerCapacity, cfg: PlannerConfig,
               additive: bool, stable: bool = True, previous: Observation | None = None) -> Decision:
    """How many workers each pool needs for the predicted load (before hysteresis).

    Latency is the interval's p90 (what the targets are scored on), its mean when the frontends gave no
    buckets.  ``additive``: the capacity's two curves were measured apart (a profile), so an aggregated
    worker's prefill and decode shares add up; learned online from an aggregated fleet they already include
    each other, so the larger one counts.  The workers' own load then corrects the decode (or aggregated)
    pool (:func:`~.sizing.worker_load_floor`).  ``stable`` (:meth:`Planner._stable`): the interval's
    latency belongs to the fleet as it is; one of an interval in which workers came or went, or right
    after (the old workers still run what they had), belongs to no fleet size, so it is not reacted to."""
    if pred.request_rate <= 0 and obs.inflight <= 0:
        p, d = clamp_pools(0, 0, cfg.min_endpoint, cfg.max_workers, cfg.disaggregated)
        return Decision(p, d, "no load")
    reasons: list[str] = []
    ttft_seen = obs.ttft_p90_ms if obs.ttft_p90_ms is not None else obs.ttft_ms
    itl_seen = obs.itl_p90_ms if obs.itl_p90_ms is not None else obs.itl_ms

    def sized(state: PoolState, demand: float | None, what: str) -> int:
        if demand is None:
            return state.coming
        reasons.append(f"{what} {demand:.2f} workers' worth")
        return workers_for(demand)

    def react(state: PoolState, n: int, observed: float | None, target: float, what: str) -> int:
        """A latency over the target grows the pool from the workers that made that latency (the ready
        ones; one already starting counts towards the growth)."""
        if not stable or observed is None or observed <= target:
            return n
        bumped = max(reactive_workers(max(state.ready, 1), observed, target), state.coming)
        if bumped > n:
            reasons.append(f"{what} {observed:.0f} ms over {target:.0f} ms")
        return max(n, bumped)

    itl_cap = capacity.decode_concurrency(cfg.itl_ms)
    ttft_cap = capacity.prefill_tok_s(cfg.ttft_ms, pred.isl)
    p_demand = prefill_demand(pred, ttft_cap) if ttft_cap else None
    d_demand = decode_demand(pred, cfg.itl_ms, itl_cap) if itl_cap else None
    if ttft_cap or itl_cap:
        reasons.append("a worker takes " + ", ".join(
            ([f"{ttft_cap:.0f} prompt tok/s at the TTFT target"] if ttft_cap else [])
            + ([f"{itl_cap:.1f} streams at the ITL target"] if itl_cap else [])))
    current = fleet.decode.coming
    if cfg.disaggregated:
        p = react(fleet.prefill, sized(fleet.prefill, p_demand, "prefill (TTFT)"), ttft_seen, cfg.ttft_ms, "TTFT")
        d = react(fleet.decode, sized(fleet.decode, d_demand, "decode (ITL)"), itl_seen, cfg.itl_ms, "ITL")
    else:
        demand = None  # one worker does both: sized only once both shares are known
        if p_demand is not None and d_demand is not None:
            demand = p_demand + d_demand if additive else max(p_demand, d_demand)
        d = sized(fleet.decode, demand, "aggregated")
        d = react(fleet.decode, react(fleet.decode, d, ttft_seen, cfg.ttft_ms, "TTFT"), itl_seen, cfg.itl_ms, "ITL")
        p = 0
    # the workers' queue and KV usage are gauges read at one instant: a burst of arrivals waits a step in
    # every engine, so only what the last two scrapes both saw counts
    waiting, kv = obs.waiting, obs.kv_usage
    if previous is not None:
        waiting = min(waiting, previous.waiting)
        kv = None if kv is None or previous.kv_usage is None else min(kv, previous.kv_usage)
    else:
        waiting, kv = 0.0, None
    floor, why = worker_load_floor(current, obs.inflight, waiting, kv)
    if floor > d:
        reasons.append(why)
        d = floor
    p, d = clamp_pools(p, d, cfg.min_endpoint, cfg.max_workers, cfg.disaggregated)
    return Decision(p, d, "; ".join(reasons) or "within targets")


class Planner:
    def __init__(self, cfg: PlannerConfig, connector: Connector, scraper: FrontendScraper,
                 capacity: WorkerCapacity | None = None, metrics: PlannerMetrics | None = None) -> None:
        self.cfg = cfg
        self.connector = connector
        self.scraper = scraper
        self.online = OnlineCapacity()
        self.capacity: WorkerCapacity = capacity or self.online
        self.additive = capacity is not None
        self.metrics = metrics or PlannerMetrics()
        self.predict = {name: make_predictor(cfg.load_predictor) for name in ("request_rate", "isl", "osl")}
        self.hysteresis = {PREFILL: Hysteresis(cfg.scale_down_after), DECODE: Hysteresis(cfg.scale_down_after)}
        self.targets: dict[str, int] | None = None
        self.last_fleet: FleetState | None = None
        self.previous: Observation | None = None  # the last interval's observation
        self.fleet_since = time.monotonic()  # when the fleet last changed (as seen at an interval's end)
        self.decisions = 0

    async def run(self, stop: asyncio.Event) -> None:
        fleet = await self.connector.start()
        log.info("planner for namespace %s: %d prefill and %d decode worker(s) found; every %.1f s, TTFT %.0f ms, "
                 "ITL %.0f ms%s", self.cfg.namespace, fleet.prefill.coming, fleet.decode.coming,
                 self.cfg.adjustment_interval, self.cfg.ttft_ms, self.cfg.itl_ms,
                 " (no-operation: nothing is changed)" if self.cfg.no_operation else "")
        await self.scraper.observe()  # the baselines
        await self.step(first=True)
        failing_since: float | None = None
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.adjustment_interval)
            except TimeoutError:
                pass
            if stop.is_set():
                break
            try:
                await self.step()
            except ObservationUnavailable as e:  # said once where it starts (frontends.NamespaceModels)
                log.debug("interval skipped: %s", e)
            except DynamoRuntimeError as e:  # discovery unreachable (the virtual connector's keys): an outage
                if failing_since is None:  # is one warning and one info line, not a traceback per interval
                    failing_since = time.monotonic()
                    log.warning("planner interval failed (%s); trying again every interval", e)
                continue
            except Exception:  # noqa: BLE001 - one failed interval must not end the planner
                log.exception("planner interval failed; trying again next interval")
                continue
            if failing_since is not None:
                log.info("planner intervals work again after %.1f s", time.monotonic() - failing_since)
                failing_since = None

    async def step(self, first: bool = False) -> Decision:
        obs = await self.scraper.observe()
        fleet = await self.connector.fleet()
        stable = self._stable(fleet, obs)
        if stable:
            self._learn(obs, fleet)
        if obs.seconds > 0 and obs.frontends:
            self.predict["request_rate"].add(obs.request_rate)
            if obs.isl is not None:
                self.predict["isl"].add(obs.isl)
            if obs.osl is not None:
                self.predict["osl"].add(obs.osl)
        values = await asyncio.to_thread(lambda: {k: p.predict() for k, p in self.predict.items()})
        pred = Load(values["request_rate"], values["isl"], values["osl"])
        if first:
            sized = Decision(*clamp_pools(fleet.prefill.coming, fleet.decode.coming, self.cfg.min_endpoint,
                                          self.cfg.max_workers, self.cfg.disaggregated), "start")
        else:
            sized = size_pools(pred, obs, fleet, self.capacity, self.cfg, self.additive, stable, self.previous)
        self.previous = obs
        current = self.targets or {PREFILL: fleet.prefill.coming, DECODE: fleet.decode.coming}
        wanted = {PREFILL: sized.prefill, DECODE: sized.decode}
        decided = {pool: self.hysteresis[pool].step(current[pool], wanted[pool]) for pool in wanted}
        self.metrics.record(obs, pred, decided, fleet)
        changed = decided != current or self.targets is None
        held = {pool for pool in wanted if wanted[pool] < current[pool] == decided[pool]}
        summary = (f"prefill {current[PREFILL]}->{decided[PREFILL]} decode {current[DECODE]}->{decided[DECODE]} "
                   f"(ready {fleet.prefill.ready}+{fleet.decode.ready}, starting {fleet.prefill.starting}+"
                   f"{fleet.decode.starting}); load {obs.request_rate:.2f} req/s -> predicted {pred.request_rate:.2f}, "
                   f"isl {pred.isl:.0f} osl {pred.osl:.0f}, p90 ttft {_ms(obs.ttft_p90_ms)} itl {_ms(obs.itl_p90_ms)}"
                   f"{_worker_load(obs)}: {sized.reason}"
                   + (f"; scale-down of {', '.join(sorted(held))} held (hysteresis)" if held else ""))
        if changed and decided != current:
            for pool in decided:
                if decided[pool] != current[pool]:
                    self.metrics.decisions.labels(pool, "up" if decided[pool] > current[pool] else "down").inc()
            log.info("decision: %s%s", summary, " [no-operation]" if self.cfg.no_operation else "")
        else:
            log.debug("hold: %s", summary)
        if self.cfg.no_operation:
            self.targets = decided
        elif await self.connector.scale(decided[PREFILL], decided[DECODE]):
            self.targets = decided
        return Decision(decided[PREFILL], decided[DECODE], sized.reason)

    def _stable(self, fleet: FleetState, obs: Observation) -> bool:
        """Whether the interval's latency belongs to the fleet as it is: none starting or draining, and the
        fleet unchanged since one request's duration before the interval began.  Requests do not move: for
        a request's length after a new worker serves, the old ones still run what they had."""
        now = time.monotonic()
        if fleet != self.last_fleet:
            self.last_fleet, self.fleet_since = fleet, now
        if any(p.starting or p.draining for p in (fleet.prefill, fleet.decode)):
            return False
        request_s = ((obs.osl or 0.0) * (obs.itl_ms or 0.0) + (obs.ttft_ms or 0.0)) / 1000.0
        return now - self.fleet_since >= obs.seconds + request_s

    def _learn(self, obs: Observation, fleet: FleetState) -> None:
        """Feed the online capacity with a stable interval's per-worker load and latency."""
        if obs.seconds <= 0:
            return
        prefill_workers = fleet.prefill.ready if self.cfg.disaggregated else fleet.decode.ready
        if prefill_workers and obs.isl is not None and obs.ttft_ms is not None:
            self.online.observe_prefill(obs.request_rate * obs.isl / prefill_workers, obs.ttft_ms, obs.ttft_p90_ms)
        if fleet.decode.ready and obs.itl_ms is not None:
            self.online.observe_decode(obs.inflight / fleet.decode.ready, obs.itl_ms, obs.itl_p90_ms)


def _worker_load(obs: Observation) -> str:
    if obs.kv_usage is None:
        return ""
    return f", workers' KV {obs.kv_usage:.0%} queued {obs.waiting:.0f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"
