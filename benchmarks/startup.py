#!/usr/bin/env python3
"""Start-up time of ``dynamo-run in=http out=echo_full``: from ``exec`` to the first answer.

    .venv/bin/python -m benchmarks.startup                       # ours, 10 starts
    .venv/bin/python -m benchmarks.startup --repeats 20 --cmd '/path/to/dynamo-run in=http out=echo_full --http-port {port} --model-name {model}'
    .venv/bin/python -m benchmarks.startup --importtime 25       # plus the 25 slowest imports of one start

For each start: take the time, spawn the command (``{port}`` and ``{model}`` filled in), then poll
``GET /v1/models`` on a fresh connection every 2 ms until it answers 200 listing the model ("models
ms"), then send one non-streaming chat completion ("chat ms": when its answer has arrived).  CPU is
the server's CPU time (its threads' run time) when /v1/models first answered.  The server is stopped with SIGINT between
starts.  Printed: every start, then median and min.  The default command is
``<python> -m dynamo.cli`` with this checkout's ``src`` first on PYTHONPATH (the console script
``dynamo-run`` adds its own few ms of entry-point lookup; ``--cmd`` measures any other).

``--floor`` also times (wall and CPU, median of the same number of runs; with the garbage collector
paused, as dynamo-run imports, and exiting with ``os._exit`` so that the interpreter's clean-up is not
counted) interpreters that only import (``FLOORS``): nothing; the libraries without aiohttp (asyncio,
uvloop, msgspec, orjson, argparse); the libraries and our modules except the HTTP service (the least a
server on a leaner HTTP stack would import); the libraries and aiohttp's server as
``dynamo.frontend.http`` imports it (the floor of ours, without our other modules); the libraries and
all of aiohttp (a plain ``import aiohttp.web``).  The floors run with this checkout's ``src`` on
PYTHONPATH.

``--importtime N`` runs one more start under ``python -X importtime`` and prints the N imports with
the largest cumulative time (and the total), which is where start-up goes.

``--against DIR`` alternates starts of this checkout with starts of another checkout's ``DIR/src``
(e.g. a ``git worktree`` of main), one each in turn, so both see the same load: the way to compare two
versions on a shared machine.

Bytecode: an installed package has its ``.pyc`` files (pip compiles them); a checkout run with
``PYTHONDONTWRITEBYTECODE=1`` (as on our development machines) compiles every module of ``src/`` on every
start, about 40 ms here.  By default the starts use cached bytecode in a temporary
``PYTHONPYCACHEPREFIX`` (filled by one unmeasured start per command first), i.e. what a user gets;
``--no-bytecode`` runs with the environment as it is.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import machine

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODEL = "bench-echo"
_LIBS = "import asyncio, uvloop, msgspec, orjson, argparse"
FLOORS = (
    ("bare interpreter", "pass"),
    ("libraries without aiohttp", _LIBS),
    ("libraries + our modules but the HTTP service", _LIBS + "; import dynamo.cli.launch, dynamo.engines.echo"),
    ("libraries + aiohttp's server only", _LIBS + "; import dynamo.frontend.http"),
    ("libraries + all of aiohttp", _LIBS + "; import aiohttp.web"),
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` so far: its threads' run time from ``/proc/PID/task/*/schedstat`` (nanoseconds;
    a thread that has already exited is not counted), else utime+stime (10 ms ticks)."""
    try:
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        if total:
            return total / 1e9
    except (OSError, ValueError, IndexError):
        pass
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def build_cmd(template: str | None, port: int, extra_python_flags: list[str]) -> list[str]:
    if template:
        return shlex.split(template.format(port=port, model=MODEL))
    return [sys.executable, *extra_python_flags, "-m", "dynamo.cli", "in=http", "out=echo_full",
            "--http-port", str(port), "--model-name", MODEL]


def _get(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request(method, path, body, {"Content-Type": "application/json"} if body else {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def one_start(template: str | None, extra_python_flags: list[str] = (), stderr=subprocess.DEVNULL,
              timeout: float = 30.0, src: Path = REPO / "src") -> dict[str, float]:
    port = free_port()
    cmd = build_cmd(template, port, list(extra_python_flags))
    env = dict(os.environ)
    if not template:
        env["PYTHONPATH"] = str(src) + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        t_models = cpu = None
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {shlex.join(cmd)}")
            try:
                status, body = _get(port, "GET", "/v1/models")
                if status == 200 and MODEL.encode() in body:
                    t_models = time.perf_counter()
                    cpu = cpu_seconds(proc.pid)
                    break
            except OSError:
                pass
            time.sleep(0.002)
        if t_models is None:
            raise RuntimeError(f"no answer in {timeout} s: {shlex.join(cmd)}")
        chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
        status, _ = _get(port, "POST", "/v1/chat/completions", chat)
        t_chat = time.perf_counter()
        if status != 200:
            raise RuntimeError(f"chat answered {status}")
        return {"models_ms": (t_models - t0) * 1e3, "chat_ms": (t_chat - t0) * 1e3, "cpu_s": cpu}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _floor_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))


def time_commands(cmds: list[list[str]], repeats: int) -> list[tuple[float, float, float]]:
    """Per command: median wall, median CPU and min CPU seconds of running it to completion (the commands
    take turns, so that they see the same load)."""
    walls: list[list[float]] = [[] for _ in cmds]
    cpus: list[list[float]] = [[] for _ in cmds]
    for _ in range(repeats):
        for i, cmd in enumerate(cmds):
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, env=_floor_env())
            walls[i].append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus[i].append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
    return [(statistics.median(w), statistics.median(c), min(c)) for w, c in zip(walls, cpus, strict=True)]


def importtime(template: str | None, top: int) -> None:
    with tempfile.TemporaryFile() as err:
        one_start(template, ["-X", "importtime"], stderr=err)
        err.seek(0)
        rows = []
        for line in err.read().decode().splitlines():
            if not line.startswith("import time:") or "cumulative" in line:
                continue
            parts = line[12:].split("|")
            rows.append((int(parts[1]), int(parts[0]), parts[2].rstrip()))
    total = sum(r[1] for r in rows)
    print(f"\n{len(rows)} modules imported, {total / 1e3:.1f} ms in total (self times)")
    print("cumulative ms  self ms  module")
    for cum, self_, name in sorted(rows, reverse=True)[:top]:
        print(f"{cum / 1e3:13.1f}  {self_ / 1e3:7.1f}  {name}")


def summarize(label: str, runs: list[dict[str, float]]) -> None:
    for key, what in (("models_ms", "exec -> /v1/models"), ("chat_ms", "exec -> first chat")):
        vals = [r[key] for r in runs]
        print(f"{label}{what}: median {statistics.median(vals):.1f} ms, min {min(vals):.1f} ms, "
              f"max {max(vals):.1f} ms ({len(vals)} starts)")
    cpus = [r["cpu_s"] for r in runs]
    print(f"{label}CPU until /v1/models: median {statistics.median(cpus) * 1e3:.0f} ms, min {min(cpus) * 1e3:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--cmd", help="server command; {port} and {model} are filled in")
    ap.add_argument("--against", type=Path, metavar="DIR",
                    help="another checkout: alternate its starts (DIR/src) with this checkout's")
    ap.add_argument("--no-bytecode", action="store_true",
                    help="run with the environment's bytecode settings (default: cached .pyc, as installed)")
    ap.add_argument("--importtime", type=int, metavar="N", default=0,
                    help="also show the N slowest imports of one start (python -X importtime)")
    ap.add_argument("--floor", action="store_true",
                    help="also time a bare interpreter and one importing only the libraries the server needs")
    args = ap.parse_args()
    if args.against and args.cmd:
        ap.error("--against compares two checkouts' src/; it does not combine with --cmd")
    pycache = None
    if not args.no_bytecode:
        pycache = tempfile.TemporaryDirectory(prefix="startup-pyc-")
        os.environ["PYTHONPYCACHEPREFIX"] = pycache.name
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    print(f"bytecode: {'as the environment has it' if args.no_bytecode else 'cached (' + pycache.name + ')'}; "
          f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}")
    variants = [("", REPO / "src")]
    if args.against:
        variants = [("this: ", REPO / "src"), ("against: ", args.against.resolve() / "src")]
    if pycache is not None:
        for _, src in variants:  # fill the bytecode cache; not measured
            one_start(args.cmd, src=src)
            if args.floor:
                for _, code in FLOORS:
                    subprocess.run([sys.executable, "-c", code], check=True, env=_floor_env())
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in variants}
    for i in range(args.repeats):
        for label, src in variants:
            r = one_start(args.cmd, src=src)
            runs[label].append(r)
            print(f"{label}start {i + 1:2d}: /v1/models {r['models_ms']:6.1f} ms, chat {r['chat_ms']:6.1f} ms, "
                  f"CPU {r['cpu_s'] * 1e3:.0f} ms", flush=True)
    for label, _ in variants:
        summarize(label, runs[label])
    if args.floor:
        # the collector paused, as dynamo-run's start-up has it; os._exit: the clean-up at exit is not a start
        results = time_commands([[sys.executable, "-c", f"import gc; gc.disable(); {code}; import os; os._exit(0)"]
                                 for _, code in FLOORS], args.repeats)
        for (label, code), (wall, cpu, cpu_min) in zip(FLOORS, results, strict=True):
            print(f"{label} ({code}): median wall {wall * 1e3:.1f} ms, CPU median {cpu * 1e3:.1f} ms, "
                  f"min {cpu_min * 1e3:.1f} ms")
    print(f"load average: {machine.format_load(machine.load_average())}")
    if args.importtime and not args.cmd:
        importtime(args.cmd, args.importtime)
    if pycache is not None:
        pycache.cleanup()


if __name__ == "__main__":
    main()
