"""Python calls per streamed token of our `in=http out=echo_full`, counted by cProfile.

    PYTHONPATH=src .venv/bin/python -m benchmarks.calls_per_token [--streams 64] [--duration 6]
        [--client raw|aiohttp] [--delay-ms 10] [--top 25] [--stats FILE]

Why call counts: they do not depend on how busy the machine is (CPU time per token does), so a change
on the per-token path can be judged while other work shares the cores.  The server runs under this
module (``serve``), which turns cProfile on with SIGUSR1 and off (writing the stats) with SIGUSR2; the
load runs in this process after a short warm-up, and the window covers exactly the measured load.
Prints the calls per token and the functions with the most calls per token.  With 256 streams the
profiler itself can make the server fall behind, and then several tokens leave per write: use fewer
streams (64, the default) so that every token stays its own write, as on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import loadgen
from benchmarks.echo_compare import MODEL, REPO, Server, ours_cmd


def serve(argv: list[str]) -> None:
    """Run ``dynamo.cli`` with the argv, profiling between SIGUSR1 and SIGUSR2 (stats to $CPT_STATS)."""
    import cProfile

    from dynamo.cli.main import main

    prof = cProfile.Profile()
    out = os.environ["CPT_STATS"]

    def on(*_: object) -> None:
        prof.enable()

    def off(*_: object) -> None:
        prof.disable()
        prof.dump_stats(out)

    signal.signal(signal.SIGUSR1, on)
    signal.signal(signal.SIGUSR2, off)
    sys.argv = ["dynamo-run", *argv]
    sys.exit(main())


def report(stats_file: str, tokens: int, writes: int | None, top: int) -> None:
    st = pstats.Stats(stats_file)
    total = sum(v[1] for v in st.stats.values())  # type: ignore[attr-defined]
    print(f"tokens {tokens}, python calls {total}: {total / tokens:.2f} calls per token"
          + (f", {tokens / writes:.2f} tokens per write" if writes else ""))
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][1])  # type: ignore[attr-defined]
    for (file, line, name), (_cc, nc, tt, _ct, _callers) in rows[:top]:
        short = "/".join(Path(file).parts[-2:]) if file != "~" else ""
        print(f"  {nc / tokens:6.3f}/token  tottime {tt * 1e6 / tokens:6.2f} us/token  {short}:{line} {name}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--client", choices=("raw", "aiohttp"), default="aiohttp")
    ap.add_argument("--delay-ms", type=float, default=10.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--stats", default=None, help="keep the cProfile stats in this file")
    args = ap.parse_args()

    build, env = ours_cmd(None)
    stats_file = args.stats or tempfile.mktemp(suffix=".pstats")

    def cmd(port: int, model: str) -> list[str]:
        return [sys.executable, "-m", "benchmarks.calls_per_token", "serve", *build(port, model)[-6:]]

    env = {**env, "CPT_STATS": stats_file, "DYN_TOKEN_ECHO_DELAY_MS": str(args.delay_ms)}
    # this checkout's src/ and benchmarks (the venv's dynamo-run may point at another checkout)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH")) if p)
    log = Path(tempfile.gettempdir()) / f"calls_per_token-{os.getpid()}.log"
    server = Server("ours", cmd, env, log)
    server.start()
    try:
        server.wait_ready()
        loadgen.install_uvloop()
        # warm-up: the first requests import and build what a server makes on first use
        asyncio.run(loadgen.run_load(server.url, MODEL, concurrency=4, duration=None, requests=8,
                                     max_tokens=4, client=args.client))
        os.kill(server.proc.pid, signal.SIGUSR1)
        r = asyncio.run(loadgen.run_load(server.url, MODEL, concurrency=args.streams, duration=args.duration,
                                         client=args.client, server_pid=server.proc.pid))
        os.kill(server.proc.pid, signal.SIGUSR2)
        for _ in range(200):
            if os.path.exists(stats_file) and os.path.getsize(stats_file) > 0:
                break
            time.sleep(0.05)
        time.sleep(0.5)
        report(stats_file, r["tokens"], r["server_write_calls"], args.top)
        print(f"coalesced at the client {r['itl_ms']['coalesced_frac']:.1%}, errors {r['errors']}")
    finally:
        server.proc.send_signal(signal.SIGINT)
        try:
            server.proc.wait(10)
        except subprocess.TimeoutExpired:
            server.proc.kill()


if __name__ == "__main__":
    main()
