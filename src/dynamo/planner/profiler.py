"""``dynamo-planner profile --worker-cmd "dynamo-run in=dyn://... out=..." --out DIR``: measure one worker.

What the planner needs to know of a worker (``profile_data.py``): how long a prompt of each length takes
to its first token (the prefill curve), how the inter-token latency grows with the streams it decodes at
once (the decode curve), and how long it takes to start.  This command measures them the way the fleet
will be used, through a real frontend:

1. etcd and NATS: those the environment names (``ETCD_ENDPOINTS``, ``NATS_SERVER``), else the defaults on
   localhost when they answer, else its own pair on free ports (``dynamo-run-infra``), stopped at the end;
2. a frontend (``dynamo-run in=http out=dyn``) on a free port, then the worker; the worker's load time is
   from its start to the frontend listing its model with an instance;
3. the prefill sweep: for each ``--isl``, ``--prefill-requests`` requests one at a time, each with its
   own prompt (no prefix cache hit), one output token: TTFT is the median, the prefill rate ``isl /
   TTFT``;
4. the decode sweep: for each ``--concurrency``, that many streams kept busy (closed loop) with prompts of
   ``--decode-isl`` tokens and ``--osl`` output tokens: ITL is the median of the requests' mean gaps, the
   decode rate the output tokens over the wall time, the KV usage the highest the worker reported
   (the frontend's ``worker_kv_cache_usage_ratio``; -1 if it reports none);
5. ``DIR/profile.json`` and, with matplotlib, ``DIR/profile.png``; then the worker gets SIGTERM (it
   drains) and everything started is stopped.

``python -m dynamo.planner.profiler`` runs it too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from statistics import median

import aiohttp

from dynamo.errors import UserError
from dynamo.planner.loadgen import LoadGenerator, RequestResult, prompt_tokens
from dynamo.planner.profile_data import DecodePoint, PrefillPoint, WorkerProfile

DEFAULT_ISL = "128,512,1024,2048,4096"
DEFAULT_CONCURRENCY = "1,2,4,8,16,32"
PROMPT_VOCAB = 512  # prompt token ids are drawn below this (every model's vocabulary is larger)
KV_USAGE_METRIC = "dynamo_frontend_worker_kv_cache_usage_ratio"


def _ints(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dynamo-planner profile", description=(
        "Measure one worker's prefill and decode curves through a real frontend; write DIR/profile.json "
        "for dynamo-planner --profile-results-dir DIR."))
    p.add_argument("--worker-cmd", required=True, metavar="CMD",
                   help='the worker to measure, e.g. "dynamo-run in=dyn://dynamo.backend.generate out=mocker MODEL"')
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="where profile.json (and profile.png) go")
    p.add_argument("--isl", type=_ints, default=_ints(DEFAULT_ISL), metavar="N,N,...",
                   help=f"input lengths of the prefill sweep (default {DEFAULT_ISL})")
    p.add_argument("--concurrency", type=_ints, default=_ints(DEFAULT_CONCURRENCY), metavar="N,N,...",
                   help=f"streams at once in the decode sweep (default {DEFAULT_CONCURRENCY})")
    p.add_argument("--decode-isl", type=int, default=512, metavar="N", help="input length in the decode sweep (512)")
    p.add_argument("--osl", type=int, default=64, metavar="N", help="output tokens per decode-sweep request (64)")
    p.add_argument("--prefill-requests", type=int, default=3, metavar="N", help="requests per input length (3)")
    p.add_argument("--decode-rounds", type=int, default=2, metavar="N",
                   help="requests per stream at each concurrency (2)")
    p.add_argument("--model", help="the model to send requests for (default: the one the worker serves)")
    p.add_argument("--startup-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="how long the worker may take to serve (default 300)")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    host, _, port = url.split("://", 1)[-1].split(",")[0].rstrip("/").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=1):
            return True
    except (OSError, ValueError):
        return False


class Processes:
    """The processes this run started, each in its own session, stopped (SIGTERM, then SIGKILL) at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - the child writes it; closed with it
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        except OSError as exc:
            raise UserError(f"cannot start the {name}: {argv[0]}: {exc.strerror}") from None
        finally:
            log.close()
        self.procs.append((name, proc))
        return proc

    def check(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is not None:
            tail = (self.logs / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
            raise UserError(f"the {name} exited with status {proc.returncode}: " + " | ".join(tail))

    def stop_all(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self.procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _runtime_env(procs: Processes, env: dict[str, str], data: Path) -> dict[str, str]:
    """The environment's etcd and NATS, the local defaults when they answer, else our own pair."""
    etcd = env.get("ETCD_ENDPOINTS", "http://127.0.0.1:2379")
    nats = env.get("NATS_SERVER", "nats://127.0.0.1:4222")
    if _answers(etcd) and _answers(nats):
        return {**env, "ETCD_ENDPOINTS": etcd, "NATS_SERVER": nats}
    if "ETCD_ENDPOINTS" in env or "NATS_SERVER" in env:
        raise UserError(f"etcd ({etcd}) or NATS ({nats}) does not answer")
    ports = [_free_port() for _ in range(3)]
    proc = procs.start("infra", [sys.executable, "-m", "dynamo.cli.infra", "--etcd-port", str(ports[0]),
                                 "--etcd-peer-port", str(ports[1]), "--nats-port", str(ports[2]),
                                 "--data-dir", str(data / "infra")], env)
    etcd, nats = f"http://127.0.0.1:{ports[0]}", f"nats://127.0.0.1:{ports[2]}"
    deadline = time.monotonic() + 30
    while not (_answers(etcd) and _answers(nats)):
        procs.check("infra", proc)
        if time.monotonic() > deadline:
            raise UserError("etcd and NATS did not start within 30 s (pip install '.[infra]')")
        time.sleep(0.1)
    print(f"started etcd on {etcd} and NATS on {nats} for this run", flush=True)
    return {**env, "ETCD_ENDPOINTS": etcd, "NATS_SERVER": nats}


async def _serving_model(session: aiohttp.ClientSession, base: str, model: str | None) -> str | None:
    """The model the frontend serves with at least one instance (``model`` if given), or None yet."""
    try:
        async with session.get(base + "/health") as resp:
            health = await resp.json()
    except (aiohttp.ClientError, ValueError):
        return None
    names = health.get("models") or []
    if not health.get("instances") or not names:
        return None
    if model is not None:
        return model if model in names else None
    if len(names) > 1:
        raise UserError(f"the frontend serves several models ({', '.join(names)}): say which with --model")
    return str(names[0])


async def _kv_usage(session: aiohttp.ClientSession, base: str) -> float:
    """The highest KV cache usage a worker reports on the frontend's /metrics, or -1."""
    try:
        async with session.get(base + "/metrics") as resp:
            text = await resp.text()
    except aiohttp.ClientError:
        return -1.0
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(KV_USAGE_METRIC) and " " in line]
    return max(values, default=-1.0)


async def _peak_kv_usage(session: aiohttp.ClientSession, base: str, done: asyncio.Event) -> float:
    """The highest KV usage seen on the frontend's /metrics every 0.2 s until ``done``."""
    peak = -1.0
    while not done.is_set():
        peak = max(peak, await _kv_usage(session, base))
        try:
            await asyncio.wait_for(done.wait(), 0.2)
        except asyncio.TimeoutError:
            pass
    return peak


def _check(results: list[RequestResult], what: str) -> None:
    failed = [r for r in results if not r.ok]
    if failed:
        raise UserError(f"{what}: {len(failed)} of {len(results)} requests failed, e.g. {failed[0].error}")


async def _sweep(a: argparse.Namespace, base: str, model: str) -> tuple[list[PrefillPoint], list[DecodePoint]]:
    salt = iter(range(1, 1 << 30))
    prefill: list[PrefillPoint] = []
    async with LoadGenerator(base, model) as gen:
        for isl in a.isl:
            results = [await gen.send(prompt_tokens(isl, vocab_size=PROMPT_VOCAB, salt=next(salt)), 1)
                       for _ in range(a.prefill_requests)]
            _check(results, f"prefill sweep, {isl} tokens")
            ttft = median(r.ttft_s for r in results if r.ttft_s is not None)
            prefill.append(PrefillPoint(isl, ttft * 1000, isl / ttft))
            print(f"prefill isl={isl}: TTFT {ttft * 1000:.1f} ms, {isl / ttft:.0f} tok/s", flush=True)
        decode: list[DecodePoint] = []
        async with aiohttp.ClientSession() as probe:
            for c in a.concurrency:
                done = asyncio.Event()
                watcher = asyncio.create_task(_peak_kv_usage(probe, base, done))
                prompts = (prompt_tokens(a.decode_isl, vocab_size=PROMPT_VOCAB, salt=next(salt)) for _ in iter(int, 1))
                start = time.monotonic()
                results = await gen.closed_loop(prompts, a.osl, c, c * a.decode_rounds)
                wall = time.monotonic() - start
                done.set()
                peak = await watcher
                _check(results, f"decode sweep, {c} streams")
                itl = median(r.itl_s for r in results if r.itl_s is not None)
                rate = sum(r.output_tokens for r in results) / wall
                decode.append(DecodePoint(c, itl * 1000, peak, rate))
                print(f"decode concurrency={c}: ITL {itl * 1000:.1f} ms, {rate:.0f} tok/s, KV usage {peak:.2f}",
                      flush=True)
    return prefill, decode


async def _profile(a: argparse.Namespace, procs: Processes, env: dict[str, str]) -> WorkerProfile:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    frontend = procs.start("frontend", [sys.executable, "-m", "dynamo.cli", "in=http", "out=dyn", "--http-host",
                                        "127.0.0.1", "--http-port", str(port)], env)
    worker_argv = shlex.split(a.worker_cmd)
    if not worker_argv:
        raise UserError("--worker-cmd is empty")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        started = time.monotonic()
        worker = procs.start("worker", worker_argv, env)
        model = None
        while model is None:
            procs.check("frontend", frontend)
            procs.check("worker", worker)
            if time.monotonic() - started > a.startup_timeout:
                raise UserError(f"the worker did not serve within {a.startup_timeout:g} s (its log: "
                                f"{procs.logs / 'worker.log'})")
            model = await _serving_model(session, base, a.model)
            if model is None:
                await asyncio.sleep(0.1)
        load_time = time.monotonic() - started
    print(f"worker serves {model} after {load_time:.1f} s", flush=True)
    prefill, decode = await _sweep(a, base, model)
    return WorkerProfile(prefill, decode, load_time, a.worker_cmd,
                         {"decode_isl": a.decode_isl, "osl": a.osl, "prefill_requests": a.prefill_requests,
                          "decode_rounds": a.decode_rounds, "model": model})


def plot(profile: WorkerProfile, path: Path) -> bool:
    """Draw the two curves into ``path``; False (with a note) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", flush=True)
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot([p.isl for p in profile.prefill], [p.ttft_ms for p in profile.prefill], marker="o")
    left.set_xlabel("input tokens")
    left.set_ylabel("TTFT (ms)")
    left.set_title("prefill, one request at a time")
    right.plot([p.concurrency for p in profile.decode], [p.itl_ms for p in profile.decode], marker="o")
    right.set_xlabel("streams at once")
    right.set_ylabel("ITL (ms)")
    right.set_title("decode")
    fig.suptitle(profile.worker_cmd[:100], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="dynamo-profile-") as tmp, ExitStack() as stack:
            logs = a.out / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            procs = Processes(logs)
            stack.callback(procs.stop_all)
            env = _runtime_env(procs, dict(os.environ), Path(tmp))
            profile = asyncio.run(_profile(a, procs, env))
        path = profile.save(a.out)
        print(f"profile: {path}", flush=True)
        if plot(profile, a.out / "profile.png"):
            print(f"plot: {a.out / 'profile.png'}", flush=True)
        return 0
    except UserError as exc:
        print(f"dynamo-planner profile: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
