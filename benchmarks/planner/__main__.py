"""The planner against static fleets: one load trace replayed through a real frontend on mocker workers,
three fleets one after the other: the static minimum, the static maximum and the planner (``python -m
dynamo.planner --environment local``, starting and draining mocker workers between the two bounds).

Per fleet: SLA attainment (share of 10 s windows whose TTFT p90 and ITL p90 meet the targets, see
``score.py``), worker-seconds (worker processes alive, sampled every second from ``/proc``: a starting or
draining worker counts), failed requests; then the issue's goal for the planner (at least 90% of the
windows the static maximum meets, at most 70% of its worker-seconds, no failed request) and a plot of
load, workers and latency over time (with matplotlib; without it, a note and no plot).

    python -m benchmarks.planner [--trace step|day|FILE.jsonl] [--duration 240] [--fleets min,max,planner]
    python -m benchmarks.planner --replot run1/step.json run2/step.json     # fleets of several runs together

Results: ``benchmarks/results/planner/<trace>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.planner.score import Score, Window, relative_goal, windows, worker_seconds
from benchmarks.planner.trace import TraceRequest, read_jsonl, synthesize
from dynamo.planner.loadgen import LoadGenerator, RequestResult, prompt_tokens
from harness.proc import DynamoRun, DynamoWorker, cli_command
from harness.servers import EtcdServer, NatsServer
from harness.tiny_model import build_tiny_hf_model

MODEL = "bench"
VOCAB = 512  # the tiny model's vocabulary (harness/tiny_model.py)
# the mocker's GPU: 1,024 blocks of 16 tokens; its step times are the spec's (scheduler.py), here halved
MOCKER_ARGS = {"num_gpu_blocks": 1024, "block_size": 16, "speedup_ratio": 2.0}
RESULTS = Path("benchmarks/results/planner")


def worker_command(namespace: str, model_dir: Path, args_file: Path) -> list[str]:
    return cli_command() + [f"in=dyn://{namespace}.backend.generate", "out=mocker", str(model_dir), "--model-name",
                            MODEL, "--extra-engine-args", str(args_file)]


def count_workers(namespace: str) -> int:
    """Worker processes of this namespace alive now: an argument of theirs is ``in=dyn://<ns>.…`` (the
    planner's own ``--decode-cmd`` argument only contains it)."""
    needle = f"in=dyn://{namespace}.".encode()
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if any(arg.startswith(needle) for arg in f.read().split(b"\0")):
                    n += 1
        except OSError:
            continue
    return n


def health_instances(fe: DynamoRun) -> int:
    try:
        return len(httpx.get(fe.base_url + "/health", timeout=5).json().get("instances", []))
    except (httpx.HTTPError, ValueError):
        return 0


def wait_instances(fe: DynamoRun, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while health_instances(fe) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"the frontend did not see {n} worker(s) within {timeout:g} s")
        time.sleep(0.2)


async def replay(fe: DynamoRun, trace: list[TraceRequest], namespace: str) -> tuple[list[RequestResult],
                                                                                      list[tuple[float, int]]]:
    schedule = [(r.timestamp_ms / 1000.0, prompt_tokens(r.input_length, r.hash_ids, vocab_size=VOCAB, salt=i),
                 r.output_length) for i, r in enumerate(trace)]
    samples: list[tuple[float, int]] = []
    async with LoadGenerator(fe.base_url, MODEL) as gen:
        t0 = time.monotonic()

        async def sample() -> None:
            while True:
                samples.append((time.monotonic() - t0, await asyncio.to_thread(count_workers, namespace)))
                await asyncio.sleep(1.0)

        sampler = asyncio.create_task(sample())
        try:
            results = await gen.replay(schedule)
        finally:
            sampler.cancel()
    return results, samples


def run_fleet(kind: str, a: argparse.Namespace, trace: list[TraceRequest], env: dict[str, str], model_dir: Path,
              args_file: Path, work: Path) -> Score:
    namespace = f"plan{kind.replace('+', '')}{os.getpid()}"
    cmd = worker_command(namespace, model_dir, args_file)
    workers: list[DynamoWorker] = []
    planner: DynamoWorker | None = None
    with DynamoRun("out=dyn", env=env) as fe:
        try:
            if kind in ("planner", "planner+profile"):
                argv = [sys.executable, "-m", "dynamo.planner", "--namespace", namespace, "--environment", "local",
                        "--adjustment-interval", str(a.interval), "--ttft", str(a.ttft), "--itl", str(a.itl),
                        "--min-endpoint", str(a.min_workers), "--max-workers", str(a.max_workers),
                        "--frontend-url", fe.base_url, "--decode-cmd", shlex.join(cmd),
                        "--load-predictor", a.predictor, "--state-dir", str(work / "state"),
                        "--log-dir", str(work / "logs"), "--stop-workers-on-exit"]
                if kind == "planner+profile":
                    if a.profile is None:
                        raise SystemExit("the planner+profile fleet needs --profile DIR (dynamo-planner profile)")
                    argv += ["--profile-results-dir", str(a.profile)]
                planner = DynamoWorker(command=argv, env=env, ready=None).start()
                wait_instances(fe, a.min_workers)
            else:
                n = a.min_workers if kind == "min" else a.max_workers
                workers = [DynamoWorker(command=cmd, env=env).start(wait=False) for _ in range(n)]
                for w in workers:
                    w.wait_ready(60)
                wait_instances(fe, n)
            print(f"[{kind}] fleet ready; replaying {len(trace)} requests over {a.duration:g} s", flush=True)
            results, samples = asyncio.run(replay(fe, trace, namespace))
        finally:
            if planner is not None:
                planner.stop(30)
                (work / f"planner-{kind}.log").write_text(planner.stderr_text())
            for w in workers:
                w.stop(30)
    wins = windows(results, a.duration, a.ttft, a.itl)
    score = Score(kind, wins, worker_seconds(samples, a.duration), sum(not r.ok for r in results), len(results),
                  samples)
    errors = sorted({r.error for r in results if r.error})[:3]
    print(f"[{kind}] attainment {score.attainment:.0%}  worker-seconds {score.worker_seconds:.0f}  "
          f"failed {score.failed}/{score.requests}" + (f"  e.g. {errors}" if errors else ""), flush=True)
    return score


def plot(scores: list[Score], trace: list[TraceRequest], a: argparse.Namespace, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    fig, (ax_load, ax_workers, ax_ttft, ax_itl) = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    width = 10.0
    bins = [sum(1 for r in trace if i * width <= r.timestamp_ms / 1000 < (i + 1) * width) / width
            for i in range(int(a.duration // width) + 1)]
    ax_load.step([i * width for i in range(len(bins))], bins, where="post", color="black")
    ax_load.set_ylabel("requests/s")
    ax_load.set_title(f"trace {a.trace}: load, workers, TTFT p90, ITL p90 per 10 s window")
    for s in scores:
        ax_workers.step([t for t, _ in s.workers_over_time], [n for _, n in s.workers_over_time], where="post",
                        label=f"{s.fleet} ({s.worker_seconds:.0f} worker-s)")
        xs = [w.start_s for w in s.windows]
        ax_ttft.plot(xs, [w.ttft_p90_ms for w in s.windows], marker=".", label=f"{s.fleet} ({s.attainment:.0%})")
        ax_itl.plot(xs, [w.itl_p90_ms for w in s.windows], marker=".", label=s.fleet)
    ax_workers.set_ylabel("workers")
    ax_workers.legend(fontsize=8)
    ax_ttft.axhline(a.ttft, color="grey", linestyle="--")
    ax_ttft.set_ylabel("TTFT p90 (ms)")
    ax_ttft.set_yscale("log")
    ax_ttft.legend(fontsize=8)
    ax_itl.axhline(a.itl, color="grey", linestyle="--")
    ax_itl.set_ylabel("ITL p90 (ms)")
    ax_itl.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="step", help="step, day (synthetic) or a Mooncake JSONL file (default step)")
    p.add_argument("--duration", type=float, default=240.0, help="seconds of a synthetic trace (default 240)")
    p.add_argument("--low-rps", type=float, default=1.0)
    p.add_argument("--high-rps", type=float, default=6.0)
    p.add_argument("--isl", type=int, default=1024)
    p.add_argument("--osl", type=int, default=96)
    p.add_argument("--fleets", default="min,max,planner", help="which fleets, in order: min, max, planner (it learns "
                   "the worker's capacity online), planner+profile (from --profile) (default min,max,planner)")
    p.add_argument("--min-workers", type=int, default=1)
    p.add_argument("--max-workers", type=int, default=4)
    p.add_argument("--ttft", type=float, default=400.0, help="TTFT p90 target, ms (default 400)")
    p.add_argument("--itl", type=float, default=30.0, help="ITL p90 target, ms (default 30)")
    p.add_argument("--interval", type=float, default=10.0, help="the planner's --adjustment-interval (default 10)")
    p.add_argument("--predictor", default="constant", help="the planner's --load-predictor (default constant)")
    p.add_argument("--profile", type=Path, help="a `dynamo-planner profile` directory for the planner+profile fleet")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--replot", nargs="+", type=Path, metavar="JSON",
                   help="run nothing: plot and score the fleets of earlier results together (a later file's fleet "
                        "replaces an earlier one of the same name; the trace and targets are the first file's)")
    return p.parse_args(argv)


def replot(a: argparse.Namespace) -> int:
    reports = [json.loads(path.read_text()) for path in a.replot]
    first = reports[0]
    a.trace, a.duration, a.ttft, a.itl = first["trace"], first["duration_s"], first["ttft_ms"], first["itl_ms"]
    for key, value in first.get("trace_args", {}).items():
        setattr(a, key, value)
    fleets: dict[str, Score] = {}
    for report in reports:
        for f in report["fleets"]:
            wins = [Window(**w) for w in f["windows"]]
            fleets[f["fleet"]] = Score(f["fleet"], wins, f["worker_seconds"], f["failed"], f["requests"],
                                       [tuple(x) for x in f["workers_over_time"]])
    trace = load_trace(a)
    scores = list(fleets.values())
    for s in scores:
        print(f"[{s.fleet}] attainment {s.attainment:.0%}  worker-seconds {s.worker_seconds:.0f}  "
              f"failed {s.failed}/{s.requests}")
    for kind in ("planner", "planner+profile"):
        if kind in fleets and "max" in fleets:
            print(f"goal ({kind} against max):", json.dumps(relative_goal(fleets[kind], fleets["max"])))
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"{Path(a.trace).stem}.png"
    if plot(scores, trace, a, path):
        print(f"plot: {path}")
    return 0


def load_trace(a: argparse.Namespace) -> list[TraceRequest]:
    if a.trace in ("step", "day"):
        return synthesize(a.trace, duration_s=a.duration, low_rps=a.low_rps, high_rps=a.high_rps, isl=a.isl,
                          osl=a.osl)
    trace = read_jsonl(a.trace)
    a.duration = trace[-1].timestamp_ms / 1000.0 + 1.0 if trace else 0.0
    return trace


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.replot:
        return replot(a)
    fleets = [f.strip() for f in a.fleets.split(",") if f.strip()]
    if importlib.util.find_spec("dynamo.planner.__main__") is None:
        print("dynamo.planner has no command here: the planner fleets are skipped")
        fleets = [f for f in fleets if not f.startswith("planner")]
    trace = load_trace(a)
    a.out.mkdir(parents=True, exist_ok=True)
    name = Path(a.trace).stem
    print(f"trace {a.trace}: {len(trace)} requests over {a.duration:g} s; load average {os.getloadavg()[0]:.1f}")
    scores: list[Score] = []
    with tempfile.TemporaryDirectory(prefix="planner-bench-") as tmp, EtcdServer() as etcd, NatsServer() as nats:
        work = Path(tmp)
        model_dir = build_tiny_hf_model(work / "model", with_weights=False, max_position_embeddings=32768)
        args_file = work / "mocker.json"
        args_file.write_text(json.dumps(MOCKER_ARGS))
        env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url, "DYN_LOG": "info"}
        for kind in fleets:
            scores.append(run_fleet(kind, a, trace, env, model_dir, args_file, work))
            if (work / f"planner-{kind}.log").exists():
                (a.out / f"{name}-{kind}.log").write_text((work / f"planner-{kind}.log").read_text())
    by = {s.fleet: s for s in scores}
    report: dict = {"trace": a.trace, "duration_s": a.duration, "requests": len(trace), "ttft_ms": a.ttft,
                    "trace_args": {"low_rps": a.low_rps, "high_rps": a.high_rps, "isl": a.isl, "osl": a.osl},
                    "itl_ms": a.itl, "mocker": MOCKER_ARGS, "load_average": os.getloadavg()[0],
                    "fleets": [s.to_json() for s in scores]}
    for kind in ("planner", "planner+profile"):
        if kind in by and "max" in by:
            report[f"goal {kind}"] = relative_goal(by[kind], by["max"])
            print(f"goal ({kind} against max):", json.dumps(report[f"goal {kind}"]))
    (a.out / f"{name}.json").write_text(json.dumps(report, indent=1))
    if plot(scores, trace, a, a.out / f"{name}.png"):
        print(f"plot: {a.out / f'{name}.png'}")
    print(f"results: {a.out / f'{name}.json'}; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
