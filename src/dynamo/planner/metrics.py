"""The planner's own Prometheus metrics (``dynamo_planner_*``), served on ``--metrics-port``.

Gauges are set once per adjustment interval; ``dynamo_planner_decisions_total`` counts the intervals that
changed a pool's size, by pool and direction.  prometheus_client's own HTTP server (a thread) serves them:
a scrape never waits on the planner's loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

if TYPE_CHECKING:
    from dynamo.planner.connector import FleetState
    from dynamo.planner.observe import Observation
    from dynamo.planner.sizing import Load

PREFIX = "dynamo_planner"


class PlannerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.observed = Gauge(f"{PREFIX}_observed_load", "Load seen over the last interval "
                              "(request_rate req/s, isl and osl tokens, ttft_ms, itl_ms)", ["quantity"], registry=r)
        self.predicted = Gauge(f"{PREFIX}_predicted_load", "Load predicted for the next interval", ["quantity"],
                               registry=r)
        self.desired = Gauge(f"{PREFIX}_desired_workers", "Workers the planner decided on, per pool (after hysteresis)", ["pool"], registry=r)
        self.workers = Gauge(f"{PREFIX}_workers", "Workers per pool and state (ready, starting, draining)",
                             ["pool", "state"], registry=r)
        self.decisions = Counter(f"{PREFIX}_decisions", "Decisions that changed a pool's size",
                                 ["pool", "direction"], registry=r)
        self.intervals = Counter(f"{PREFIX}_intervals", "Adjustment intervals the planner went through", registry=r)
        self.frontends = Gauge(f"{PREFIX}_frontends", "Frontends that answered the last scrape", registry=r)
        self._server: Any = None

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve the metrics; returns the port bound (``port`` 0: one the kernel picked)."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def record(self, obs: "Observation", pred: "Load", desired: dict[str, int], fleet: "FleetState") -> None:
        for name, value in (("request_rate", obs.request_rate), ("isl", obs.isl), ("osl", obs.osl),
                            ("ttft_ms", obs.ttft_ms), ("itl_ms", obs.itl_ms)):
            if value is not None:
                self.observed.labels(name).set(value)
        for name, value in (("request_rate", pred.request_rate), ("isl", pred.isl), ("osl", pred.osl)):
            self.predicted.labels(name).set(value)
        self.frontends.set(obs.frontends)
        self.intervals.inc()
        for pool, n in desired.items():
            self.desired.labels(pool).set(n)
            state = fleet.pool(pool)
            for label, count in (("ready", state.ready), ("starting", state.starting), ("draining", state.draining)):
                self.workers.labels(pool, label).set(count)
