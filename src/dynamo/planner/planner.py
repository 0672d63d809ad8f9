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
from dataclasses import dataclass, field
from pathlib import Path

from dynamo.planner.connector import DECODE, PREFILL, Connector, FleetState
from dynamo.planner.metrics import PlannerMetrics
from dynamo.planner.observe import FrontendScraper, Observation
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
    workers_for,
)

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
               additive: bool) -> Decision:
    """How many workers each pool needs for the predicted load (before hysteresis).

    ``additive``: the capacity's two curves were measured apart (a profile), so an aggregated worker's
    prefill and decode shares add up; learned online from an aggregated fleet they already include each
    other, so the larger one counts."""
    if pred.request_rate <= 0 and obs.inflight <= 0:
        p, d = clamp_pools(0, 0, cfg.min_endpoint, cfg.max_workers, cfg.disaggregated)
        return Decision(p, d, "no load")
    reasons: list[str] = []

    def pool(current: int, demand: float | None, observed: float | None, target: float, what: str) -> int:
        n = workers_for(demand) if demand is not None else current
        if demand is not None:
            reasons.append(f"{what} {demand:.2f} workers' worth")
        if observed is not None and observed > target:
            bumped = reactive_workers(current, observed, target)
            if bumped > n:
                reasons.append(f"{what} {observed:.0f} ms over {target:.0f} ms")
                n = bumped
        return n

    itl_cap = capacity.decode_concurrency(cfg.itl_ms)
    ttft_cap = capacity.prefill_tok_s(cfg.ttft_ms, pred.isl)
    p_demand = prefill_demand(pred, ttft_cap) if ttft_cap else None
    d_demand = decode_demand(pred, cfg.itl_ms, itl_cap) if itl_cap else None
    if cfg.disaggregated:
        p = pool(fleet.prefill.coming, p_demand, obs.ttft_ms, cfg.ttft_ms, "prefill (TTFT)")
        d = pool(fleet.decode.coming, d_demand, obs.itl_ms, cfg.itl_ms, "decode (ITL)")
    else:
        demand = None
        if p_demand is not None and d_demand is not None:
            demand = p_demand + d_demand if additive else max(p_demand, d_demand)
        current = fleet.decode.coming
        d = max(pool(current, demand, obs.ttft_ms, cfg.ttft_ms, "TTFT"),
                pool(current, demand, obs.itl_ms, cfg.itl_ms, "ITL"))
        p = 0
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
        self.decisions = 0

    async def run(self, stop: asyncio.Event) -> None:
        fleet = await self.connector.start()
        log.info("planner for namespace %s: %d prefill and %d decode worker(s) found; every %.1f s, TTFT %.0f ms, "
                 "ITL %.0f ms%s", self.cfg.namespace, fleet.prefill.coming, fleet.decode.coming,
                 self.cfg.adjustment_interval, self.cfg.ttft_ms, self.cfg.itl_ms,
                 " (no-operation: nothing is changed)" if self.cfg.no_operation else "")
        await self.scraper.observe()  # the baselines
        await self.step(first=True)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.adjustment_interval)
            except TimeoutError:
                pass
            if stop.is_set():
                break
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - one failed interval (store unreachable) must not end the planner
                log.exception("planner interval failed; trying again next interval")

    async def step(self, first: bool = False) -> Decision:
        obs = await self.scraper.observe()
        fleet = await self.connector.fleet()
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
            sized = size_pools(pred, obs, fleet, self.capacity, self.cfg, self.additive)
        current = self.targets or {PREFILL: fleet.prefill.coming, DECODE: fleet.decode.coming}
        wanted = {PREFILL: sized.prefill, DECODE: sized.decode}
        decided = {pool: self.hysteresis[pool].step(current[pool], wanted[pool]) for pool in wanted}
        self.metrics.record(obs, pred, wanted, fleet)
        changed = decided != current or self.targets is None
        held = {pool for pool in wanted if wanted[pool] < current[pool] == decided[pool]}
        summary = (f"prefill {current[PREFILL]}->{decided[PREFILL]} decode {current[DECODE]}->{decided[DECODE]} "
                   f"(ready {fleet.prefill.ready}+{fleet.decode.ready}, starting {fleet.prefill.starting}+"
                   f"{fleet.decode.starting}); load {obs.request_rate:.2f} req/s -> predicted {pred.request_rate:.2f}, "
                   f"isl {pred.isl:.0f} osl {pred.osl:.0f}, ttft {_ms(obs.ttft_ms)} itl {_ms(obs.itl_ms)}: {sized.reason}"
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

    def _learn(self, obs: Observation, fleet: FleetState) -> None:
        """Feed the online capacity with this interval's per-worker load and latency."""
        if obs.seconds <= 0 or obs.completed <= 0:
            return
        prefill_workers = fleet.prefill.ready if self.cfg.disaggregated else fleet.decode.ready
        if prefill_workers and obs.isl is not None and obs.ttft_ms is not None:
            self.online.observe_prefill(obs.request_rate * obs.isl / prefill_workers, obs.ttft_ms)
        if fleet.decode.ready and obs.itl_ms is not None:
            self.online.observe_decode(obs.inflight / fleet.decode.ready, obs.itl_ms)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"
