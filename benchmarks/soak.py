"""Memory under sustained load: a kv-routed fleet (file discovery, 2 mocker workers,
1 frontend) under mixed load with unique prompts (harness/soak.py says which), the RSS and open file
descriptors of every process sampled from /proc, written as JSON and plotted.

    PYTHONPATH=src:. .venv/bin/python -m benchmarks.soak --seconds 900 [--clients 64] [--warmup 60]
        [--out benchmarks/results/soak] [--debug-memory [tracemalloc]] [--infra etcd-nats]
        [--http-workers N] [--frontend-env NAME=VALUE ...]

After ``--warmup`` seconds of the same load, the figures the goal is about: each process's RSS at the end of
warm-up, at the end, its peak, and the slope (least squares over the samples after warm-up, in MB per hour
and KB per request).  The goal: within max(8 MB, 3 %) of the warm-up figure over an hour and 200,000
requests, 0 failed, file descriptors flat.  ``--debug-memory [tracemalloc]`` starts the frontend with DYN_DEBUG_MEMORY=1 (or tracemalloc)
and records its /debug/memory (structure sizes, object counts by type, the top tracemalloc differences)
at the end of warm-up and at the end: where growth is, when there is some.

The plot is ``soak.png`` with matplotlib, else ``soak.svg`` drawn here (the venv does not need matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import describe, load_average
from harness.soak import LoadStats, debug_memory, kv_fleet, mixed_load, proc_sample
from harness.tiny_model import build_tiny_hf_model

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than 2 points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def summarise(samples: list[dict[str, Any]], warmup: float) -> dict[str, Any]:
    after = [s for s in samples if s["t"] >= warmup]
    out: dict[str, Any] = {}
    for name in samples[0]["procs"]:
        ts = [s["t"] for s in after]
        rss = [s["procs"][name]["rss_mb"] for s in after]
        reqs = [s["sent"] for s in after]
        fds = [s["procs"][name]["fds"] for s in after]
        per_s = slope(ts, rss)
        per_req = slope(reqs, rss)
        out[name] = {
            "rss_start_mb": round(samples[0]["procs"][name]["rss_mb"], 1),
            "rss_after_warmup_mb": round(rss[0], 1) if rss else None,
            "rss_end_mb": round(rss[-1], 1) if rss else None,
            "rss_peak_mb": round(max(rss), 1) if rss else None,
            "slope_mb_per_hour": round(per_s * 3600, 2),
            "slope_kb_per_request": round(per_req * 1024, 4),
            "fds_after_warmup": fds[0] if fds else None, "fds_end": fds[-1] if fds else None,
            "fds_max": max(fds) if fds else None,
        }
    return out


def plot(samples: list[dict[str, Any]], warmup: float, folder: Path) -> Path:
    names = list(samples[0]["procs"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return plot_svg(samples, warmup, names, folder / "soak.svg")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    ts = [s["t"] for s in samples]
    for name in names:
        ax1.plot(ts, [s["procs"][name]["rss_mb"] for s in samples], label=name)
        ax2.plot(ts, [s["procs"][name]["fds"] for s in samples], label=name)
    for ax in (ax1, ax2):
        ax.axvline(warmup, color="grey", linestyle=":")
        ax.legend()
    ax1.set_ylabel("RSS (MB)")
    ax2.set_ylabel("open fds")
    ax2.set_xlabel("seconds")
    path = folder / "soak.png"
    fig.savefig(path, dpi=100)
    return path


def plot_svg(samples: list[dict[str, Any]], warmup: float, names: list[str], path: Path) -> Path:
    """Two panels (RSS, fds) over time, one polyline per process, as plain SVG."""
    width, height, pad = 900, 300, 50
    ts = [s["t"] for s in samples]
    t_max = max(ts) or 1.0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{2 * height}" '
             'font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/>']
    for panel, (key, label) in enumerate((("rss_mb", "RSS (MB)"), ("fds", "open fds"))):
        y0 = panel * height
        values = [s["procs"][n][key] for s in samples for n in names]
        lo, hi = min(values), max(values)
        lo, hi = (lo - 1, hi + 1) if hi - lo < 2 else (lo, hi)

        def xy(t: float, v: float, y0: int = y0, lo: float = lo, hi: float = hi) -> str:
            x = pad + (width - 2 * pad) * t / t_max
            y = y0 + height - pad - (height - 2 * pad) * (v - lo) / (hi - lo)
            return f"{x:.1f},{y:.1f}"

        parts.append(f'<text x="5" y="{y0 + 20}">{label}: {lo:.0f} to {hi:.0f}; dotted: end of warm-up; '
                     f'x: 0 to {t_max:.0f} s</text>')
        for v in (lo, (lo + hi) / 2, hi):  # y ticks
            y = xy(0, v).split(",")[1]
            parts.append(f'<text x="2" y="{y}" font-size="10">{v:.0f}</text>')
            parts.append(f'<line x1="{pad}" y1="{y}" x2="{width - pad}" y2="{y}" stroke="#eee"/>')
        wx = pad + (width - 2 * pad) * warmup / t_max
        parts.append(f'<line x1="{wx:.1f}" y1="{y0 + pad}" x2="{wx:.1f}" y2="{y0 + height - pad}" '
                     'stroke="grey" stroke-dasharray="3,3"/>')
        for i, name in enumerate(names):
            colour = COLOURS[i % len(COLOURS)]
            points = " ".join(xy(s["t"], s["procs"][name][key]) for s in samples)
            parts.append(f'<polyline fill="none" stroke="{colour}" points="{points}"/>')
            parts.append(f'<text x="{width - 120}" y="{y0 + 20 + 14 * i}" fill="{colour}">{name}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))
    return path


async def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    model = build_tiny_hf_model(folder / "model", with_weights=False)
    frontend_env = dict(kv.split("=", 1) for kv in args.frontend_env)
    if args.debug_memory:
        frontend_env["DYN_DEBUG_MEMORY"] = args.debug_memory
    with kv_fleet(model, folder, frontend_env=frontend_env, infra=args.infra,
                  http_workers=args.http_workers) as fleet:
        pids = fleet.pids()
        base = fleet.frontend.base_url
        stats = LoadStats()
        samples: list[dict[str, Any]] = []
        t0 = time.monotonic()
        total = args.warmup + args.seconds
        load = asyncio.create_task(mixed_load(base, clients=args.clients, seconds=total, stats=stats))
        debug: dict[str, Any] = {}
        warm_done = False
        while not load.done():
            t = time.monotonic() - t0
            samples.append({"t": round(t, 1), "sent": stats.sent, "failed": stats.failed,
                            "load": load_average()[0], "procs": {n: proc_sample(p) for n, p in pids.items()}})
            if args.debug_memory and not warm_done and t >= args.warmup:
                warm_done = True
                debug["after_warmup"] = await asyncio.to_thread(debug_memory, fleet.frontend, top=0)
            await asyncio.wait([load], timeout=args.interval)
        await load
        samples.append({"t": round(time.monotonic() - t0, 1), "sent": stats.sent, "failed": stats.failed,
                        "load": load_average()[0], "procs": {n: proc_sample(p) for n, p in pids.items()}})
        if args.debug_memory:
            debug["end"] = await asyncio.to_thread(debug_memory, fleet.frontend, top=40)
    result = {"machine": describe(), "args": {k: str(v) for k, v in vars(args).items()}, "load": stats.as_dict(),
              "summary": summarise(samples, args.warmup), "samples": samples, "debug_memory": debug}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=900, help="load after warm-up")
    ap.add_argument("--warmup", type=float, default=60)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/soak"))
    ap.add_argument("--debug-memory", nargs="?", const="1", default="", choices=["1", "tracemalloc"],
                    help="frontend with DYN_DEBUG_MEMORY=1 (or =tracemalloc: allocation traces, ~2x slower)")
    ap.add_argument("--infra", choices=["files", "etcd-nats"], default="files",
                    help="file discovery + TCP + ZMQ (nothing to start), or an etcd and a nats-server of its own")
    ap.add_argument("--http-workers", type=int, default=0, help="the frontend as N processes on one port")
    ap.add_argument("--frontend-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for the frontend (e.g. a cache's cap), repeatable")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    out: Path = args.out
    path = out / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    picture = plot(result["samples"], args.warmup, out)
    print(json.dumps({"load": result["load"], "summary": result["summary"]}, indent=1))
    print(f"samples: {path}; plot: {picture}; load average at the end: {load_average()}")


if __name__ == "__main__":
    main()
