"""The worker's own status server: ``/health``, ``/live`` and ``/metrics`` on ``DYN_SYSTEM_PORT``.

Orchestrators probe workers here (readiness on ``/health``, liveness on ``/live``) and Prometheus scrapes
the ``dynamo_component_*`` series (:mod:`dynamo.runtime.component_metrics`).  It belongs to the
DistributedRuntime, so ``dynamo-run in=dyn://`` workers and Python workers written with
``dynamo.runtime`` get it alike, and it runs before any endpoint serves (``/health`` says 503 while a
model loads).  Settings: :class:`dynamo.runtime.config.SystemSettings`; docs/metrics.md.

Readiness: 200 ``{"status": "ready", ...}`` once every endpoint this process serves (or those named in
``DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS``) is registered and taking requests; 503 ``"notready"`` before
that, and again from the moment a graceful shutdown starts (the endpoints drain).  ``/live`` is 200
while the process runs, so a liveness probe does not restart a worker that is still loading its model.
"""

from __future__ import annotations

import logging
import time

import orjson
from aiohttp import web
from prometheus_client import generate_latest

from .component_metrics import ComponentMetrics, EndpointMetrics
from .config import SystemSettings
from .errors import RuntimeConfigError

log = logging.getLogger(__name__)

READY = "ready"
NOT_READY = "notready"


class SystemStatusServer:
    """Health of this process's endpoints and their metrics, over HTTP."""

    def __init__(self, settings: SystemSettings) -> None:
        self.settings = settings
        self.metrics = ComponentMetrics()
        self.endpoints: dict[str, str] = {}  # endpoint name -> READY / NOT_READY
        self.draining = False
        self.port: int | None = None
        self.host = settings.host or "0.0.0.0"  # where it listens (the runtime resolves the default)
        self._started = time.monotonic()
        self._runner: web.AppRunner | None = None

    # -- what the runtime tells it
    def endpoint_metrics(self, namespace: str, component: str, endpoint: str, worker_id: str = "") -> EndpointMetrics:
        """``worker_id``: this process's instance id in hex (1.x's label on every series)."""
        return self.metrics.endpoint(namespace, component, endpoint, worker_id)

    def set_endpoint(self, name: str, ready: bool) -> None:
        self.endpoints[name] = READY if ready else NOT_READY

    def is_ready(self) -> bool:
        if self.draining or not self.endpoints:
            return False
        required = self.settings.required_endpoints
        names = required if required else list(self.endpoints)
        return all(self.endpoints.get(n) == READY for n in names)

    # -- HTTP
    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(self.settings.health_path, self._health)
        app.router.add_get(self.settings.live_path, self._live)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        self.host = self.settings.host or "0.0.0.0"
        site = web.TCPSite(self._runner, self.host, self.settings.port, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            self._runner = None
            raise RuntimeConfigError(
                f"cannot start the system status server on {self.host}:{self.settings.port} "
                f"(DYN_SYSTEM_HOST/DYN_SYSTEM_PORT): {e.strerror or e}") from None
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else self.settings.port
        log.info("system status server listening on http://%s:%d (%s, %s, /metrics)",
                 self.host, self.port, self.settings.health_path, self.settings.live_path)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _body(self, status: str) -> dict:
        return {"status": status, "uptime": round(time.monotonic() - self._started, 3),
                "endpoints": dict(self.endpoints)}

    async def _health(self, request: web.Request) -> web.Response:
        ready = self.is_ready()
        return _json(self._body(READY if ready else NOT_READY), 200 if ready else 503)

    async def _live(self, request: web.Request) -> web.Response:
        return _json({"status": "live", "message": "Service is live",
                      "uptime": round(time.monotonic() - self._started, 3)}, 200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def _json(data: dict, status: int) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")
