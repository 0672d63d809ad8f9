"""A worker's performance profile: the curves the planner sizes a fleet with, and their file format.

``dynamo-planner profile`` measures one worker and writes ``profile.json`` in a directory; the planner
(``--profile-results-dir DIR``) reads it back.  Two curves:

* **prefill**: for each input length swept, the time to first token of one request alone on the worker
  (``ttft_ms``) and the prefill throughput that implies (``prefill_tok_s``, input tokens per second);
* **decode**: for each concurrency swept, the inter-token latency (``itl_ms``), the KV cache usage the
  worker reported (``kv_usage``, 0..1, or -1 where it reports none) and the aggregate decode throughput
  (``decode_tok_s``, output tokens per second over all streams);

plus the seconds a worker takes from start to serving (``load_time_s``), which the planner adds to a
scale-up's lead time.

The interpolation is piecewise linear over the measured points (a dozen points at most: ``bisect`` is all
it needs, no numerical library); beyond the last point TTFT and ITL are extrapolated along the last
segment, because a planner asking about a longer prompt or a busier worker than was measured must get a
larger figure, not the last one.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dynamo.errors import UserError

PROFILE_FILE = "profile.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class PrefillPoint:
    """One request of ``isl`` input tokens alone on the worker."""

    isl: int
    ttft_ms: float
    prefill_tok_s: float


@dataclass(frozen=True)
class DecodePoint:
    """``concurrency`` streams decoding at once on the worker."""

    concurrency: int
    itl_ms: float
    kv_usage: float  # 0..1 as the worker reported it; -1: the worker reports none
    decode_tok_s: float


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through the points, extrapolated along the end segments (xs sorted, distinct)."""
    if len(xs) == 1:
        return ys[0]
    i = bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)  # the segment [i-1, i], the first or last one outside the range
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class WorkerProfile:
    """The measured curves of one worker (see the module docstring)."""

    prefill: list[PrefillPoint]
    decode: list[DecodePoint]
    load_time_s: float
    worker_cmd: str = ""  # what was measured, for the reader
    notes: dict[str, Any] = field(default_factory=dict)  # free-form: the sweep's settings, the machine

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise UserError("a worker profile needs at least one prefill point and one decode point")
        self.prefill = sorted(self.prefill, key=lambda p: p.isl)
        self.decode = sorted(self.decode, key=lambda p: p.concurrency)
        if len({p.isl for p in self.prefill}) != len(self.prefill) or \
                len({p.concurrency for p in self.decode}) != len(self.decode):
            raise UserError("a worker profile has two points for the same input length or concurrency")

    # -- the curves -------------------------------------------------------------------------------------

    def ttft_ms(self, isl: float) -> float:
        """TTFT of one request of ``isl`` input tokens on an otherwise idle worker (never below zero)."""
        xs = [p.isl for p in self.prefill]
        return max(0.0, _interpolate(xs, [p.ttft_ms for p in self.prefill], isl))

    def max_prefill_tok_s(self, isl: float | None = None) -> float:
        """Input tokens per second one worker prefills: for prompts of ``isl`` tokens (interpolated; past
        the sweep, the nearest end's rate: a rate does not grow without bound), or the most it reached in
        the sweep when ``isl`` is not given."""
        if isl is None:
            return max(p.prefill_tok_s for p in self.prefill)
        xs = [p.isl for p in self.prefill]
        clamped = min(max(float(isl), xs[0]), xs[-1])
        return max(0.0, _interpolate(xs, [p.prefill_tok_s for p in self.prefill], clamped))

    def itl_ms(self, concurrency: float) -> float:
        """Inter-token latency with ``concurrency`` streams decoding at once (never below zero)."""
        xs = [p.concurrency for p in self.decode]
        return max(0.0, _interpolate(xs, [p.itl_ms for p in self.decode], concurrency))

    def decode_tok_s(self, concurrency: float) -> float:
        """Aggregate output tokens per second with ``concurrency`` streams."""
        xs = [p.concurrency for p in self.decode]
        return max(0.0, _interpolate(xs, [p.decode_tok_s for p in self.decode], concurrency))

    def max_decode_concurrency(self, itl_target_ms: float) -> float:
        """The most streams one worker decodes at once with its ITL at or under the target.

        Interpolated between the measured points (a float: the planner divides a load by it); capped at
        the largest concurrency measured, since nothing is known beyond it; 0 when even the smallest
        concurrency measured misses the target."""
        points = self.decode
        if points[0].itl_ms > itl_target_ms:
            return 0.0
        best = float(points[0].concurrency)
        for lo, hi in zip(points, points[1:], strict=False):
            if hi.itl_ms <= itl_target_ms:
                best = float(hi.concurrency)
                continue
            if hi.itl_ms > lo.itl_ms:  # the target lies inside this segment
                best = lo.concurrency + (hi.concurrency - lo.concurrency) * (itl_target_ms - lo.itl_ms) / (
                    hi.itl_ms - lo.itl_ms)
            break
        return best

    # -- the file ---------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"version": FORMAT_VERSION, "worker_cmd": self.worker_cmd, "load_time_s": self.load_time_s,
                "prefill": [asdict(p) for p in self.prefill], "decode": [asdict(p) for p in self.decode],
                "notes": self.notes}

    @classmethod
    def from_json(cls, obj: Any) -> "WorkerProfile":
        if not isinstance(obj, dict) or obj.get("version") != FORMAT_VERSION:
            raise UserError(f"not a worker profile of format version {FORMAT_VERSION}")
        try:
            prefill = [PrefillPoint(int(p["isl"]), float(p["ttft_ms"]), float(p["prefill_tok_s"]))
                       for p in obj["prefill"]]
            decode = [DecodePoint(int(p["concurrency"]), float(p["itl_ms"]), float(p["kv_usage"]),
                                  float(p["decode_tok_s"])) for p in obj["decode"]]
            load_time_s = float(obj["load_time_s"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"a worker profile with a missing or invalid field: {exc}") from None
        numbers = [load_time_s] + [v for p in prefill for v in (p.ttft_ms, p.prefill_tok_s)] + \
            [v for p in decode for v in (p.itl_ms, p.decode_tok_s)]
        if not all(math.isfinite(v) and v >= 0 for v in numbers):
            raise UserError("a worker profile with a negative or non-finite figure")
        notes = obj.get("notes")
        return cls(prefill, decode, load_time_s, str(obj.get("worker_cmd", "")),
                   notes if isinstance(notes, dict) else {})

    def save(self, directory: str | Path) -> Path:
        """Write ``profile.json`` into ``directory`` (created if missing); returns the file's path."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        out = path / PROFILE_FILE
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(out)  # a reader never sees half a file
        return out

    @classmethod
    def load(cls, directory: str | Path) -> "WorkerProfile":
        """Read ``profile.json`` from ``directory``; a missing or malformed file is a one-line UserError."""
        path = Path(directory) / PROFILE_FILE
        try:
            obj = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"no worker profile at {path} (write one with: dynamo-planner profile)") from None
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read the worker profile {path}: {exc}") from None
        try:
            return cls.from_json(obj)
        except UserError as exc:
            raise UserError(f"{path}: {exc}") from None


def load(directory: str | Path) -> WorkerProfile:
    """``WorkerProfile.load``: the profile in ``directory``."""
    return WorkerProfile.load(directory)
