#!/usr/bin/env python3
"""Summarise the ``dynamo.ttft`` debug lines of a server log (``-v``): per stage, the median and the
range of its offset from the request's arrival, over the streamed requests, in ms.

    .venv/bin/python -m benchmarks.ttft_stamps benchmarks/results/server-llamacpp-ours-<time>.log [--first N] [--skip N]

Only streamed requests count (a unary one's line ends with ``answer``, not ``first write``: the
warm-up questions of ``llamacpp_compare.py``).  ``--skip N`` leaves out the first N of them, ``--first N``
keeps the next N only (``llamacpp_compare.py --levels 1,8``: ``--first 8`` is the one-stream level,
``--skip 8`` the eight-stream one).  The prompt step's thread counts are counted too.
"""
from __future__ import annotations

import argparse
import re
import statistics
from collections import Counter
from pathlib import Path

STAGE = re.compile(r"(?:, |: )([a-z][a-z ,]*?) (\d+\.\d)(?: \(([^)]*)\))?")


def parse(line: str) -> list[tuple[str, float, str]]:
    body = line.split("dynamo.ttft: request ", 1)[1].split(": ", 1)[1]
    return [(n, float(t), d or "") for n, t, d in STAGE.findall(": " + body)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--first", type=int, default=0)
    args = ap.parse_args()
    rows = [parse(ln) for ln in args.log.read_text(errors="replace").splitlines()
            if "dynamo.ttft: request " in ln and ln.rstrip().endswith(tuple("0123456789"))]
    rows = [r for r in rows if r and r[-1][0] == "first write"][args.skip:]
    if args.first:
        rows = rows[:args.first]
    if not rows:
        raise SystemExit("no streamed requests with dynamo.ttft stamps in this log (was it run with -v?)")
    order: list[str] = []
    at: dict[str, list[float]] = {}
    threads: Counter[str] = Counter()
    for r in rows:
        for name, t, detail in r:
            if name not in at:
                order.append(name)
            at.setdefault(name, []).append(t)
            m = re.search(r"(\d+) threads", detail) if name == "prompt step" else None
            if m:
                threads[m.group(1)] += 1
    print(f"{len(rows)} requests; ms since arrival: median (min-max)")
    for name in order:
        v = at[name]
        print(f"  {name:22s} {statistics.median(v):7.1f}  ({min(v):.1f}-{max(v):.1f})  n={len(v)}")
    step = [b - a for a, b in zip(at.get("prompt step", []), at.get("step done", []), strict=False)]
    if step:
        print(f"  prompt step length     {statistics.median(step):7.1f}  ({min(step):.1f}-{max(step):.1f})")
    if threads:
        print("  prompt step threads: " + ", ".join(f"{k}: {n}" for k, n in sorted(threads.items())))


if __name__ == "__main__":
    main()
