#!/usr/bin/env python3
"""Side-by-side streaming benchmark: our dynamo-run vs the ORIGINAL (Rust) dynamo-run.

    .venv/bin/python -m benchmarks.echo_compare [--duration 20] [--only ours|original]
                                                [--scenarios a,b,c,d]

For each scenario and each server it starts `dynamo-run in=http out=echo_full` as a
subprocess on a free port, waits for `GET /v1/models` to answer (recording the start-up
time), runs the load from benchmarks/loadgen.py in this process, stops the server, and
finally prints a table with the ratio ours/original. Results are also written as JSON to
benchmarks/results/.

Scenarios:
  a  DYN_TOKEN_ECHO_DELAY_MS=10, 256 concurrent streams, 200-word prompts (keep-alive):
     aggregate tokens/s and ITL p99 (plus TTFT).
  b  DYN_TOKEN_ECHO_DELAY_MS=0, 64 concurrent streams, 200-word prompts (keep-alive):
     aggregate tokens/s (plus TTFT/ITL and server CPU).
  c  start-up: process start -> first answered GET /v1/models, and -> first answered
     chat completion; repeated --startup-repeats times, median and min.
  d  connection reuse: DYN_TOKEN_ECHO_DELAY_MS=0, 4 streams, 10-word prompts, 200 requests,
     once on keep-alive connections and once with a fresh connection per request:
     TTFT p50/p99 and ITL p99 (the original has a Nagle/delayed-ACK stall on reused
     connections).
  Scenarios a, b and e run once per load client (--clients raw,aiohttp, the default: the raw protocol
  client and aiohttp's), each against a fresh server.  Server CPU is the process tree's utime+stime
  over the run; it is also given over its whole life (start-up and warm-up included) and per write
  system call (/proc/<pid>/io syscw: how both send): a server that falls behind writes the tokens that
  fell due together at once, so its CPU per token drops on a busy machine while its CPU per write does not.
  e  DYN_TOKEN_ECHO_DELAY_MS=10, 64 streams (not in the default list): server CPU per token
     of paced streams whose tokens rarely leave together even on a busy machine (in a, other
     work on the cores makes tokens coalesce, which lowers the CPU per token).

The original binary comes from benchmarks/fetch_original.py (downloaded on first use).
Our server is `<venv>/bin/dynamo-run` if it exists, else `python -m dynamo.cli`; override
with --ours-cmd 'CMD ... {port} ... {model}'.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import http.client
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

from benchmarks import fetch_original, loadgen, machine

MODEL = "bench-echo"
CLIENT_BATCH = False  # --client-batch: the load runs as SCHED_BATCH (loadgen.batch_policy)
RESULTS = HERE / "results"


# ----------------------------------------------------------------------------- scenarios

def scenarios(duration: float, startup_repeats: int, clients: tuple[str, ...] = ("raw",)) -> dict[str, dict[str, Any]]:
    """The scenarios; the load scenarios (a, b, e) run once per client in ``clients`` (runs named after it)."""
    scs = _scenarios(duration, startup_repeats)
    for key in ("a", "b", "e"):
        base = scs[key]["runs"][""]
        scs[key]["runs"] = {c: dict(base, client=c) for c in clients} if len(clients) > 1 else \
            {"": dict(base, client=clients[0])}
    return scs


def _scenarios(duration: float, startup_repeats: int) -> dict[str, dict[str, Any]]:
    return {
        "a": {
            "title": "echo 10 ms/token, 256 streams, 200-word prompts, keep-alive",
            "env": {"DYN_TOKEN_ECHO_DELAY_MS": "10"},
            "runs": {"": dict(concurrency=256, duration=duration, prompt_words=200)},
            "metrics": ["tokens_per_s", "itl_p50", "itl_p99", "coalesced", "ttft_p50", "ttft_p99",
                        "server_cpu_s", "server_cpu_per_mtok", "server_cpu_life_per_mtok",
                        "server_cpu_per_mwrite", "tokens_per_write", "client_cpu_s", "errors"],
        },
        "b": {
            "title": "echo 0 ms/token, 64 streams, 200-word prompts, keep-alive",
            "env": {"DYN_TOKEN_ECHO_DELAY_MS": "0"},
            "runs": {"": dict(concurrency=64, duration=duration, prompt_words=200)},
            "metrics": ["tokens_per_s", "requests_per_s", "itl_p50", "itl_p99", "coalesced", "ttft_p50",
                        "ttft_p99", "server_cpu_s", "server_cpu_per_mtok", "client_cpu_s", "errors"],
        },
        "e": {
            # the CPU per token of paced streams where tokens rarely leave together even on a busy
            # machine (a's 256 streams coalesce when other work holds the cores, which lowers it)
            "title": "echo 10 ms/token, 64 streams, 200-word prompts, keep-alive (CPU per token)",
            "env": {"DYN_TOKEN_ECHO_DELAY_MS": "10"},
            "runs": {"": dict(concurrency=64, duration=duration, prompt_words=200)},
            "metrics": ["tokens_per_s", "itl_p99", "coalesced", "server_cpu_s", "server_cpu_per_mtok",
                        "server_cpu_life_per_mtok", "server_cpu_per_mwrite", "tokens_per_write",
                        "client_cpu_s", "errors"],
        },
        "c": {
            "title": f"start-up to first answer (median of {startup_repeats})",
            "env": {"DYN_TOKEN_ECHO_DELAY_MS": "0"},
            "startup_repeats": startup_repeats,
            "metrics": ["startup_models_ms", "startup_models_ms_min", "startup_chat_ms", "startup_cpu_s",
                        "rss_idle_mib"],
        },
        "d": {
            "title": "connection reuse: echo 0 ms/token, 4 streams, 10-word prompts, 200 requests",
            "env": {"DYN_TOKEN_ECHO_DELAY_MS": "0"},
            "runs": {
                "keep-alive": dict(concurrency=4, requests=200, prompt_words=10, fresh=False),
                "fresh": dict(concurrency=4, requests=200, prompt_words=10, fresh=True),
            },
            "metrics": ["ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "coalesced", "tokens_per_s", "errors"],
        },
    }


METRIC_LABELS = {
    "tokens_per_s": ("tokens/s", "higher"),
    "requests_per_s": ("requests/s", "higher"),
    "itl_p50": ("ITL p50 ms", "lower"),
    "itl_p99": ("ITL p99 ms", "lower"),
    "ttft_p50": ("TTFT p50 ms", "lower"),
    "ttft_p99": ("TTFT p99 ms", "lower"),
    "server_cpu_s": ("server CPU s", "lower"),
    "server_cpu_per_mtok": ("server CPU s / 1M tok", "lower"),
    "server_cpu_life_per_mtok": ("  incl. start-up+warm-up", "lower"),
    "server_cpu_per_mwrite": ("server CPU s / 1M writes", "lower"),
    "tokens_per_write": ("tokens per write (info)", ""),
    "coalesced": ("tokens coalesced %", "lower"),
    "client_cpu_s": ("client CPU s (info)", ""),
    "errors": ("errors", "lower"),
    "startup_models_ms": ("start -> /v1/models ms", "lower"),
    "startup_models_ms_min": ("  (min) ms", "lower"),
    "startup_chat_ms": ("start -> 1st chat ms", "lower"),
    "startup_cpu_s": ("CPU s until ready", "lower"),
    "rss_idle_mib": ("RSS when ready MiB", "lower"),
}


def metric_values(r: dict[str, Any]) -> dict[str, Any]:
    """Flatten a loadgen result into the metrics the table shows."""
    cpu = r.get("server_cpu_s")
    return {
        "tokens_per_s": r["tokens_per_s"],
        "requests_per_s": r["requests_per_s"],
        "itl_p50": r["itl_ms"]["p50"],
        "itl_p99": r["itl_ms"]["p99"],
        "ttft_p50": r["ttft_ms"]["p50"],
        "ttft_p99": r["ttft_ms"]["p99"],
        "server_cpu_s": cpu,
        "server_cpu_per_mtok": (cpu / r["tokens"] * 1e6) if cpu is not None and r["tokens"] else None,
        # the server's CPU since it started (start-up and warm-up included) over the run's tokens: what
        # "process CPU time / tokens" measures when read from the process at the end of a run
        "server_cpu_life_per_mtok": (r["server_cpu_total_s"] / r["tokens"] * 1e6)
        if r.get("server_cpu_total_s") is not None and r["tokens"] else None,
        # per write system call of the server (its sends): a server that falls behind writes the tokens
        # that fell due together at once, which lowers its CPU per token on a busy machine; not this
        "server_cpu_per_mwrite": (cpu / r["server_write_calls"] * 1e6)
        if cpu is not None and r.get("server_write_calls") else None,
        "tokens_per_write": (r["tokens"] / r["server_write_calls"]) if r.get("server_write_calls") else None,
        "client_cpu_s": r["client_cpu_s"],
        "errors": r["errors"],
    }


# ----------------------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def original_cmd(binary: Path) -> Callable[[int, str], list[str]]:
    def build(port: int, model: str) -> list[str]:
        return [str(binary), "in=http", "out=echo_full", "--http-port", str(port), "--model-name", model]
    return build


def ours_cmd(template: str | None) -> tuple[Callable[[int, str], list[str]], dict[str, str]]:
    """Command builder for our server, plus extra env."""
    if template:
        return (lambda port, model: shlex.split(template.format(port=port, model=model))), {}
    exe = Path(sys.executable).parent / "dynamo-run"
    if exe.exists():
        return (lambda port, model: [str(exe), "in=http", "out=echo_full", "--http-port", str(port),
                                     "--model-name", model]), {}
    env = {"PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return (lambda port, model: [sys.executable, "-m", "dynamo.cli", "in=http", "out=echo_full",
                                 "--http-port", str(port), "--model-name", model]), env


class ServerError(RuntimeError):
    pass


class Server:
    def __init__(self, name: str, build: Callable[[int, str], list[str]], env: dict[str, str], log: Path):
        self.name = name
        self.build = build
        self.env = env
        self.log_path = log
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.t_spawn = 0.0

    def start(self) -> None:
        self.port = free_port()
        cmd = self.build(self.port, MODEL)
        env = dict(os.environ)
        env.update(self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._log_start = self._log.tell()
        self._log.write(f"\n=== {time.strftime('%H:%M:%S')} {shlex.join(cmd)} env={self.env}\n".encode())
        self._log.flush()
        self.t_spawn = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise ServerError(f"{self.name} exited with {self.proc.returncode} before answering; "
                              f"log tail:\n{self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[self._log_start:][-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 120.0) -> dict[str, float]:
        """Poll GET /v1/models until it answers 200 listing our model; then one chat request."""
        deadline = self.t_spawn + timeout
        t_models = None
        while time.perf_counter() < deadline:
            self._check_alive()
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/v1/models")
                resp = c.getresponse()
                body = resp.read()
                c.close()
                if resp.status == 200 and MODEL.encode() in body:
                    t_models = time.perf_counter()
                    break
            except OSError:
                pass
            time.sleep(0.005)
        if t_models is None:
            raise ServerError(f"{self.name} did not answer /v1/models in {timeout}s; log:\n{self.log_tail()}")
        ready_cpu = sum(loadgen.tree_cpu_seconds(self.proc.pid).values())
        rss = loadgen.tree_rss_kib(self.proc.pid) / 1024
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                           "stream": False}).encode()
        t_chat = None
        while time.perf_counter() < deadline:
            self._check_alive()
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
                resp = c.getresponse()
                resp.read()
                c.close()
                if resp.status == 200:
                    t_chat = time.perf_counter()
                    break
            except OSError:
                pass
            time.sleep(0.005)
        return {
            "startup_models_ms": (t_models - self.t_spawn) * 1e3,
            "startup_chat_ms": (t_chat - self.t_spawn) * 1e3 if t_chat else None,
            "startup_cpu_s": ready_cpu,
            "rss_idle_mib": rss,
        }

    def stop(self) -> dict[str, Any]:
        if self.proc is None:
            return {}
        t0 = time.perf_counter()
        rc = self.proc.poll()
        if rc is None:
            self._signal(signal.SIGINT)
            try:
                rc = self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                rc = self.proc.wait(10)
        # take down anything left in the process group we created
        self._signal(signal.SIGKILL, quiet=True)
        self._log.close()
        self.proc = None
        return {"shutdown_ms": (time.perf_counter() - t0) * 1e3, "exit_code": rc}

    def _signal(self, sig: int, quiet: bool = False) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the session/group this script created
        except (ProcessLookupError, PermissionError):
            if not quiet:
                try:
                    self.proc.send_signal(sig)
                except ProcessLookupError:
                    pass


# ----------------------------------------------------------------------------- running

def warmup(url: str) -> None:
    asyncio.run(loadgen.run_load(url, MODEL, concurrency=4, duration=None, requests=8, prompt_words=5))


def run_scenario(key: str, sc: dict[str, Any], name: str, build, extra_env: dict[str, str],
                 log: Path) -> dict[str, Any]:
    env = dict(extra_env)
    env.update(sc["env"])
    out: dict[str, Any] = {"runs": {}}
    if key == "c":
        samples = []
        for i in range(sc["startup_repeats"]):
            srv = Server(name, build, env, log)
            srv.start()
            try:
                sample = srv.wait_ready()
            finally:
                stopped = srv.stop()
            sample.update(stopped)
            samples.append(sample)
            print(f"    start-up {i + 1}: /v1/models {samples[-1]['startup_models_ms']:.1f} ms, "
                  f"chat {samples[-1]['startup_chat_ms']:.1f} ms, cpu {samples[-1]['startup_cpu_s']:.2f} s",
                  flush=True)
        out["samples"] = samples
        out["metrics"] = {
            "startup_models_ms": statistics.median(s["startup_models_ms"] for s in samples),
            "startup_models_ms_min": min(s["startup_models_ms"] for s in samples),
            "startup_chat_ms": statistics.median(s["startup_chat_ms"] for s in samples),
            "startup_cpu_s": statistics.median(s["startup_cpu_s"] for s in samples),
            "rss_idle_mib": statistics.median(s["rss_idle_mib"] for s in samples),
        }
        return out
    out["metrics"] = {}
    for run_name, params in sc["runs"].items():
        srv = Server(name, build, env, log)
        srv.start()
        try:
            ready = srv.wait_ready()
            warmup(srv.url)
            load_before = machine.load_average()
            with loadgen.batch_policy(CLIENT_BATCH):
                r = asyncio.run(loadgen.run_load(srv.url, MODEL, server_pid=srv.proc.pid, **params))
            r["startup"] = ready
            r["loadavg_before"] = load_before
        finally:
            stopped = srv.stop()
        r["shutdown"] = stopped
        out["runs"][run_name or "main"] = r
        print("    " + (f"[{run_name}] " if run_name else "") +
              loadgen.format_result(r).replace("\n", "\n    "), flush=True)
        for m, v in metric_values(r).items():
            out["metrics"][f"{m}[{run_name}]" if run_name else m] = v
    return out


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.1f}"
    return f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"


def table(results: dict[str, Any], scs: dict[str, Any], order: list[str]) -> str:
    rows = [("scen", "metric", "original", "ours", "ours/orig", "better")]
    for key in order:
        sc = scs[key]
        res = results.get(key, {})
        orig = res.get("original", {}).get("metrics", {})
        ours = res.get("ours", {}).get("metrics", {})
        names = list(dict.fromkeys(list(orig) + list(ours)))
        runs = list(dict.fromkeys(n.partition("[")[2].rstrip("]") for n in names))
        ordered = [f"{m}[{r}]" if r else m for r in runs for m in sc["metrics"]]
        for full in ordered:
            if full not in orig and full not in ours:
                continue
            base, _, run = full.partition("[")
            run = run.rstrip("]")
            label, better = METRIC_LABELS.get(base, (base, ""))
            if run:
                label = f"{label} ({run})"
            o, u = orig.get(full), ours.get(full)
            ratio = f"{u / o:.2f}" if isinstance(o, (int, float)) and isinstance(u, (int, float)) and o else "-"
            rows.append((key, label, fmt(o), fmt(u), ratio, better))
    return machine.text_table(rows)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per load run (scenarios a, b)")
    ap.add_argument("--only", choices=("ours", "original"), default=None)
    ap.add_argument("--scenarios", default="a,b,c,d", help="comma list from a,b,c,d,e")
    ap.add_argument("--startup-repeats", type=int, default=5)
    ap.add_argument("--clients", default="raw,aiohttp",
                    help="load clients for scenarios a, b, e (benchmarks/sse_client.py): raw, aiohttp or both")
    ap.add_argument("--original-bin", type=Path, default=None,
                    help="path of the original dynamo-run (default: fetch ai-dynamo==0.3.2)")
    ap.add_argument("--ours-cmd", default=None,
                    help="command template for our server, with {port} and {model}")
    ap.add_argument("--no-uvloop", action="store_true")
    ap.add_argument("--client-batch", action="store_true",
                    help="run the load generator as SCHED_BATCH, so that its wake-ups do not preempt the "
                         "server on a shared core (as a client on another machine; loadgen.batch_policy)")
    ap.add_argument("--out", type=Path, default=None, help="JSON output file")
    args = ap.parse_args()

    uv = False if args.no_uvloop else loadgen.install_uvloop()
    global CLIENT_BATCH
    CLIENT_BATCH = args.client_batch
    order = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    clients = tuple(c.strip() for c in args.clients.split(",") if c.strip())
    if not clients or any(c not in ("raw", "aiohttp") for c in clients):
        ap.error("--clients takes raw, aiohttp or raw,aiohttp")
    scs = scenarios(args.duration, args.startup_repeats, clients)
    for s in order:
        if s not in scs:
            ap.error(f"unknown scenario {s!r}")

    stamp = time.strftime("%Y%m%d-%H%M%S")
    servers: list[tuple[str, Callable, dict[str, str]]] = []
    info: dict[str, Any] = {}
    if args.only in (None, "original"):
        binary = args.original_bin or fetch_original.fetch()
        servers.append(("original", original_cmd(binary), {}))
        info["original_bin"] = str(binary)
        info["original_sha256"] = sha256(binary)
    if args.only in (None, "ours"):
        build, env = ours_cmd(args.ours_cmd)
        servers.append(("ours", build, env))
        info["ours_cmd"] = shlex.join(build(0, MODEL))

    meta = {
        **machine.describe(),
        "uvloop": uv,
        "client_batch": args.client_batch,
        "duration_s": args.duration,
        "scenarios": {k: scs[k]["title"] for k in order},
        **info,
    }
    print(f"echo_compare: {meta['cpus']} CPUs ({meta['cpu_model']}), "
          f"load average {machine.format_load(meta['loadavg_at_start'])}, "
          f"uvloop={uv}", flush=True)
    for name, build, _ in servers:
        print(f"  {name}: {shlex.join(build(0, MODEL))}")

    results: dict[str, Any] = {}
    for key in order:
        sc = scs[key]
        print(f"\n== scenario {key}: {sc['title']}", flush=True)
        results[key] = {}
        for name, build, env in servers:
            print(f"  -- {name}", flush=True)
            try:
                results[key][name] = run_scenario(key, sc, name, build, env,
                                                  RESULTS / f"server-{name}-{stamp}.log")
            except ServerError as e:
                print(f"    FAILED: {e}", flush=True)
                results[key][name] = {"error": str(e), "metrics": {}}

    print("\n" + table(results, scs, order))
    out = args.out or RESULTS / f"echo_compare-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
