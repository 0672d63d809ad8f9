"""``out=mocker``: a simulated vLLM worker with no weights, as Dynamo's mocker.

It schedules, caches and times requests like a vLLM engine (scheduler.py, kv_manager.py) and streams
random tokens from the model's vocabulary, so the serving path and, above all, KV-aware routing can be
exercised and benchmarked at scale on a laptop.

Wiring (all optional, transport-free):

* ``engine.worker_id``: the id put in KV events and metrics (the worker's instance / lease id);
* ``engine.publish_kv_event(event)``: called with each KV event, already wrapped
  ``{"worker_id", "event": {"event_id", "data": {"stored"|"removed": ...}}}`` (only with prefix caching);
* ``engine.publish_metrics(msg)``: called with ``{"worker_id", "data": <ForwardPassMetrics>}`` after a
  step that changed a rank's active blocks or waiting count;
* ``engine.load_metrics(dp_rank=0)``: the current ForwardPassMetrics of a rank (the ``load_metrics``
  endpoint's stats payload).

Requests: ``max_tokens`` absent means the rest of the context window, at most
``DEFAULT_MAX_TOKENS``; exactly ``max_tokens`` tokens are produced, the last item carrying
``finish_reason: "length"``.  A stopped context ends the stream with ``"cancelled"``.  The data-parallel
rank comes from an annotation ``dp_rank:<n>``; without one, the rank holding the longest cached prefix
of the prompt, then the least busy rank.

Disaggregation (``mode``, from ``--disaggregation-mode``): a ``prefill`` mocker runs each request's prefill
only and answers one token whose ``disaggregated_params`` is a simulated transfer ticket (no state behind
it: address ``mocker:``, size ``kv_bytes_per_token`` times the prompt); a ``decode`` (or ``agg``) mocker
given such a ticket waits the modelled transfer time (``kv_transfer_latency_ms`` plus size over
``kv_transfer_bandwidth_gbps``, divided by ``speedup_ratio``), then decodes without computing the prompt,
its first token being the prefill worker's.  A ticket it cannot use means a local prefill, as on a real
worker.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import time
from typing import Any, AsyncIterator, Iterable

from dynamo.disagg.transfer import Ticket, TransferError
from dynamo.engines.mocker.args import MockerArgs
from dynamo.engines.mocker.scheduler import MockRequest, Scheduler
from dynamo.errors import EngineError, RequestError, UserError
from dynamo.kv.events import removed_data, stored_data
from dynamo.kv.hashing import compute_hashes
from dynamo.kv.publisher import Publisher, emit
from dynamo.kv.worker_state import WorkerKvState
from dynamo.llm.engine import PhaseReport, phase_report
from dynamo.llm.model_card import ModelCard
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest
from dynamo.run_config import RunConfig

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 8192


class MockerEngine:
    kind = "core"

    def __init__(self, args: MockerArgs | dict[str, Any] | None = None, *, vocab_size: int,
                 special_ids: Iterable[int] = (), context_length: int = 0, worker_id: int = 0,
                 publish_kv_event: Publisher | None = None, publish_metrics: Publisher | None = None,
                 seed: int | None = None, mode: str = "agg"):
        self.args = args if isinstance(args, MockerArgs) else MockerArgs.from_dict(args)
        self.args.check()
        self.vocab_size = int(vocab_size)
        self.special_ids = frozenset(int(i) for i in special_ids)
        if self.vocab_size - len({i for i in self.special_ids if 0 <= i < self.vocab_size}) < 1:
            raise UserError("the mocker needs a vocabulary with at least one non-special token")
        self.context_length = context_length
        self.worker_id = worker_id
        self.publish_kv_event = publish_kv_event
        self.publish_metrics = publish_metrics
        if mode not in ("agg", "prefill", "decode"):
            raise UserError(f"mocker: unknown disaggregation mode {mode!r}")
        self.mode = mode
        self.imported = 0  # requests decoded from a prefill worker's (simulated) KV state
        self.rng = random.Random(seed)
        self.kv_state = WorkerKvState(worker_id, publish_kv_event, first_event_id=self.rng.getrandbits(32))
        self._request_ids = itertools.count()
        self.schedulers = [
            Scheduler(self.args, dp_rank=r, seed=self.rng.getrandbits(64),
                      on_stored=self._on_stored, on_removed=self._on_removed, on_metrics=self._on_metrics)
            for r in range(self.args.dp_size)
        ]
        self._started = False

    def attach(self, worker_id: int, *, publish_kv_event: Publisher | None = None,
               publish_metrics: Publisher | None = None) -> None:
        """Set the worker id and the publishers in one call (before serving requests)."""
        self.worker_id = worker_id
        self.publish_kv_event = publish_kv_event
        self.publish_metrics = publish_metrics
        self.kv_state.worker_id = worker_id
        self.kv_state.publish = publish_kv_event

    @property
    def publishes_kv_events(self) -> bool:
        """Whether routers can follow this worker's cache through its KV events (prefix caching on)."""
        return self.args.enable_prefix_caching

    def kv_state_dump(self) -> dict[str, Any]:
        """Every cached block, for a router that starts late (the recovery query)."""
        return self.kv_state.dump()

    @property
    def capacity(self) -> int:
        """Sequences the simulated engine runs at once: a worker's default --max-inflight."""
        return self.args.max_num_seqs * self.args.dp_size

    @property
    def runtime_config(self) -> dict[str, Any]:
        """What a router may want to know about this worker's capacity (per data-parallel rank)."""
        return {"total_kv_blocks": self.args.num_gpu_blocks, "max_num_seqs": self.args.max_num_seqs,
                "max_num_batched_tokens": self.args.max_num_batched_tokens,
                "kv_cache_block_size": self.args.block_size, "dp_size": self.args.dp_size}

    # -- life cycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        if not self._started:
            self._started = True
            for s in self.schedulers:
                s.start()
            log.info("mocker: %s", ", ".join(f"{k}={v}" for k, v in self.args.to_dict().items()))

    async def close(self) -> None:
        for s in self.schedulers:
            await s.close()
        self._started = False

    # -- requests ------------------------------------------------------------------------------
    async def generate(self, request: PreprocessedRequest, context: Any) -> AsyncIterator[EngineOutput]:
        if not self._started:
            await self.start()
        prompt = list(request.token_ids)
        max_tokens = self._max_tokens(request, len(prompt))
        if self.mode == "prefill":
            max_tokens = 1
        if max_tokens <= 0:
            yield EngineOutput(finish_reason="length")
            return
        report = phase_report(context)  # a traced request (None otherwise): admission and transfer go there
        ticket = await self._import(request, prompt, report) if self.mode != "prefill" else None
        sched = self.schedulers[self._dp_rank(request, prompt)]
        avoid = self.special_ids | frozenset(request.eos_token_ids or ()) | frozenset(
            request.stop_conditions.stop_token_ids_hidden or ())
        next_token = self._token_source(avoid)
        if ticket is not None:
            next_token = _first_then(ticket.first_token, next_token)
        req = MockRequest(
            request_id=str(getattr(context, "id", None) or next(self._request_ids)),
            tokens=prompt, prompt_len=len(prompt), max_tokens=max_tokens,
            next_token=next_token, ctx=context, imported=ticket is not None,
            on_admit=report.admitted if report is not None else None,
        )
        sched.enqueue(req)
        try:
            while True:
                item = await req.out.get()
                if isinstance(item, BaseException):
                    raise item
                if self.mode == "prefill" and item.token_ids:
                    item.disaggregated_params = Ticket(
                        address="mocker:", key=os.urandom(8).hex(), size=req.prompt_len * self.args.kv_bytes_per_token,
                        sha256="", n_tokens=req.prompt_len, first_token=item.token_ids[0]).to_dict()
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            req.cancelled = True  # a no-op if it finished; otherwise the scheduler drops it next step
            sched.wake()

    async def _import(self, request: PreprocessedRequest, prompt: list[int],
                      report: PhaseReport | None) -> Ticket | None:
        """The simulated KV transfer of a disaggregated request: the ticket, after the modelled time."""
        if not request.disaggregated_params:
            return None
        started = time.time_ns()
        try:
            ticket = Ticket.from_dict(request.disaggregated_params)
            if not ticket.address.startswith("mocker:"):
                raise TransferError(f"the ticket names {ticket.address}, not a mocker")
            if ticket.n_tokens != len(prompt):
                raise TransferError(f"the ticket covers {ticket.n_tokens} tokens, the prompt has {len(prompt)}")
        except TransferError as e:
            log.warning("mocker: unusable KV ticket (%s); prefilling locally", e)
            if report is not None:
                report.kv_transfer(started, 0, 0, None, str(e))
            return None
        a = self.args
        seconds = (a.kv_transfer_latency_ms / 1e3 + ticket.size / (a.kv_transfer_bandwidth_gbps * 1e9)) / a.speedup_ratio
        await asyncio.sleep(seconds)
        if report is not None:
            report.kv_transfer(started, ticket.size, ticket.n_tokens, -(-ticket.n_tokens // a.block_size))
        self.imported += 1
        log.debug("mocker: imported the KV state of %d tokens (%d bytes) in a simulated %.2f ms", ticket.n_tokens,
                  ticket.size, seconds * 1e3)
        return ticket

    def _max_tokens(self, request: PreprocessedRequest, prompt_len: int) -> int:
        mt = request.stop_conditions.max_tokens
        room = self.context_length - prompt_len if self.context_length else None
        if room is not None and room <= 0:
            raise RequestError(f"the prompt has {prompt_len} tokens, which fills the model's context "
                               f"length of {self.context_length}", param="messages")
        if mt is None:
            return min(room, DEFAULT_MAX_TOKENS) if room is not None else DEFAULT_MAX_TOKENS
        return mt

    def _dp_rank(self, request: PreprocessedRequest, prompt: list[int]) -> int:
        n = len(self.schedulers)
        for a in request.annotations or ():
            if isinstance(a, str) and a.startswith("dp_rank:"):
                try:
                    rank = int(a.split(":", 1)[1])
                except ValueError:
                    raise RequestError(f"bad annotation {a!r}: dp_rank must be an integer") from None
                if not 0 <= rank < n:
                    raise RequestError(f"dp_rank {rank} is out of range: this worker has dp_size {n}")
                return rank
        if n == 1:
            return 0
        # the rank that already caches most of this prompt, then the least busy one
        _, seq = compute_hashes(prompt, self.args.block_size)

        def score(r: int) -> tuple[int, int]:
            s = self.schedulers[r]
            return (-s.kv.cached_prefix(seq), len(s.waiting) + s.num_running)

        return min(range(n), key=score)

    def _token_source(self, avoid: frozenset[int]):
        rng, vocab = self.rng, self.vocab_size

        def next_token() -> int:
            for _ in range(64):
                t = rng.randrange(vocab)
                if t not in avoid:
                    return t
            allowed = [t for t in range(vocab) if t not in avoid]  # a vocabulary that is mostly special
            if not allowed:
                raise EngineError("every token of the vocabulary is a special or stop token")
            return rng.choice(allowed)

        return next_token

    # -- events and metrics --------------------------------------------------------------------
    def _on_stored(self, parent: int | None, blocks: list[tuple[int, int]]) -> None:
        self.kv_state.send(stored_data(parent, blocks))

    def _on_removed(self, block_hashes: list[int]) -> None:
        self.kv_state.send(removed_data(block_hashes))

    def _on_metrics(self, sched: Scheduler) -> None:
        emit(self.publish_metrics, {"worker_id": self.worker_id, "data": sched.metrics()}, "load metrics")

    def load_metrics(self, dp_rank: int = 0) -> dict[str, Any]:
        """ForwardPassMetrics of one data-parallel rank (the ``load_metrics`` stats payload)."""
        return self.schedulers[dp_rank].metrics()

    def all_load_metrics(self) -> list[dict[str, Any]]:
        return [s.metrics() for s in self.schedulers]


def create_mocker(cfg: RunConfig, card: ModelCard) -> MockerEngine:
    """The ``out=mocker`` factory: arguments from ``--extra-engine-args``, vocabulary from the card."""
    from dynamo.engines.engine_args import engine_args
    from dynamo.llm.tokenizer import Tokenizer

    if not card.has_tokenizer:
        raise UserError("out=mocker needs a tokenizer for the frontend's pre-processing: pass --model-path "
                        "<a Hugging Face folder or repo id> (no weights are loaded)")
    raw = engine_args(cfg)
    if not raw:
        log.info("out=mocker: no --extra-engine-args, using the defaults")
    args = MockerArgs.from_dict(raw)
    # the router hashes with the card's block size: keep the two equal unless both were given
    flag_block_size = cfg.kv_cache_block_size
    if "block_size" in raw:
        if flag_block_size is None:
            card.kv_cache_block_size = args.block_size
        elif flag_block_size != args.block_size:
            log.warning("mocker block_size %d differs from --kv-cache-block-size %d: KV routing will not "
                        "find this worker's cached prefixes", args.block_size, flag_block_size)
    elif flag_block_size is not None:
        args = MockerArgs(**{**args.to_dict(), "block_size": flag_block_size})
    else:
        card.kv_cache_block_size = args.block_size
    assert card.tokenizer_json is not None  # has_tokenizer, checked above
    tok = Tokenizer(card.tokenizer_json)
    return MockerEngine(args, vocab_size=tok.vocab_size, special_ids=tok.special_ids,
                        context_length=card.context_length or 0,
                        mode=cfg.disaggregation_mode or "agg")


def _first_then(first: int, rest: Any) -> Any:
    """A token source that yields ``first`` once (the prefill worker's token), then ``rest()``."""
    pending = [first]

    def next_token() -> int:
        return pending.pop() if pending else rest()

    return next_token
