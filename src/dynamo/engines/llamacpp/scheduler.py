"""The scheduler of ``out=llamacpp``: continuous batching on one thread.

A single scheduler thread owns every llama.cpp call (they block and are not thread-safe): each step it
admits waiting requests into free sequence slots (slots.py decides which slot and how much of the prompt
it reuses), builds one batch with a prompt chunk for requests still in prefill and one token for each
request in decode, runs ``llama_decode`` once, samples every sequence's next token (sampling.py), and
hands the tokens to the asyncio side in one ``call_soon_threadsafe``.  Requests join and leave between
steps.  A request whose consumer went away or stopped frees its slot before the next admission, so a
follow-up turn finds the previous turn's slot free.

After admitting and after each step the KV events of the blocks the slots gained or lost go to
``on_kv_changes`` (the engine publishes them on its event loop, once per step).  The thread count of each
step comes from the thread tuner (threads.py).

LoRA adapters (lora.py) apply to the whole context, so one step decodes one adapter group (the base model
is a group too): when requests of several groups run, the steps take the groups in turn, each step
batching every request of its group.  Loading and unloading adapters are commands the event loop hands
to this thread (:meth:`Scheduler.call`), run between two steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from typing import Any, Callable

from dynamo.engines.llamacpp.lora import Adapter, AppliedAdapters
from dynamo.engines.llamacpp.model import Llama
from dynamo.engines.llamacpp.sampling import Samplers, is_greedy, prompt_logprobs, token_logprobs
from dynamo.engines.llamacpp.slots import Request, Slot, SlotCaches
from dynamo.engines.llamacpp.threads import BatchThreadTuner
from dynamo.engines.llamacpp.vision import Projector
from dynamo.errors import EngineError
from dynamo.llm.first_token import Stamps, stamp
from dynamo.llm.protocols.common import EngineOutput

log = logging.getLogger(__name__)

HIT_RATE_WINDOW = 1000  # requests in the prefix-cache hit rate


class Scheduler:
    """Runs the requests of one loaded model on its slots (``bind``, then ``start``; ``submit`` from the
    event loop)."""

    def __init__(self, caches: SlotCaches, *, n_batch: int, n_threads_batch: int | None):
        self.caches = caches
        self.n_batch = n_batch
        self.n_threads_batch = n_threads_batch
        self.cv = threading.Condition()
        self.waiting: deque[Request] = deque()
        self.closing = False
        self.thread: threading.Thread | None = None
        self.tuner: BatchThreadTuner | None = None
        self.threads_set = (0, 0)
        self.steps = 0
        self.decoded_tokens = 0
        self.reused_tokens = 0
        self.hits: deque[float] = deque(maxlen=HIT_RATE_WINDOW)  # share of each prompt taken from the cache
        # in the scheduler thread, after admitting or a step: the KV events (tier, data) since the last call
        self.on_kv_changes: Callable[[list[tuple[str, Any]]], None] | None = None
        # since the last stats line: steps, tokens, seconds in llama_decode, seconds between back-to-back steps
        self._stats: list[Any] = [0, 0, 0.0, 0.0, 0]
        self._stats_at = time.perf_counter()
        self._last_end = 0.0
        self._llama: Llama | None = None
        self._samplers: Samplers | None = None
        # LoRA: work for this thread between steps, the adapter the context runs with, unloaded
        # adapters still in use, and the adapter group of the last step (groups take turns)
        self.commands: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self.applied = AppliedAdapters()
        self.retired: list[Adapter] = []
        self._last_group = -1
        self.projector: Projector | None = None  # --mmproj: evaluates images (vision.py)
        self.image_tokens = 0  # image positions evaluated, and the seconds it took (encode + decode)
        self.image_seconds = 0.0

    def bind(self, llama: Llama, samplers: Samplers, tuner: BatchThreadTuner | None) -> None:
        """The loaded model, its sampler maker and the thread tuner (None: fixed thread counts)."""
        self._llama, self._samplers, self.tuner = llama, samplers, tuner
        self.threads_set = llama.threads

    @property
    def llama(self) -> Llama:
        assert self._llama is not None, "the model is not loaded"
        return self._llama

    @property
    def samplers(self) -> Samplers:
        assert self._samplers is not None, "the model is not loaded"
        return self._samplers

    # -- the event loop's side ----------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="llamacpp-scheduler", daemon=True)
        self.thread.start()

    def submit(self, req: Request) -> None:
        with self.cv:
            if self.closing:
                raise EngineError("llamacpp engine is shutting down")
            self.waiting.append(req)
            self.cv.notify()

    def wake(self) -> None:
        """Look at the waiting requests again (a prefix state a request waits for has arrived)."""
        with self.cv:
            self.cv.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn`` on the scheduler thread between two steps (it owns the llama.cpp calls); its result
        or exception in the future."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self.cv:
            if self.closing or self.thread is None:
                fut.set_exception(EngineError("llamacpp engine is not running"))
                return fut
            self.commands.append((fn, fut))
            self.cv.notify()
        return fut

    def retire(self, adapter: Adapter) -> None:
        """(Scheduler thread, a command) an unloaded adapter: freed once no request uses it."""
        adapter.retired = True
        with self.cv:
            self.retired.append(adapter)
            self._free_retired()

    def _free_retired(self) -> None:
        in_use = {id(s.req.adapter) for s in self.caches.slots if s.req is not None}
        in_use |= {id(r.adapter) for r in self.waiting}
        for adapter in [a for a in self.retired if id(a) not in in_use]:
            self.retired.remove(adapter)
            self.caches.forget_adapter(adapter.uid)
            self.applied.free(self.llama, adapter)

    def stop(self) -> None:
        """Ask the thread to stop (it fails the requests it still has); join ``thread`` to wait for it."""
        with self.cv:
            self.closing = True
            self.cv.notify_all()

    def free_samplers(self) -> None:
        """Once the thread has stopped: free the slots' sampler chains."""
        for slot in self.caches.slots:
            if slot.sampler is not None:
                self.samplers.free(slot.sampler)
                slot.sampler = None

    def active(self) -> int:
        return sum(1 for s in self.caches.slots if s.req is not None)

    def load_key(self) -> tuple[int, int, int]:
        """What the load metrics depend on: busy slots, waiting requests, cached blocks."""
        return self.active(), len(self.waiting), self.caches.slot_blocks.cached_blocks

    # -- the scheduler thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.cv:
                    if self.retired:  # (under the lock: it reads the waiting requests)
                        self._free_retired()
                    while (not self.closing and not self.waiting and not self.commands
                           and not any(s.req for s in self.caches.slots)):
                        self.cv.wait()
                    if self.closing:
                        break
                    commands, self.commands = list(self.commands), deque()
                    self._reap()
                    self._admit()
                    if not commands and not any(s.req for s in self.caches.slots):
                        blocked = self._head_waits()
                        if blocked:  # only a request waiting for its prefix state: sleep until it comes
                            self.cv.wait(blocked)
                            continue
                for fn, fut in commands:
                    try:
                        fut.set_result(fn())
                    except Exception as e:  # noqa: BLE001 - the caller gets it
                        fut.set_exception(e)
                self._step()
                self._flush_kv_changes()
        except Exception as e:  # never leave requests hanging if llama.cpp fails
            log.exception("llama.cpp scheduler failed")
            self._fail_active(f"llama.cpp failed: {e}")
        finally:
            self._fail_active("llamacpp engine is shutting down")
            self._fail_waiting("llamacpp engine is shutting down")
            with self.cv:
                commands, self.commands = list(self.commands), deque()
            for _, fut in commands:
                fut.set_exception(EngineError("llamacpp engine is shutting down"))

    def _fail_active(self, why: str) -> None:
        items = []
        for slot in self.caches.slots:
            if slot.req is not None:
                items.append((slot.req, why))
                self._finish(slot)
        self._deliver(items)

    def _fail_waiting(self, why: str) -> None:
        with self.cv:
            waiting, self.waiting = list(self.waiting), deque()
        self._deliver([(r, why) for r in waiting])

    def _reap(self) -> None:
        """Free the slots of requests whose consumer went away or asked to stop (a finished turn whose
        stream the post-processor ended), so that the next request can use their caches."""
        dropped = []
        # a lender keeps these too: a turn the post-processor ended at a stop string is as worth lending as
        # one the engine finished (a client gone mid-way leaves what was computed of its prompt)
        ended: list[Slot] = []
        for slot in self.caches.slots:
            req = slot.req
            if req is not None and (req.cancelled or req.ctx.is_stopped):
                dropped.append((req, EngineOutput(finish_reason="cancelled")))
                ended.append(slot)
                self._finish(slot)
        self._deliver(dropped)
        for slot in ended:
            self.caches.keep_finished(slot)

    def _admit(self) -> None:
        """Move waiting requests into free slots, each to the slot sharing the longest prompt prefix
        (copied from a busy slot when that one shares clearly more).  A request whose prefix a busy slot
        is still computing waits for it instead of computing it a second time beside it."""
        deferred: list[Request] = []
        try:
            self._admit_some(deferred)
        finally:
            self.waiting.extendleft(reversed(deferred))

    def _head_waits(self) -> float:
        """Seconds the first waiting request may still wait for another worker's prefix state (0: none)."""
        if not self.waiting or self.waiting[0].prefix_wait is None:
            return 0.0
        return max(0.0, self.waiting[0].prefix_deadline - time.monotonic())

    def _prefix_arrived(self, req: Request) -> bool:
        """Whether ``req`` (first in line) can be admitted: its prefix state came (or the fetch failed, or
        it waited its deadline out, or it was cancelled).  Later requests wait behind it, in arrival order:
        admitted first, a request that came during the fetch took the step and the fetched one waited for
        that whole prefill (150 to 780 ms in the peers benchmark)."""
        fut = req.prefix_wait
        if fut is None:
            return True
        if fut.done():
            req.prefix_state = None if fut.cancelled() or fut.exception() is not None else fut.result()
        elif time.monotonic() < req.prefix_deadline and not (req.cancelled or req.ctx.is_stopped):
            return False
        req.prefix_wait = None
        return True

    def _admit_some(self, deferred: list[Request]) -> None:
        while self.waiting:
            free = [s for s in self.caches.slots if s.req is None]
            if not free:
                return
            if not self._prefix_arrived(self.waiting[0]):
                return  # (the state's arrival wakes the thread)
            req = self.waiting.popleft()
            stamp(req.stamps, "taken")
            if req.ctx.phases is not None:  # a traced request: its queue ends here (a timestamp, thread-safe)
                req.ctx.phases.admitted()
            if req.cancelled or req.ctx.is_stopped:
                self._deliver([(req, EngineOutput(finish_reason="cancelled"))])
                continue
            if (req.state_io is not None and req.state_io.state is not None and req.logprobs is None
                    and self._admit_imported(req, free)):  # (logprobs: the first token's needs the logits)
                continue
            if req.prompt_logprobs is not None:
                self._admit_whole_prompt(req, free)
                continue
            best = self.caches.place(req, free)
            if best is None:
                deferred.append(req)  # admitted (with a copy) once that slot's prefill is done
                continue
            keep = req.cached_tokens
            self.hits.append(keep / len(req.prompt))
            self._start_request(best, req)
            self.reused_tokens += keep
            log.debug("request %s: slot %d, %d prompt tokens, %d reused from the cache", req.ctx.id,
                      best.seq_id, len(req.prompt), keep)
            stamp(req.stamps, "admitted", f"slot {best.seq_id}, {keep} of {len(req.prompt)} tokens cached")

    def _admit_whole_prompt(self, req: Request, free: list[Slot]) -> None:
        """A request for the prompt's logprobs computes its whole prompt (see SlotCaches.place_whole)."""
        best = self.caches.place_whole(req, free)
        self.hits.append(0.0)
        self._start_request(best, req)
        best.prompt_lp = [None]  # the first prompt token has no logprob (nothing precedes it)

    def _start_request(self, slot: Slot, req: Request) -> None:
        slot.req = req
        slot.generated = 0
        slot.prompt_lp = None
        if slot.sampler is not None:
            self.samplers.free(slot.sampler)
            slot.sampler = None
        slot.greedy = is_greedy(req.sampling) and req.grammar is None and not req.sampling.logit_bias
        if not slot.greedy:
            slot.sampler = self.samplers.make(req.sampling, req.grammar)

    def _admit_imported(self, req: Request, free: list[Slot]) -> bool:
        """Load a prefill worker's state of ``req.prompt`` into a free slot and answer its first token;
        False (nothing changed, prefill locally) if llama.cpp refuses the state."""
        io = req.state_io
        data, io.state = io.state, None  # the bytes are not needed after this
        slot = self.caches.place_imported(req, free, data)
        if slot is None:
            return False
        io.imported = True
        self._start_request(slot, req)
        self.hits.append(0.0)
        # the prefill worker's token is this sequence's first: answer it and decode from it
        tok = int(io.first_token)
        slot.generated = 1
        slot.last = tok
        reason = "eos" if tok in req.eos else ("length" if req.max_tokens <= 1 else None)
        self._deliver([(req, EngineOutput(token_ids=[tok], finish_reason=reason, cached_tokens=0))])
        if reason is not None:
            self._finish(slot)
        return True

    def _finish(self, slot: Slot) -> None:
        slot.req = None
        slot.pending = []
        slot.used_at = time.monotonic()

    def _set_threads(self, n: int) -> None:
        want = (n, self.n_threads_batch or n)
        if want != self.threads_set:
            self.llama.L.llama_set_n_threads(self.llama.lctx, *want)
            self.threads_set = want

    def _step(self) -> None:
        L, lctx = self.llama.L, self.llama.lctx
        batch = self.llama.batch
        slots = self.caches.slots
        n = 0
        outputs: list[tuple[Slot, int]] = []  # (slot, batch index whose logits to sample)
        rows: list[int] = []  # the logits row of each output (rows are stored in batch order)
        prompt_rows: list[tuple[Slot, int, int, int]] = []  # (slot, first row, prompt position, tokens)
        stamped: list[tuple[Stamps, int]] = []  # (stamps, prompt tokens) of stamped requests in this step
        n_rows = 0
        budget = self.n_batch
        self._reap()  # drop requests whose consumer went away or asked to stop
        group = self._next_group()
        if group is None:
            return
        # decode tokens first (one each), so running streams never wait behind a long prefill
        for slot in slots:
            if slot.req is not None and not slot.pending and slot.req.lora_uid == group.uid:
                _put(batch, n, slot.last, len(slot.cached), slot.seq_id, True)
                outputs.append((slot, n))
                rows.append(n_rows)
                n_rows += 1
                slot.cached.append(slot.last)
                n += 1
                budget -= 1
        failed_images: list[tuple[Request, Any]] = []
        for slot in slots:
            if slot.req is None or not slot.pending or budget <= 0 or slot.req.lora_uid != group.uid:
                continue
            if slot.req.images:
                budget -= self._images(slot, group, failed_images)
                if slot.req is None or not slot.pending or budget <= 0:
                    continue
            pos = len(slot.cached)
            take = slot.pending[:min(budget, (slot.req.next_image(pos) - pos) if slot.req.images else budget)]
            last_chunk = len(take) == len(slot.pending)
            every = slot.prompt_lp is not None  # the prompt's logprobs: logits at every position
            for i, tok in enumerate(take):
                _put(batch, n + i, tok, pos + i, slot.seq_id, every)
            if every:
                prompt_rows.append((slot, n_rows, pos, len(take) - 1 if last_chunk else len(take)))
                n_rows += len(take)
            if last_chunk:
                batch.logits[n + len(take) - 1] = True
                outputs.append((slot, n + len(take) - 1))
                rows.append(n_rows - 1 if every else n_rows)
                n_rows += 0 if every else 1
            slot.cached.extend(take)
            n += len(take)
            slot.pending = slot.pending[len(take):]
            if slot.req.stamps is not None:
                stamped.append((slot.req.stamps, len(take)))
            budget -= len(take)
        self._deliver(failed_images)
        if n == 0:
            return
        batch.n_tokens = n
        self.applied.apply(self.llama, group.adapter)
        threads = self.tuner.threads(n) if self.tuner is not None else 0
        if threads:
            self._set_threads(threads)
        t0 = time.perf_counter()
        rc = L.llama_decode(lctx, batch)
        t1 = time.perf_counter()
        dt = t1 - t0
        self.steps += 1
        if rc != 0:
            msg = f"llama_decode failed ({rc}): out of KV cache space" if rc == 1 else f"llama_decode failed ({rc})"
            failed = {id(s) for s, _ in outputs}
            items = []
            for slot in slots:
                if slot.req is not None and (id(slot) in failed or rc != 1):
                    items.append((slot.req, msg))
                    self.caches.drop(slot)
                    self._finish(slot)
            self._deliver(items)
            return
        self.caches.name_blocks()  # name the blocks this step completed
        if threads and self.tuner is not None:
            self.tuner.record(threads, n, dt)
        for stamps, k in stamped:
            stamps.append(("prompt step", t0, f"{k} of its tokens, {n} in the step, {self.threads_set[0]} threads"))
            stamps.append(("step done", t1, ""))
        self.decoded_tokens += n
        st = self._stats
        st[0] += 1
        st[1] += n
        st[2] += dt
        if t0 - self._last_end < 0.02:  # back to back: the scheduler's own time between two decodes
            st[3] += t0 - self._last_end
            st[4] += 1
        if log.isEnabledFor(logging.DEBUG) and t0 - self._stats_at >= 10.0:
            wall = t1 - self._stats_at
            log.debug("llama.cpp: %d steps, %d tokens in %.1f s (%.1f tokens/s), %.0f%% of the time in "
                      "llama_decode, %.3f ms between back-to-back steps, threads now %s", st[0], st[1], wall,
                      st[1] / wall, 100 * st[2] / wall, 1e3 * st[3] / max(st[4], 1),
                      self.tuner.summary() if self.tuner else self.threads_set[0])
            self._stats = [0, 0, 0.0, 0.0, 0]
            self._stats_at = t1
        greedy_rows: list[int] = []
        want_lp = prompt_rows or any(slot.req.logprobs is not None for slot, _ in outputs)  # type: ignore[union-attr]
        logits = None
        if want_lp or any(slot.greedy for slot, _ in outputs):
            # logits rows are stored in batch order for the tokens that asked for them
            logits = self.llama.np.ctypeslib.as_array(L.llama_get_logits(lctx), shape=(n_rows, self.llama.n_vocab))
            if any(slot.greedy for slot, _ in outputs):
                picked = logits if n_rows == len(outputs) else logits[rows]
                greedy_rows = picked.argmax(axis=1).tolist()
        if prompt_rows:
            self._prompt_logprobs(logits, prompt_rows)
        deliveries: list[tuple[Request, Any]] = []
        finished: list[Slot] = []
        for j, (slot, idx) in enumerate(outputs):
            req = slot.req
            assert req is not None
            if slot.greedy:
                tok = greedy_rows[j]
            else:
                tok = L.llama_sampler_sample(slot.sampler, lctx, idx)
            slot.generated += 1
            slot.last = tok
            reason = None
            if tok in req.eos:
                reason = "eos"
            elif slot.generated >= req.max_tokens:
                reason = "length"
            out = EngineOutput(token_ids=[tok], finish_reason=reason)
            if req.logprobs is not None:
                lp, tops = token_logprobs(self.llama.np, logits[rows[j]], tok, req.logprobs)  # type: ignore[index]
                out.log_probs = [lp]
                out.top_logprobs = [tops]
            if slot.generated == 1:
                out.cached_tokens = req.cached_tokens
                if slot.prompt_lp is not None:
                    out.prompt_logprobs, slot.prompt_lp = slot.prompt_lp, None
                if req.state_io is not None and req.state_io.export:
                    try:
                        req.state_io.state = self.caches.export_state(slot)
                    except EngineError as e:
                        deliveries.append((req, str(e)))
                        self._finish(slot)
                        continue
            deliveries.append((req, out))
            if reason is not None:
                self._finish(slot)
                finished.append(slot)
            if slot.generated == 1 and req.stamps is not None:
                stamp(req.stamps, "sampled, handed over")
        self._deliver(deliveries)
        for slot in finished:  # (after the last tokens went out: a lending worker's state export)
            self.caches.keep_finished(slot)
        self._last_end = time.perf_counter()

    def _images(self, slot: Slot, group: _Group, failed: list[tuple[Request, Any]]) -> int:
        """Evaluate the images at the head of ``slot``'s pending prompt (each whole: mtmd encodes it and
        decodes its embeddings into the slot's sequence, outside the step's token batch); the positions
        they took.  A failure fails the request (appended to ``failed``)."""
        req = slot.req
        assert req is not None and self.projector is not None
        used = 0
        while slot.pending and (span := req.image_at(len(slot.cached))) is not None:
            self.applied.apply(self.llama, group.adapter)
            t0 = time.perf_counter()
            rc = self.projector.evaluate(self.llama.lctx, span, slot.seq_id, self.n_batch)
            if rc != 0:
                failed.append((req, f"llama.cpp could not evaluate an image ({rc})"))
                self.caches.drop(slot)
                self._finish(slot)
                return used
            self.image_seconds += time.perf_counter() - t0
            self.image_tokens += span.length
            slot.cached.extend(slot.pending[:span.length])
            slot.pending = slot.pending[span.length:]
            used += span.length
            if req.stamps is not None:
                stamp(req.stamps, "image", f"{span.length} positions in {1e3 * (time.perf_counter() - t0):.1f} ms")
        return used

    def _next_group(self) -> _Group | None:
        """The adapter group this step runs: the next one after the last step's that has work."""
        groups: dict[int, Adapter | None] = {}
        for slot in self.caches.slots:
            if slot.req is not None:
                groups.setdefault(slot.req.lora_uid, slot.req.adapter)
        if not groups:
            return None
        uids = sorted(groups)
        uid = next((u for u in uids if u > self._last_group), uids[0]) if len(uids) > 1 else uids[0]
        self._last_group = uid
        return _Group(uid, groups[uid])

    def _prompt_logprobs(self, logits: Any, prompt_rows: list[tuple[Slot, int, int, int]]) -> None:
        """Score each prompt token under the logits of the position before it (vectorised per chunk)."""
        for slot, first, pos, count in prompt_rows:
            if count <= 0 or slot.prompt_lp is None or slot.req is None:
                continue
            slot.prompt_lp.extend(prompt_logprobs(self.llama.np, logits[first:first + count],
                                                  slot.req.prompt[pos + 1:pos + 1 + count],
                                                  slot.req.prompt_logprobs or 0))

    def _deliver(self, items: list[tuple[Request, Any]]) -> None:
        """Hand items to the requests' event loops: one ``call_soon_threadsafe`` per loop per step."""
        if not items:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Request, Any]]] = {}
        for req, item in items:
            by_loop.setdefault(req.loop, []).append((req, item))
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, group)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _flush_kv_changes(self) -> None:
        """After admitting or a step: hand the KV events to whoever listens."""
        events = self.caches.take_events()
        if self.on_kv_changes is not None:
            self.on_kv_changes(events)


class _Group:
    __slots__ = ("uid", "adapter")

    def __init__(self, uid: int, adapter: Adapter | None):
        self.uid, self.adapter = uid, adapter


def _put_all(group: list[tuple[Request, Any]]) -> None:
    for req, item in group:
        req.out.put_nowait(item)


def _put(batch: Any, i: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
    batch.token[i] = token
    batch.pos[i] = pos
    batch.n_seq_id[i] = 1
    batch.seq_id[i][0] = seq_id
    batch.logits[i] = logits

