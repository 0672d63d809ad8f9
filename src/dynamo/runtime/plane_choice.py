"""Which request and event planes a process uses when nobody said, and a warning when two processes of
one fleet chose differently.

The rule, the same shape as discovery's (:mod:`.discovery_choice`): what was asked
(``--request-plane`` / ``--event-plane``, ``DYN_REQUEST_PLANE`` / ``DYN_EVENT_PLANE``, the settings)
wins; else NATS when ``NATS_SERVER`` is set (then a NATS that does not answer is an error, as before)
or a NATS answers on the default address within a second; else the TCP request plane and the ZMQ
event plane, which need no server. A static runtime (no discovery to find a listener or a publisher
in) uses NATS. Processes on TCP and ZMQ still connect to a NATS that answers, so that they reach
workers that serve over NATS.

A rule that looks at what is running can give two processes different answers (one started before
nats-server, one after). Requests still meet when the client has NATS (it reaches TCP workers
directly and NATS workers through NATS); events never do: a frontend hearing NATS while its workers
publish on ZMQ routes blind. So every process writes ``planes/<instance>`` (its planes, whether it has
NATS) under its lease and watches ``planes/``, and says once, in one line, when another process's
planes cannot meet its own.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import orjson
from nats.aio.client import Client as NatsClient

from .config import RuntimeSettings
from .discovery import DiscoveryWatch
from .errors import RuntimeConnectionError
from .kv_store import KeyValueStore
from .names import lease_hex
from .nats_conn import connect_nats, redact_url

log = logging.getLogger(__name__)

NATS_PROBE_TIMEOUT = 1.0  # a NATS that does not answer within this is taken as absent when it is optional
RECORDS = "planes/"


@dataclass(slots=True)
class PlaneChoice:
    requests: str  # "nats" or "tcp"
    events: str  # "nats" or "zmq"
    nats: NatsClient | None  # None: no NATS server in use at all
    why: str  # for the start-up line: what decided, or where NATS is


async def _try_nats(settings: RuntimeSettings) -> NatsClient | None:
    try:
        return await connect_nats(settings.nats, name=f"dynamo-{lease_hex(0)}", timeout=NATS_PROBE_TIMEOUT)
    except RuntimeConnectionError as exc:
        log.debug("no NATS: %s", exc)
        return None


async def choose_planes(settings: RuntimeSettings, static: bool) -> PlaneChoice:
    requests, events = settings.request_plane, settings.event_plane
    if static:
        requests, events = requests or "nats", events or "nats"
    server = redact_url(settings.nats.server)
    nc: NatsClient | None = None
    if requests is None or events is None:
        if settings.nats.explicit:
            nc = await connect_nats(settings.nats, name=f"dynamo-{lease_hex(0)}")  # given: its error if down
            why = f"NATS_SERVER={server}"
        else:
            nc = await _try_nats(settings)
            why = f"NATS answers at {server}" if nc is not None else f"no NATS at {server}"
        requests = requests or ("nats" if nc is not None else "tcp")
        events = events or ("nats" if nc is not None else "zmq")
    else:
        why = "as asked"
    if nc is None:
        if "nats" in (requests, events):
            nc = await connect_nats(settings.nats, name=f"dynamo-{lease_hex(0)}")
        else:  # TCP and ZMQ: a NATS that answers still carries requests to workers that serve over NATS
            nc = await _try_nats(settings)
    return PlaneChoice(requests, events, nc, why)


class PlaneCheck:
    """This process's planes in discovery, and one warning line per kind of disagreement seen there."""

    def __init__(self, store: KeyValueStore, instance_id: int, choice: PlaneChoice) -> None:
        self.store = store
        self.me = lease_hex(instance_id)
        self.mine = {"request_plane": choice.requests, "event_plane": choice.events,
                     "nats": choice.nats is not None}
        self.warned: set[str] = set()
        self._task: asyncio.Task | None = None
        self._watch: DiscoveryWatch | None = None

    async def start(self) -> None:
        await self.store.put(RECORDS + self.me, orjson.dumps(self.mine), lease=True)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="plane-check")

    async def _run(self) -> None:
        try:
            self._watch = self.store.watch_prefix(RECORDS)
            async for ev in self._watch:
                if ev.kind == "put" and ev.key != RECORDS + self.me:
                    self.check(ev.key[len(RECORDS):], ev.value)
        except Exception as exc:  # noqa: BLE001 - a diagnostic must never take the process down
            log.debug("plane check stopped: %s", exc)

    def check(self, other: str, value: bytes) -> None:
        try:
            theirs = orjson.loads(value)
            their_events, their_requests = theirs["event_plane"], theirs["request_plane"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return
        mine = self.mine
        # a subscriber follows each publisher where its record says (a ZMQ socket anyone can reach, or a NATS
        # subject): only a NATS publisher and a process without NATS never meet
        deaf = (their_events == "nats" and not mine["nats"]) or (
            mine["event_plane"] == "nats" and not theirs.get("nats", True))
        if their_events != mine["event_plane"] and deaf and "events" not in self.warned:
            self.warned.add("events")
            log.warning("event plane: this process uses %s and instance %s uses %s, and one of them has no NATS: "
                        "the events published on NATS (KV events, load metrics) never reach the other; give "
                        "every process the same --event-plane (or DYN_EVENT_PLANE), or NATS_SERVER",
                        mine["event_plane"], other, their_events)
        unreachable = (their_requests == "nats" and not mine["nats"]) or (
            mine["request_plane"] == "nats" and not theirs.get("nats", True))
        if unreachable and "requests" not in self.warned:
            self.warned.add("requests")
            log.warning("request plane: instance %s and this process cannot reach each other (one serves over "
                        "NATS, the other has no NATS); give every process the same --request-plane "
                        "(or DYN_REQUEST_PLANE), or NATS_SERVER", other)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._watch is not None:
            await self._watch.close()
