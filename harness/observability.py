"""The dashboard of deploy/observability/ against a real Prometheus scraping a small fleet: the test
(tests/e2e/test_dashboard_prometheus.py) runs every query of the dashboard against it, and
scripts/plot_dashboard.py draws them (docs/img/dashboard.png).

The fleet: a frontend (``--router-mode kv --migration-limit 1``) and two mocker workers with their status
servers (``DYN_SYSTEM_PORT``), on file discovery; Prometheus scrapes the three every second.  Traffic: chat
streams from a few threads with a shared system prompt (KV hits), and one long stream whose worker is
killed -9 mid-way (a migration).  Prometheus is the Debian package's binary (``apt-get install
prometheus``; scripts/setup-prometheus.sh).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Self

import httpx

from harness.proc import ChildProcess, DynamoRun, DynamoWorker, free_port
from harness.tiny_model import build_tiny_hf_model
from harness.wait import wait_until

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "observability" / "grafana" / "dashboard.json"
PLANNER_PREFIX = "dynamo_planner_"  # the planner's series: not run by the fleet here


@dataclass(frozen=True)
class Target:
    panel: str
    expr: str
    legend: str

    @property
    def planner(self) -> bool:
        return PLANNER_PREFIX in self.expr


def dashboard_targets(path: Path = DASHBOARD) -> list[Target]:
    """Every query of the dashboard, in panel order."""
    doc = json.loads(path.read_text())
    return [Target(p["title"], t["expr"], t.get("legendFormat", "")) for p in doc["panels"] for t in p["targets"]]


def promql(expr: str, rate_interval: str) -> str:
    """A Grafana query as Prometheus takes it: its range variables replaced."""
    for var in ("$__rate_interval", "$__interval", "$__range"):
        expr = expr.replace(var, rate_interval)
    return expr


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def scrape_config(jobs: dict[str, list[str]], interval: str = "1s") -> str:
    """A prometheus.yml scraping each job's ``host:port`` targets every ``interval``."""
    lines = ["global:", f"  scrape_interval: {interval}", f"  evaluation_interval: {interval}", "scrape_configs:"]
    for job, targets in jobs.items():
        lines += [f"  - job_name: {job}", "    static_configs:", f"      - targets: {json.dumps(targets)}"]
    return "\n".join(lines) + "\n"


class Prometheus(ChildProcess):
    """``prometheus`` on a free loopback port with ``config``; its TSDB in a temporary folder."""

    def __init__(self, config: str, startup_timeout: float = 30.0) -> None:
        super().__init__(None, 0, startup_timeout)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="prometheus-")
        self.config_path = Path(self._dir.name) / "prometheus.yml"
        self.config_path.write_text(config)

    def command(self) -> list[str]:
        binary = prometheus_binary()
        if binary is None:
            raise RuntimeError("prometheus is not installed (scripts/setup-prometheus.sh)")
        return [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self._dir.name}/data",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]

    def _name(self) -> str:
        return "prometheus"

    def start(self) -> Self:
        self._spawn()
        self._wait_serving(self._ready, self.startup_timeout)
        return self

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout: float = 15.0) -> int | None:
        try:
            return super().stop(timeout)
        finally:
            self._dir.cleanup()

    def _api(self, path: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        reply = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10).json()
        if reply.get("status") != "success":
            raise ValueError(f"{params.get('query')!r}: {reply.get('errorType')}: {reply.get('error')}")
        result: list[dict[str, Any]] = reply["data"]["result"]
        return result

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        """The instant vector of ``expr`` at ``at`` (unix seconds)."""
        return self._api("query", {"query": expr, "time": f"{at:.3f}"})

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self._api("query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": step})

    def scraped_up_to(self, job: str, at: float) -> bool:
        """Every target of ``job`` was scraped after ``at`` (their ``up`` sample is newer)."""
        result = self.query(f'timestamp(up{{job="{job}"}})', time.time())
        return bool(result) and all(float(r["value"][1]) > at for r in result)


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    values = [float(r["value"][1]) for r in result if "value" in r]
    values += [float(v) for r in result for _, v in r.get("values", [])]
    return [v for v in values if not math.isnan(v) and not math.isinf(v)]


@dataclass
class FleetRun:
    prometheus: Prometheus
    frontend: DynamoRun
    started: float  # unix seconds: the traffic's start and end
    ended: float
    migrated: bool  # the long stream finished on the other worker


SYSTEM_PROMPT = "You are a helpful assistant. " * 12  # shared by every request: its blocks are KV hits


def _traffic(url: str, until: float, seed: int, errors: list[str]) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=60) as client:
        while time.monotonic() < until:
            body = {"model": "fleet", "stream": True, "max_tokens": rng.randint(8, 40),
                    "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                 {"role": "user", "content": f"question {rng.randint(0, 9)} " * rng.randint(1, 20)}]}
            try:
                with client.stream("POST", url + "/v1/chat/completions", json=body) as reply:
                    for _ in reply.iter_lines():
                        pass
            except httpx.HTTPError as e:  # a stream on the worker killed for the migration may fail
                errors.append(str(e))


def _migrate(frontend: DynamoRun, workers: list[DynamoWorker], ports: list[int]) -> bool:
    """A long stream whose worker is killed -9 after 5 chunks; whether it still ended with its length."""
    def inflight(port: int) -> float:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith('dynamo_component_inflight_requests{') and 'dynamo_endpoint="generate"' in line)

    chunks, killed, finish = 0, False, None
    body = {"model": "fleet", "stream": True, "max_tokens": 150, "ignore_eos": True,
            "messages": [{"role": "user", "content": "tell a long story"}]}
    with httpx.stream("POST", frontend.base_url + "/v1/chat/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks += 1
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                finish = choice.get("finish_reason") or finish
            if chunks == 5 and not killed:
                # the worker serving it: the only one with a generate request in flight (others are idle now)
                busy = [w for w, p in zip(workers, ports, strict=True) if inflight(p) > 0]
                if len(busy) == 1:
                    busy[0].kill()
                    killed = True
    return killed and finish == "length"


@contextmanager
def observed_fleet(seconds: float = 8.0, threads: int = 3) -> Iterator[FleetRun]:
    """The fleet under ``seconds`` of traffic, then a migration, with Prometheus having scraped it all."""
    with tempfile.TemporaryDirectory(prefix="observed-fleet-") as tmp:
        root = Path(tmp)
        model = build_tiny_hf_model(root / "model")
        store = root / "store"
        store.mkdir()
        env = {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(store), "ETCD_ENDPOINTS": "", "NATS_SERVER": "",
               "DYN_LOG": "warn"}
        # status servers on port 0: each worker's is read from its log (no port picked here and raced for)
        workers = [DynamoWorker("in=dyn://fleet.backend.generate", "out=mocker", str(model), "--model-name", "fleet",
                                env={**env, "DYN_SYSTEM_PORT": "0", "DYN_LOG": "info"}) for _ in range(2)]
        for w in workers:
            w.start(wait=False)
        try:
            for w in workers:
                w.wait_ready()
            ports = [w.system_port() for w in workers]
            # info: the harness reads the port the frontend bound from its start-up line
            with DynamoRun("out=dyn", "--router-mode", "kv", "--migration-limit", "1",
                           env={**env, "DYN_LOG": "info"}) as frontend:
                wait_until(lambda: len(httpx.get(frontend.base_url + "/health").json().get("instances", [])) >= 2,
                           20, "both workers on the frontend")
                config = scrape_config({"dynamo-frontend": [f"127.0.0.1:{frontend.port}"],
                                        "dynamo-workers": [f"127.0.0.1:{p}" for p in ports]})
                with Prometheus(config) as prom:
                    wait_until(lambda: prom.scraped_up_to("dynamo-workers", time.time() - 0.5), 20,
                               "Prometheus scraping the fleet")
                    started = time.time()
                    errors: list[str] = []
                    until = time.monotonic() + seconds
                    pool = [threading.Thread(target=_traffic, args=(frontend.base_url, until, i, errors), daemon=True)
                            for i in range(threads)]
                    for t in pool:
                        t.start()
                    for t in pool:
                        t.join()
                    migrated = _migrate(frontend, workers, ports)
                    ended = time.time()
                    wait_until(lambda: prom.scraped_up_to("dynamo-frontend", ended + 1), 20,
                               "Prometheus scraping past the traffic's end")
                    yield FleetRun(prom, frontend, started, ended, migrated)
        finally:
            for w in workers:
                w.kill()
