"""One simulated vLLM engine (one data-parallel rank): continuous batching over a :class:`KvManager`.

Queues: ``waiting`` (FIFO; pre-empted requests go back to its head), ``prefill`` (admitted, prompt not
yet computed) and ``decode`` (generating, in admission order).  Each iteration (:meth:`Scheduler.step`):

1. drop requests whose consumer left or whose context was stopped (``cancelled``);
2. **admit** from ``waiting`` while the sequence, token and block budgets hold;
3. **prefill** in FIFO order within the step's token budget (``max_num_batched_tokens`` minus one token
   per decoding sequence).  A request's blocks are all allocated on its first chunk; only the tokens
   after its cached prefix are computed.  With chunked prefill a request larger than the remaining budget
   is computed in part and stays at the head; without it, it waits for a step with room.  A finished
   prefill yields the request's first token, and the request joins ``decode``;
4. **decode**: every sequence that was decoding at the start of the step appends one random token,
   allocating a new block when it starts one and promoting its partial block to a full (cacheable) one
   when it fills it.  When a block cannot be had, the oldest decoding request is pre-empted: its blocks
   are released, and it goes back to the head of ``waiting`` keeping the tokens it has produced (it
   recomputes prompt and output on re-admission; nothing is sent twice);
5. requests that reached ``max_tokens`` release their blocks;
6. the step's simulated time is slept (divided by ``speedup_ratio``; its decode part first by
   ``decode_speedup_ratio``), then the outputs are delivered.

Times (ms), from the spec: a prefill chunk of ``n`` new tokens costs ``1.25e-6 n^2 + 0.0741 n + 26.2``;
a decode step costs ``-5.47 a^2 + 43.88 a + 19.44`` with ``a`` = active blocks / total blocks.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from dynamo.aio import cancel_and_wait
from dynamo.engines.mocker.args import MockerArgs
from dynamo.engines.mocker.kv_manager import Block, KvManager
from dynamo.errors import EngineError
from dynamo.kv.hashing import block_hash, compute_block_hashes, compute_seq_hashes, sequence_hash
from dynamo.llm.protocols.common import EngineOutput

log = logging.getLogger(__name__)

HIT_RATE_WINDOW = 1000


def prefill_time_ms(new_tokens: int) -> float:
    n = float(new_tokens)
    return 1.25e-6 * n * n + 0.0741 * n + 26.2


def decode_time_ms(active_fraction: float) -> float:
    a = active_fraction
    return -5.47 * a * a + 43.88 * a + 19.44


def _is_stopped(ctx: Any) -> bool:
    if ctx is None:
        return False
    v = getattr(ctx, "is_stopped", False)
    return bool(v()) if callable(v) else bool(v)


@dataclass(eq=False)
class MockRequest:
    """One request's state inside a scheduler."""

    request_id: str
    tokens: list[int]  # prompt, then the generated tokens
    prompt_len: int
    max_tokens: int
    next_token: Callable[[], int]
    ctx: Any = None
    out: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    generated: int = 0
    cancelled: bool = False  # the consumer is gone: drop silently
    done: bool = False
    # the complete blocks of ``tokens``: local and sequence hashes, extended as tokens are added
    local_hashes: list[int] = field(default_factory=list)
    seq_hashes: list[int] = field(default_factory=list)
    # what the request holds in the KV manager, in order; the last one may be a private partial block
    blocks: list[int] = field(default_factory=list)
    partial: int | None = None
    allocated: bool = False
    to_prefill: int = 0  # tokens still to compute in the current prefill
    cached_tokens: int = 0  # tokens found cached at the last allocation
    preemptions: int = 0
    imported: bool = False  # disaggregated decode: the prompt's KV came from a prefill worker, nothing to compute
    on_admit: Callable[[], None] | None = None  # a traced request: told when it leaves ``waiting`` (once)

    @property
    def finished(self) -> bool:
        return self.generated >= self.max_tokens


class Scheduler:
    def __init__(self, args: MockerArgs, *, dp_rank: int = 0, seed: int | None = None,
                 on_stored: Callable[[int | None, list[tuple[int, int]]], None] | None = None,
                 on_removed: Callable[[list[int]], None] | None = None,
                 on_metrics: Callable[["Scheduler"], None] | None = None,
                 sleep: Callable[[float], Any] | None = None, metrics_interval: float = 0.01):
        self.args = args
        self.dp_rank = dp_rank
        self.block_size = args.block_size
        self.caching = args.enable_prefix_caching
        self.kv = KvManager(args.num_gpu_blocks,
                            on_stored=on_stored if self.caching else None,
                            on_removed=on_removed if self.caching else None)
        self.waiting: deque[MockRequest] = deque()
        self.prefill: deque[MockRequest] = deque()
        self.decode: dict[MockRequest, None] = {}  # insertion order = admission order (oldest first)
        self.rng = random.Random(seed)
        self.on_metrics = on_metrics
        self._sleep = sleep or asyncio.sleep
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.hit_rates: deque[float] = deque(maxlen=HIT_RATE_WINDOW)
        self.steps = 0
        self.simulated_ms = 0.0
        self.preemptions = 0
        self.metrics_interval = metrics_interval
        self._last_metrics_key: tuple[int, int] | None = None
        self._last_metrics_at = float("-inf")
        self._metrics_timer: asyncio.TimerHandle | None = None

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._closing = False
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"mocker-dp{self.dp_rank}")

    async def close(self) -> None:
        self._closing = True
        if self._metrics_timer is not None:
            self._metrics_timer.cancel()
            self._metrics_timer = None
        self._wake.set()
        await cancel_and_wait(self._task)
        self._task = None
        err = EngineError("mocker engine is shutting down")
        for req in [*self.waiting, *self.prefill, *self.decode]:
            req.out.put_nowait(err)
        self.waiting.clear()
        self.prefill.clear()
        self.decode.clear()

    def enqueue(self, req: MockRequest) -> None:
        if self._task is not None and self._task.done():
            req.out.put_nowait(EngineError("mocker scheduler is not running"))
            return
        self._extend_hashes(req)
        self.waiting.append(req)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    @property
    def num_running(self) -> int:
        return len(self.prefill) + len(self.decode)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefill or self.decode)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._closing:
                if self.idle:
                    self._wake.clear()
                    self._publish_metrics()
                    await self._wake.wait()
                    continue
                started = loop.time()
                ms, deliveries = self.step()
                pause = started + ms / self.args.speedup_ratio / 1000.0 - loop.time()
                await self._sleep(max(pause, 0.0))
                self._deliver(deliveries)
                self._publish_metrics()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("mocker scheduler (dp rank %d) failed", self.dp_rank)
            err = EngineError("mocker scheduler failed")
            for req in [*self.waiting, *self.prefill, *self.decode]:
                req.out.put_nowait(err)
            raise

    # -- one iteration -------------------------------------------------------------------------
    def step(self) -> tuple[float, list[tuple[MockRequest, Any]]]:
        """Run one iteration; returns its simulated duration (ms) and the outputs to deliver after it."""
        self.steps += 1
        out: list[tuple[MockRequest, Any]] = []
        self._drop_cancelled(out)
        self._admit()
        ms = 0.0
        decoding = list(self.decode)  # the sequences that decode this step (not those prefilled now)
        budget = self.args.max_num_batched_tokens - len(decoding)
        ms += self._prefill(budget, out)
        if decoding:
            ms += decode_time_ms(self.kv.num_active / self.kv.num_blocks) / self.args.decode_speedup_ratio
            for req in decoding:
                if req in self.decode:  # it may have been pre-empted by an earlier one this step
                    self._decode_one(req, out)
        self.simulated_ms += ms
        return ms, out

    def _drop_cancelled(self, out: list[tuple[MockRequest, Any]]) -> None:
        def gone(req: MockRequest) -> bool:
            if req.cancelled:
                return True
            if _is_stopped(req.ctx):
                out.append((req, EngineOutput(finish_reason="cancelled")))
                return True
            return False

        for queue in (self.waiting, self.prefill):
            if any(r.cancelled or _is_stopped(r.ctx) for r in queue):
                keep = []
                for r in queue:
                    if gone(r):
                        self._free(r)
                    else:
                        keep.append(r)
                queue.clear()
                queue.extend(keep)
        for req in [r for r in self.decode if gone(r)]:
            del self.decode[req]
            self._free(req)

    def _admit(self) -> None:
        args = self.args
        block_limit = (1.0 - args.watermark) * args.num_gpu_blocks
        # tokens this step is already committed to: one per decoding sequence plus pending prefills;
        # blocks promised to admitted requests that have not allocated yet
        committed = len(self.decode) + sum(r.to_prefill or self._estimate_new_tokens(r) for r in self.prefill)
        reserved = sum(self._slots_needed(r) for r in self.prefill if not r.allocated)
        while self.waiting:
            req = self.waiting[0]
            running = self.num_running
            if running >= args.max_num_seqs:
                break
            new_tokens = self._estimate_new_tokens(req)
            slots = self._slots_needed(req)
            if running and self.kv.num_active + reserved + slots > block_limit:
                break
            if running:
                if args.enable_chunked_prefill:
                    if committed >= args.max_num_batched_tokens:
                        break
                elif committed + new_tokens > args.max_num_batched_tokens:
                    break
            # (with nothing running the head request is always admitted, so nothing can deadlock)
            self.waiting.popleft()
            self.prefill.append(req)
            if req.on_admit is not None:
                req.on_admit()
            committed += new_tokens
            reserved += slots

    def _prefill(self, budget: int, out: list[tuple[MockRequest, Any]]) -> float:
        ms = 0.0
        chunked = self.args.enable_chunked_prefill
        done_any = False
        while self.prefill and budget > 0:
            req = self.prefill[0]
            if not req.allocated and not self._allocate(req, out):
                break
            if not req.allocated:
                continue  # it failed for good and was answered with an error
            chunk = req.to_prefill
            if chunk > budget:
                if chunked:
                    chunk = budget
                elif done_any:
                    break  # wait for a step with room for all of it
            if chunk:
                ms += prefill_time_ms(chunk)
            budget -= chunk
            req.to_prefill -= chunk
            done_any = True
            if req.to_prefill > 0:
                break  # the rest of this prompt goes first in the next step
            self.prefill.popleft()
            self.decode[req] = None
            self._decode_one(req, out)  # the prefill's forward pass yields the first token
        return ms

    def _allocate(self, req: MockRequest, out: list[tuple[MockRequest, Any]]) -> bool:
        """Allocate all of the head prefill request's blocks.  False: not now (it went back to waiting)."""
        blocks = self._blocks_for(req)
        cached = self.kv.cached_prefix([b.id for b in blocks if b.cacheable]) if self.caching else 0
        if not self.kv.use(blocks):
            self.prefill.popleft()
            if not self.decode and not any(r.allocated for r in self.prefill):
                # nothing else holds blocks: this request can never fit
                out.append((req, EngineError(
                    f"the request needs {len(blocks)} KV blocks of {self.block_size} tokens but the mocker has "
                    f"{self.kv.num_blocks} (num_gpu_blocks)")))
                return True
            # running requests hold the blocks (vLLM does not pre-empt them for a newcomer): wait
            self.waiting.appendleft(req)
            return False
        self.hit_rates.append(cached / max(1, len(blocks)))
        req.blocks = [b.id for b in blocks]
        req.partial = blocks[-1].id if blocks and not blocks[-1].cacheable and len(req.tokens) % self.block_size else None
        req.allocated = True
        req.cached_tokens = min(cached * self.block_size, len(req.tokens))
        # the last token is always computed, unless the prefill worker did it (its KV state was imported)
        req.to_prefill = 0 if req.imported else max(1, len(req.tokens) - req.cached_tokens)
        return True

    def _decode_one(self, req: MockRequest, out: list[tuple[MockRequest, Any]]) -> None:
        """Append one generated token to ``req`` (allocating / promoting blocks) and queue its output."""
        bs = self.block_size
        if len(req.tokens) % bs == 0:
            pid = self.kv.private_id()
            while not self.kv.use([Block(pid)]):
                victim = next(iter(self.decode))
                if victim is req and self.kv.num_active <= len(req.blocks):
                    # it holds every busy block and still cannot grow: it will never fit
                    del self.decode[req]
                    self._free(req)
                    out.append((req, EngineError(
                        f"the sequence outgrew the KV cache ({len(req.tokens)} tokens, "
                        f"{self.kv.num_blocks} blocks of {bs})")))
                    return
                self._preempt(victim)
                if victim is req:
                    return
            req.blocks.append(pid)
            req.partial = pid
        token = req.next_token()
        req.tokens.append(token)
        req.generated += 1
        if len(req.tokens) % bs == 0:
            self._extend_hashes(req)
            local, seq = req.local_hashes[-1], req.seq_hashes[-1]
            parent = req.seq_hashes[-2] if len(req.seq_hashes) > 1 else None
            full = Block(seq, local, parent) if self.caching else Block(self.kv.private_id())
            assert req.partial is not None
            self.kv.promote(req.partial, full)
            req.blocks[-1] = full.id
            req.partial = None
        # the first token reports the prefix-cache hit of the prompt (usage.prompt_tokens_details)
        cached = min(req.cached_tokens, req.prompt_len) if req.generated == 1 else None
        if req.finished:
            del self.decode[req]
            self._free(req)
            out.append((req, EngineOutput(token_ids=[token], finish_reason="length", cached_tokens=cached)))
        else:
            out.append((req, EngineOutput(token_ids=[token], cached_tokens=cached)))

    def _preempt(self, req: MockRequest) -> None:
        log.debug("mocker dp%d: pre-empting request %s (%d tokens)", self.dp_rank, req.request_id, len(req.tokens))
        del self.decode[req]
        self._free(req)
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def _free(self, req: MockRequest) -> None:
        if req.allocated:
            self.kv.release(reversed(req.blocks))  # tail first: it is evicted before the shared head
        req.blocks = []
        req.partial = None
        req.allocated = False
        req.to_prefill = 0

    # -- blocks --------------------------------------------------------------------------------
    def _extend_hashes(self, req: MockRequest) -> None:
        bs = self.block_size
        have = len(req.local_hashes)
        complete = len(req.tokens) // bs
        if complete <= have:
            return
        if complete - have == 1:
            local = block_hash(req.tokens[have * bs:(have + 1) * bs])
            req.local_hashes.append(local)
            req.seq_hashes.append(sequence_hash(req.seq_hashes[-1] if req.seq_hashes else None, local))
            return
        new_local = compute_block_hashes(req.tokens[have * bs:complete * bs], bs)
        req.local_hashes.extend(new_local)
        req.seq_hashes.extend(compute_seq_hashes(new_local, req.seq_hashes[-1] if req.seq_hashes else None))

    def _blocks_for(self, req: MockRequest) -> list[Block]:
        self._extend_hashes(req)
        blocks: list[Block] = []
        prev: int | None = None
        for local, seq in zip(req.local_hashes, req.seq_hashes, strict=True):
            if self.caching:
                blocks.append(Block(seq, local, prev))
            else:
                blocks.append(Block(self.kv.private_id()))
            prev = seq
        if len(req.tokens) % self.block_size:
            blocks.append(Block(self.kv.private_id()))
        return blocks

    def _cached_blocks(self, req: MockRequest) -> int:
        """Leading complete blocks of ``req`` the KV manager holds (active or inactive)."""
        return self.kv.cached_prefix(req.seq_hashes) if self.caching else 0

    def _slots_needed(self, req: MockRequest) -> int:
        """Blocks that allocating ``req`` would add to the active set."""
        if self.caching:
            active = self.kv.active
            n = sum(1 for h in req.seq_hashes if h not in active)
        else:
            n = len(req.seq_hashes)
        return n + (1 if len(req.tokens) % self.block_size else 0)

    def _estimate_new_tokens(self, req: MockRequest) -> int:
        return max(1, len(req.tokens) - self._cached_blocks(req) * self.block_size)

    # -- outputs and metrics -------------------------------------------------------------------
    @staticmethod
    def _deliver(deliveries: list[tuple[MockRequest, Any]]) -> None:
        for req, item in deliveries:
            if not req.cancelled:
                req.out.put_nowait(item)

    def metrics(self) -> dict[str, Any]:
        """ForwardPassMetrics ([0.4] nested shape) of this rank."""
        kv = self.kv
        hit = sum(self.hit_rates) / len(self.hit_rates) if self.hit_rates else 0.0
        return {
            "worker_stats": {
                "data_parallel_rank": self.dp_rank,
                "request_active_slots": self.num_running,
                "request_total_slots": self.args.max_num_seqs,
                "num_requests_waiting": len(self.waiting),
            },
            "kv_stats": {
                "kv_active_blocks": kv.num_active,
                "kv_total_blocks": kv.num_blocks,
                "gpu_cache_usage_perc": kv.num_active / kv.num_blocks,
                "gpu_prefix_cache_hit_rate": hit,
            },
            "spec_decode_stats": None,
        }

    def _publish_metrics(self) -> None:
        """Tell ``on_metrics`` when active blocks or the waiting count changed, at most once per
        ``metrics_interval`` seconds; a change inside the interval is sent when it ends."""
        if self.on_metrics is None or self._metrics_timer is not None:
            return
        key = (self.kv.num_active, len(self.waiting))
        if key == self._last_metrics_key:
            return
        loop = asyncio.get_running_loop()
        wait = self._last_metrics_at + self.metrics_interval - loop.time()
        if wait > 0:
            self._metrics_timer = loop.call_later(wait, self._metrics_due)
            return
        self._last_metrics_key = key
        self._last_metrics_at = loop.time()
        self.on_metrics(self)

    def _metrics_due(self) -> None:
        self._metrics_timer = None
        self._publish_metrics()
