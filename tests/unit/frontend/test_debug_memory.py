"""``/debug/memory`` exists only when DYN_DEBUG_MEMORY asks for it, and reports the structures that
registered with dynamo.bounds, by name, while their owners live."""

from __future__ import annotations

import asyncio
import gc
import json

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from dynamo.bounds import sizes, track
from dynamo.frontend.http.debug_memory import DebugMemoryRoute


def paths(app: web.Application) -> set[str]:
    return {r.resource.canonical for r in app.router.routes() if r.resource is not None}


def test_the_route_is_off_by_default(monkeypatch):
    monkeypatch.delenv("DYN_DEBUG_MEMORY", raising=False)
    app = web.Application()
    DebugMemoryRoute().install(app.router)
    assert "/debug/memory" not in paths(app)
    monkeypatch.setenv("DYN_DEBUG_MEMORY", "0")
    DebugMemoryRoute().install(app.router)
    assert "/debug/memory" not in paths(app)


def test_it_reports_tracked_structures_while_their_owner_lives(monkeypatch):
    class Owner:
        def __init__(self) -> None:
            self.items = [1, 2, 3]

    owner = Owner()
    track("test_owner_items", owner, lambda o: len(o.items))
    monkeypatch.setenv("DYN_DEBUG_MEMORY", "1")
    app = web.Application()
    route = DebugMemoryRoute()
    route.install(app.router)
    assert "/debug/memory" in paths(app)
    resp = asyncio.run(route.handle(make_mocked_request("GET", "/debug/memory?gc=0")))
    body = json.loads(resp.body)
    assert body["structures"]["test_owner_items"] == 3
    assert body["objects_total"] > 0 and body["rss_mb"] > 0
    del owner
    gc.collect()
    assert "test_owner_items" not in sizes()
