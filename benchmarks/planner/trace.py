"""Load traces in Mooncake's JSONL format, and two synthetic ones for the planner benchmark.

One request per line: ``{"timestamp": <ms from the start>, "input_length": N, "output_length": M,
"hash_ids": [...]}``, where each hash id names a block of 512 prompt tokens (two requests with the same
leading hash ids share that prefix), as in Mooncake's published traces and Dynamo's benchmarks.

Shapes (arrivals are Poisson at the shape's rate, seeded, so a trace is the same on every run):

* ``step``: a third of the time at the low rate, a third at the high rate, a third low again;
* ``day``: one day compressed into the duration: low at night, rising to the high rate at noon, low again
  (``low + (high - low) * (1 - cos(2 pi t / T)) / 2``).

``python -m benchmarks.planner.trace --shape day --out day.jsonl`` writes one.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> dict:
        return {"timestamp": round(self.timestamp_ms, 3), "input_length": self.input_length,
                "output_length": self.output_length, "hash_ids": list(self.hash_ids)}


def read_jsonl(path: str | Path) -> list[TraceRequest]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            out.append(TraceRequest(float(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"]),
                                    tuple(int(h) for h in obj.get("hash_ids", ()))))
        except (ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"{path}:{n}: not a Mooncake trace line ({exc})") from None
    return sorted(out, key=lambda r: r.timestamp_ms)


def write_jsonl(trace: list[TraceRequest], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(r.to_json()) + "\n" for r in trace))


def rate_function(shape: str, duration_s: float, low: float, high: float) -> Callable[[float], float]:
    if shape == "step":
        return lambda t: high if duration_s / 3 <= t < 2 * duration_s / 3 else low
    if shape == "day":
        return lambda t: low + (high - low) * (1 - math.cos(2 * math.pi * t / duration_s)) / 2
    raise SystemExit(f"unknown trace shape {shape!r}: step or day")


def synthesize(shape: str, *, duration_s: float, low_rps: float, high_rps: float, isl: int, osl: int,
               prefix_groups: int = 8, prefix_blocks: int = 1, seed: int = 7) -> list[TraceRequest]:
    """Poisson arrivals at the shape's rate (thinning a process at the peak rate); input and output lengths
    spread +-25% around ``isl`` and ``osl``; each prompt starts with one of ``prefix_groups`` shared
    prefixes of ``prefix_blocks`` blocks (a system prompt), the rest its own."""
    rate = rate_function(shape, duration_s, low_rps, high_rps)
    peak = max(low_rps, high_rps)
    rng = random.Random(seed)
    t, out, next_hash = 0.0, [], prefix_groups * prefix_blocks
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return out
        if rng.random() > rate(t) / peak:
            continue
        n_in = max(1, round(isl * rng.uniform(0.75, 1.25)))
        n_out = max(2, round(osl * rng.uniform(0.75, 1.25)))
        group = rng.randrange(prefix_groups)
        blocks = math.ceil(n_in / BLOCK_TOKENS)
        shared = [group * prefix_blocks + b for b in range(min(prefix_blocks, blocks))]
        own = list(range(next_hash, next_hash + blocks - len(shared)))
        next_hash += len(own)
        out.append(TraceRequest(t * 1000.0, n_in, n_out, tuple(shared + own)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner.trace", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=("step", "day"), default="step")
    p.add_argument("--duration", type=float, default=240.0, help="seconds (default 240)")
    p.add_argument("--low-rps", type=float, default=1.0)
    p.add_argument("--high-rps", type=float, default=6.0)
    p.add_argument("--isl", type=int, default=1024)
    p.add_argument("--osl", type=int, default=96)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", required=True, help="JSONL file to write")
    a = p.parse_args(argv)
    trace = synthesize(a.shape, duration_s=a.duration, low_rps=a.low_rps, high_rps=a.high_rps, isl=a.isl,
                       osl=a.osl, seed=a.seed)
    write_jsonl(trace, a.out)
    print(f"{len(trace)} requests over {a.duration:g} s -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
