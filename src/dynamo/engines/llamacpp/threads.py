"""How many threads llama.cpp computes with, chosen by measuring while serving.

ggml synchronises its threads hundreds of times per decode step (a barrier per graph node), so a thread
count equal to the core count is fastest on a quiet machine and collapses when the cores are shared
(other work, or our own HTTP front end): one preempted thread stalls the others at every barrier
(measured on 2 shared cores: a decode step 5 to 30 times slower with 2 threads than with 1), and a
one-token step gains little from a second thread while an eight-token step gains a lot.  Unless
``n_threads`` is given, a :class:`BatchThreadTuner` picks the thread count while serving, per batch size
class: it times the steps, now and then tries another count for a few steps and keeps the faster one.
The thread count does not change the results (each output value is computed by one thread; checked
bit for bit).

The scheduler (scheduler.py) asks the tuner before each step and reports each step's time; the two
callables here, :class:`IdleCores` and :class:`CoresLeftToUs`, tell the tuner how busy the machine is.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque
from typing import Any

log = logging.getLogger(__name__)

# a step of at least this many tokens is prompt work (matrix-matrix): it gains from every idle core
PREFILL_TOKENS = 16
# a probe of fewer threads for prompt-sized steps ends at its first step this much slower than the
# current count (one thread takes 1.6 to 1.8x as long for a 30-token prompt on 2 idle cores; such a probe
# cannot win, and each of its steps is a request's time to first token)
PREFILL_ABORT = 1.25
# a probe of fewer threads for decode steps while the cores are ours ends at its first step this much
# slower (one thread short: 1.5 to 1.6x slower here; a probe that comes close runs its full length)
QUIET_DECODE_ABORT = 1.25


class ThreadTuner:
    """Picks the llama.cpp thread count on a machine whose cores are shared, by measuring.

    The scheduler asks :meth:`threads` before each step and reports each pure decode step's time with
    :meth:`record`.  It starts with the fewest threads (the safe choice on a busy machine) and keeps the
    per-token time of the last ``window`` steps at the current count; every ``gap`` seconds it runs
    ``probe_steps`` steps at another count (the next candidate in turn), and switches when their median
    is at least ``margin`` faster.  A probe step slower than ``abort`` times the current median ends the
    probe at once (more threads than free cores can be many times slower).  A failed probe doubles the
    gap up to ``max_gap``; a switch resets it.  If the current count gets ``degrade`` times slower than
    it was when chosen (the machine got busier), it probes again after ``min_gap`` seconds.

    ``idle()`` (optional) returns how many cores the machine left idle recently; a probe with more
    threads is skipped (and looked at again after ``min_gap``) unless ``idle_per_thread`` idle cores per
    extra thread are there: on a saturated machine such probes often cost a slow step.  Not always, so
    the ``force_after``-th skip in a row probes anyway (a failed one still doubles the gap): when other
    processes keep the cores busy, each of our threads gets its share of them: llama-server's two
    threads made 11.3 ms per token where our one made 31 ms, minutes apart at load average 5 to 6
    (docs/performance.md), while at load average 10, beside multi-threaded jobs, two threads were 18x
    slower than one.  Only a measurement tells which case this is.  Per-token costs are compared only between
    steps of similar size (see :class:`BatchThreadTuner`).

    ``free()`` (optional) returns how many cores other processes left us recently (idle ones plus those
    this process used).  While that is at least the current count less half a core, a probe with *fewer*
    threads has a core for each of the current ones to beat, and rarely does: with ``quiet_abort`` None
    (prompt-sized steps) it is skipped, since every step of such a probe is a prompt computed more slowly,
    i.e. a request's time to first token; otherwise it runs with ``quiet_abort`` in place of ``abort``, so
    a probe one thread short ends at its first step (1.5 to 1.6x slower here at one and eight tokens a
    step) instead of after ``probe_steps`` of them: with ``abort`` 2 each such probe cost eight streams
    about 2.4 steps' worth of tokens, three probes in a ten-second benchmark level, about 3 %.  Where
    other processes take cores, fewer-thread probes run as before: that is where fewer threads win.
    """

    def __init__(self, candidates: list[int], *, start: int | None = None, window: int = 8, probe_steps: int = 4,
                 margin: float = 0.9, abort: float = 2.0, degrade: float = 1.6, min_gap: float = 1.0,
                 max_gap: float = 30.0, idle: Any = None, idle_per_thread: float = 0.25, force_after: int = 4,
                 free: Any = None, quiet_abort: float | None = None, clock: Any = time.monotonic):
        self.candidates = sorted(set(candidates))
        self.current = start if start is not None else self.candidates[0]
        self.window, self.probe_steps, self.margin, self.abort = window, probe_steps, margin, abort
        self.degrade, self.min_gap, self.max_gap = degrade, min_gap, max_gap
        self.idle, self.idle_per_thread, self.force_after = idle, idle_per_thread, force_after
        self.free, self.quiet_abort = free, quiet_abort
        self.probes = 0  # probes run (not skipped)
        self._probe_abort = abort  # the abort factor of the probe in progress
        self.skipped = 0
        self._skips_in_row = 0
        self.clock = clock
        self.recent: deque[float] = deque(maxlen=window)
        self.baseline: float | None = None
        self.gap = min_gap
        self.next_probe = clock() + min_gap
        self.last_change = clock()
        self.probing: int | None = None
        self.probe: list[float] = []
        self._turn = 0
        self.switches = 0

    def threads(self) -> int:
        if self.probing is not None:
            return self.probing
        others = [c for c in self.candidates if c != self.current]
        if not others or len(self.recent) < self.window // 2:
            return self.current
        now = self.clock()
        degraded = (self.baseline is not None and now - self.last_change >= self.min_gap
                    and statistics.median(self.recent) > self.degrade * self.baseline)
        if now >= self.next_probe or degraded:
            alt = others[self._turn % len(others)]
            self._turn += 1
            if alt > self.current and self.idle is not None:
                idle = self.idle()
                if idle is not None and idle < self.idle_per_thread * (alt - self.current) \
                        and self._skips_in_row + 1 < self.force_after:
                    self.skipped += 1
                    self._skips_in_row += 1
                    self.next_probe = max(self.next_probe, now + self.min_gap)
                    self.last_change = now
                    return self.current
            probe_abort = self.abort
            if alt < self.current and self.free is not None:
                free = self.free()
                if free is not None and free >= self.current - 0.5:
                    if self.quiet_abort is None:
                        self.skipped += 1
                        self.next_probe = max(self.next_probe, now + self.min_gap)
                        self.last_change = now
                        return self.current
                    probe_abort = min(self.abort, self.quiet_abort)
            self._skips_in_row = 0
            self._probe_abort = probe_abort
            self.probes += 1
            self.probing = alt
            self.probe = []
            return self.probing
        return self.current

    def record(self, threads: int, n_tokens: int, seconds: float) -> None:
        if n_tokens <= 0:
            return
        cost = seconds / n_tokens
        if self.probing is not None and threads == self.probing:
            self.probe.append(cost)
            ref = statistics.median(self.recent)
            if cost > self._probe_abort * ref:
                self._decide(ref, None)
            elif len(self.probe) >= self.probe_steps:
                self._decide(ref, statistics.median(self.probe))
        elif threads == self.current:
            self.recent.append(cost)
            if self.baseline is None and len(self.recent) == self.window:
                self.baseline = statistics.median(self.recent)

    def _decide(self, ref: float, probed: float | None) -> None:
        now = self.clock()
        alt, self.probing = self.probing, None
        assert alt is not None  # only called while probing
        if probed is not None and probed < self.margin * ref:
            log.debug("llama.cpp threads %d -> %d (%.2f -> %.2f ms per token)", self.current, alt, ref * 1e3,
                      probed * 1e3)
            self.current = alt
            self.recent = deque(self.probe, maxlen=self.window)
            self.baseline = probed
            self.gap = self.min_gap
            self.switches += 1
        else:
            self.gap = min(self.gap * 2, self.max_gap)
            self.baseline = ref
        self.last_change = now
        self.next_probe = now + self.gap


class BatchThreadTuner:
    """One :class:`ThreadTuner` per batch size class (1, 2-3, 4-7, 8-15, ...).

    The best thread count depends on the batch: one token per step gains little from a second thread
    (the step is short and every barrier costs), eight tokens gain a lot.  A single tuner would see the
    per-token time jump whenever streams start or finish and chase the batch size instead of the machine.

    A class never timed follows the nearest smaller class that was, except a prompt-sized class
    (``PREFILL_TOKENS`` or more): when it first appears while the machine has the cores (``free``, the
    cores other processes leave us, at least the most threads less half a core; without ``free``, idle
    cores as the probes' test), it starts with the most threads.  Following a one-token class there would
    keep prompts on one thread because a second one does not speed up a single token much, though it
    does speed up a prompt (1.6 to 1.8x for 30 tokens on 2 idle cores); prompts are rare steps, so their
    class would take minutes to tune itself from one thread, and every time-to-first-token would pay for
    it meanwhile.  For the same reason a prompt-sized class probes fewer threads only when other
    processes take cores (``free``, see :class:`ThreadTuner`; a decode class probes them then too, ended
    at its first step ``QUIET_DECODE_ABORT`` times slower), and such a probe ends at its first step
    ``PREFILL_ABORT`` times slower: before, a prompt class re-probed one thread for four steps soon after
    it started, which at one stream is four requests in a row with a 1.6 to 1.8x slower prefill
    (docs/performance.md).

    With ``free``, every class starts that way, decode ones included: on a quiet machine two threads
    decode one token 1.5x faster here (7.6 against 11.6 ms), and a first class started at one thread
    ran about the first second of a server's life on it (until a probe, after 1 s and four steps), e.g.
    the first 60 tokens of ``llamacpp_compare.py``'s one-stream level.  Where other processes take the
    cores it starts with the fewest, as before.
    """

    def __init__(self, candidates: list[int], *, free: Any = None, **kw: Any):
        self.candidates = sorted(set(candidates))
        self._free = free
        self._kw = kw
        self.tuners: dict[int, ThreadTuner] = {}
        self._wide_start: set[int] = set()  # classes that started with the most threads

    @staticmethod
    def bucket(n_tokens: int) -> int:
        return 1 << min(max(n_tokens, 1).bit_length() - 1, 6)

    def tuner(self, n_tokens: int) -> ThreadTuner:
        b = self.bucket(n_tokens)
        t = self.tuners.get(b)
        if t is None:
            kw = self._kw
            if b >= PREFILL_TOKENS:
                kw = {**kw, "free": self._free, "abort": min(kw.get("abort", PREFILL_ABORT), PREFILL_ABORT)}
            else:
                kw = {**kw, "free": self._free, "quiet_abort": QUIET_DECODE_ABORT}
            t = self.tuners[b] = ThreadTuner(self.candidates, **kw)
        return t

    def threads(self, n_tokens: int) -> int:
        b = self.bucket(n_tokens)
        if b not in self.tuners and (b >= PREFILL_TOKENS or self._free is not None) and self._cores_idle():
            self.tuner(n_tokens).current = self.candidates[-1]
            self._wide_start.add(b)
        t = self.tuner(n_tokens)
        if t.probing is None and len(t.recent) < t.window // 2 and b not in self._wide_start:
            # too few steps of this size timed yet (big prefill batches are rare): follow the choice of
            # the nearest smaller size class that has been timed
            known = [c for c, u in self.tuners.items() if c < b and len(u.recent) >= u.window // 2]
            if known and self.tuners[max(known)].current != t.current:
                t.current = self.tuners[max(known)].current
                t.recent.clear()
                t.baseline = None
        return t.threads()

    def record(self, threads: int, n_tokens: int, seconds: float) -> None:
        self.tuner(n_tokens).record(threads, n_tokens, seconds)

    def _cores_idle(self) -> bool:
        """Enough cores for the most threads: left to us by other processes (``free``, when given: our own
        decode threads may be what keeps them busy), else idle as a probe needs; unknown counts as yes."""
        if self._free is not None:
            left = self._free()
            return left is None or left >= self.candidates[-1] - 0.5
        idle = self._kw.get("idle")
        if idle is None or len(self.candidates) < 2:
            return True
        seen = idle()
        per_thread = self._kw.get("idle_per_thread", 0.25)
        return seen is None or seen >= per_thread * (self.candidates[-1] - self.candidates[0])

    @property
    def switches(self) -> int:
        return sum(t.switches for t in self.tuners.values())

    @property
    def skipped(self) -> int:
        return sum(t.skipped for t in self.tuners.values())

    @property
    def probes(self) -> int:
        return sum(t.probes for t in self.tuners.values())

    def summary(self) -> str:
        return ", ".join(f"{b}+ tokens: {t.current} ({t.probes} probes)" for b, t in sorted(self.tuners.items()))


class IdleCores:
    """Idle cores of the whole machine since the previous call, from /proc/stat (None elsewhere)."""

    def __init__(self) -> None:
        self.prev = self._read()

    @staticmethod
    def _read() -> tuple[int, int, int] | None:
        try:
            with open("/proc/stat", "rb") as f:
                head = f.readline().split()
            ncpu = os.cpu_count() or 1
        except OSError:
            return None
        if not head or head[0] != b"cpu":
            return None
        vals = [int(x) for x in head[1:9]]
        return vals[3] + vals[4], sum(vals), ncpu

    def __call__(self) -> float | None:
        cur = self._read()
        prev, self.prev = self.prev, cur
        if cur is None or prev is None or cur[1] <= prev[1]:
            return None
        return (cur[0] - prev[0]) / (cur[1] - prev[1]) * cur[2]


class CoresLeftToUs:
    """Cores other processes left this one since the previous call: the idle ones plus those this process
    used (from /proc/stat and ``os.times``; None elsewhere).  Unlike the idle count it does not drop when
    our own threads are what keeps the cores busy.  Calls less than ``MIN_SPAN_S`` apart get the previous
    answer (the counters tick every 10 ms)."""

    MIN_SPAN_S = 0.05

    def __init__(self) -> None:
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.prev = self._read()
        self.last: float | None = None

    @staticmethod
    def _read() -> tuple[tuple[int, int, int], float] | None:
        machine = IdleCores._read()
        if machine is None:
            return None
        t = os.times()
        return machine, t.user + t.system

    def __call__(self) -> float | None:
        cur, prev = self._read(), self.prev
        if cur is None or prev is None:
            self.prev = cur
            return None
        (idle1, total1, ncpu), ours1 = cur
        (idle0, total0, _), ours0 = prev
        span = total1 - total0  # jiffies over all cores
        if span < self.MIN_SPAN_S * self._tick * ncpu:
            return self.last
        self.prev = cur
        ours = (ours1 - ours0) * self._tick  # jiffies this process used
        self.last = min(float(ncpu), (idle1 - idle0 + ours) / span * ncpu)
        return self.last


def serving_tuner(cores: int) -> BatchThreadTuner:
    """The tuner the engine serves with on ``cores`` cores (more than one, no GPU layers, ``n_threads``
    not given): one thread or all of them up to 4 cores, half or all of them above."""
    cands = [1, cores] if cores <= 4 else [cores // 2, cores]
    return BatchThreadTuner(cands, idle=IdleCores(), free=CoresLeftToUs())
