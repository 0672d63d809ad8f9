"""The one callback shape used to get events out of the router and the mocker, whatever the transport.

A publisher is ``callable(payload: dict)``.  It may be a plain function (append to a list, put on a
queue) or return an awaitable (``nats.publish(...)``); awaitables are run as background tasks on the
running loop, in order of creation, and their failures are logged, never raised into the caller.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Callable

log = logging.getLogger(__name__)

Publisher = Callable[[dict[str, Any]], Any]

_pending: set[asyncio.Future[Any]] = set()


def emit(publisher: Publisher | None, payload: dict[str, Any], what: str = "event") -> None:
    if publisher is None:
        return
    try:
        result = publisher(payload)
    except Exception:
        log.exception("publishing %s failed", what)
        return
    if inspect.isawaitable(result):
        try:
            fut = asyncio.ensure_future(result)
        except RuntimeError:  # no running loop: nothing can await it
            if inspect.iscoroutine(result):
                result.close()
            log.warning("publishing %s: the publisher returned an awaitable outside an event loop", what)
            return
        _pending.add(fut)
        fut.add_done_callback(_done(what))


def _done(what: str) -> Callable[[asyncio.Future[Any]], None]:
    def callback(fut: asyncio.Future[Any]) -> None:
        _pending.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("publishing %s failed: %s", what, fut.exception())

    return callback
