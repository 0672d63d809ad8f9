"""The worker side of disaggregated serving, for engines that can export and import a sequence's state.

:class:`DisaggWorkerEngine` wraps such a core engine (llamacpp) on a worker started with
``--disaggregation-mode prefill|decode``:

* **prefill**: every request is run for one token with ``StateIO(export=True)``; the engine puts the
  sequence's state (its KV after the prompt) in ``io.state``; the wrapper keeps it in an
  :class:`~.transfer.ExportStore`, serves it from a :class:`~.transfer.TransferServer` and answers the token
  with the ticket in ``disaggregated_params``.
* **decode**: a request carrying a ticket has its state pulled from the prefill worker (off the engine's
  thread, on the event loop) and handed to the engine with ``StateIO(state=..., first_token=...)``; the
  engine loads it into a slot and continues from the first token.  A ticket that does not fit the
  prompt, a failed or damaged transfer, or a state the engine refuses means a local prefill: the request
  is answered either way.

The engine's contract: ``generate(request, context, state_io=StateIO(...))``; with ``export`` it sets
``state_io.state`` before yielding its first token; with ``state`` it sets ``state_io.imported`` to
whether the state was loaded (False: it prefilled the prompt itself).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from dynamo.errors import EngineError
from dynamo.llm.engine import Context, close_engine, phase_report
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest
from dynamo.runtime.fleet_auth import FleetAuth

from .mode import DisaggregationMode
from .transfer import DEFAULT_MAX_BYTES, ExportStore, Ticket, TransferError, TransferServer, pull

log = logging.getLogger(__name__)


@dataclass
class StateIO:
    """What a request asks of the engine about its sequence state, and what the engine did."""

    export: bool = False  # prefill worker: export the state after the prompt
    state: bytes | None = None  # in: the state to load (decode); out: the exported state (prefill)
    first_token: int | None = None  # with an imported state: the token the prefill worker sampled
    imported: bool = False  # out: the state was loaded (False: prefilled locally)


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class DisaggWorkerEngine:
    """See the module docstring.  Everything else (attach, load metrics, close) is the wrapped engine's."""

    kind = "core"

    def __init__(self, engine: Any, mode: DisaggregationMode | str, *, store: ExportStore | None = None,
                 host: str | None = None, pull_timeout: float | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                 advertise: str | None = None, auth: FleetAuth | None = None):
        self.engine = engine
        self.auth = auth  # the fleet secret's keys: both ends of a KV transfer prove it first (None: none)
        self.mode = DisaggregationMode.parse(mode)
        # DYN_KV_TRANSFER_TIMEOUT (seconds, default 30) bounds a pull; DYN_KV_EXPORT_TTL (default 60) how
        # long an exported state waits for its decode worker; DYN_KV_EXPORT_MAX_MB (default 1024) the store
        self.pull_timeout = pull_timeout if pull_timeout is not None else _env_float("DYN_KV_TRANSFER_TIMEOUT", 30.0)
        self.max_bytes = max_bytes
        self.store = store or ExportStore(max_bytes=int(_env_float("DYN_KV_EXPORT_MAX_MB", 1024) * (1 << 20)),
                                          ttl=_env_float("DYN_KV_EXPORT_TTL", 60.0))
        self.server: TransferServer | None = None
        self._host = host  # where the transfer server binds (the runtime's listen hosts: loopback on one machine)
        self._advertise = advertise  # the address decode workers dial (None: the one it binds)
        self.imported = 0
        self.fallbacks = 0

    def __getattr__(self, name: str) -> Any:  # attach, load_metrics, runtime_config, ...
        return getattr(self.engine, name)

    async def start(self) -> None:
        """Start the transfer server (prefill workers); the wrapped engine is started by its owner."""
        if self.mode is DisaggregationMode.PREFILL and self.server is None:
            from dynamo.runtime.tcp import advertise_host

            host = advertise_host(self._host or os.environ.get("DYN_TCP_RPC_HOST"))
            self.server = TransferServer(self.store, host=host, advertise=self._advertise, auth=self.auth)
            await self.server.start()
            log.info("KV transfer server at %s", self.server.address)

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None
        await close_engine(self.engine)

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EngineOutput]:
        if self.mode is DisaggregationMode.PREFILL:
            async for out in self._prefill(request, context):
                yield out
            return
        io = await self._fetch(request, context)
        gen = self.engine.generate(request, context, state_io=io) if io is not None else self.engine.generate(request, context)
        try:
            first = True
            async for out in gen:
                if first and io is not None:
                    first = False
                    if io.imported:
                        self.imported += 1
                    else:
                        self.fallbacks += 1
                        log.warning("request %s: the engine could not load the transferred KV state; prefilled "
                                    "locally", context.id)
                yield out
        finally:
            await gen.aclose()

    async def _prefill(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EngineOutput]:
        if self.server is None:
            raise EngineError("the KV transfer server is not started")
        request.stop_conditions.max_tokens = 1
        io = StateIO(export=True)
        n_tokens = len(request.token_ids)
        gen = self.engine.generate(request, context, state_io=io)
        try:
            async for out in gen:
                if out.token_ids and io.state is not None:
                    try:
                        key, digest = self.store.put(io.state)
                    except TransferError as e:  # too big for the store: no ticket, the frontend falls back
                        raise EngineError(str(e)) from None
                    out.disaggregated_params = Ticket(self.server.address, key, len(io.state), digest, n_tokens,
                                                      out.token_ids[0]).to_dict()
                    log.debug("request %s: KV state of %d tokens exported (%d bytes)", context.id, n_tokens,
                              len(io.state))
                    io.state = None
                    out.finish_reason = out.finish_reason or "length"
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            await gen.aclose()

    async def _fetch(self, request: PreprocessedRequest, context: Context) -> StateIO | None:
        params = request.disaggregated_params
        if not params:
            return None
        report = phase_report(context)  # a traced request: the pull is its kv_transfer span
        started = time.time_ns()
        try:
            ticket = Ticket.from_dict(params)
            if ticket.n_tokens != len(request.token_ids):
                # a migrated request carries its generated tokens too: the state no longer matches
                raise TransferError(f"the state covers {ticket.n_tokens} tokens, the prompt has "
                                    f"{len(request.token_ids)}")
            t0 = time.perf_counter()
            data = await pull(ticket, timeout=self.pull_timeout, max_bytes=self.max_bytes, auth=self.auth)
            log.debug("request %s: KV state of %d tokens, %d bytes, pulled in %.1f ms", context.id, ticket.n_tokens,
                      len(data), 1e3 * (time.perf_counter() - t0))
        except TransferError as e:
            self.fallbacks += 1
            log.warning("request %s: no KV state from the prefill worker (%s); prefilling locally", context.id, e)
            if report is not None:
                report.kv_transfer(started, 0, 0, None, str(e))
            return None
        if report is not None:  # the state is one blob (no blocks)
            report.kv_transfer(started, len(data), ticket.n_tokens, None)
        return StateIO(state=data, first_token=ticket.first_token)
