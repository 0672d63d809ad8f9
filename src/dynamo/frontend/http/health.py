"""The operational routes: ``GET /health`` (healthy once a model is served: a 503 before), ``GET /live``
(the process answers) and ``GET /metrics`` (Prometheus text).  None of them needs an API key (auth.py)."""

from __future__ import annotations

from aiohttp import web

from dynamo.frontend.http.body import json_response
from dynamo.frontend.http.metrics import FrontendMetrics
from dynamo.frontend.model_manager import ModelManager


class HealthRoutes:
    def __init__(self, models: ModelManager, metrics: FrontendMetrics):
        self.models = models
        self.metrics = metrics

    async def health(self, request: web.Request) -> web.Response:
        instances = self.models.instances() if self.models.instances else []
        names = self.models.names()
        if not names:
            body = {"status": "unhealthy", "message": "No models available", "models": [], "instances": instances}
            return json_response(body, status=503)
        return json_response({"status": "healthy", "models": names, "instances": instances})

    async def live(self, request: web.Request) -> web.Response:
        return json_response({"status": "live", "message": "Service is live"})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
