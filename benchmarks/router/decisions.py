#!/usr/bin/env python3
"""Read a KV router's decision log (``DYN_ROUTER_LOG``, src/dynamo/kv/decision_log.py): where the time to
first token went, decision by decision.

    .venv/bin/python -m benchmarks.router.decisions DIR/…-decisions.jsonl [--list] [--worker-logs DIR/…-worker*.log]

Replays the log's KV events in order, so that for every decision it knows what each worker really had
cached *and* what had been routed there before (by the earlier decisions of the log) but not reported
yet.  Each decision is put in one class:

* ``hit``: the chosen worker was known to hold at least half of the prompt's blocks;
* ``restored``: the chosen worker was not known to hold half of the prompt's blocks in its device cache,
  but the router expected at most half of the prompt to be computed there: the rest restored from a host
  or disk tier the worker reported, or fetched from the worker that holds it (the route line's ``prefill``
  less the worker's ``active_tokens``, set against the prompt's length);
* ``unreported``: some worker had been sent a request with a longer prefix of this prompt, whose KV
  event had not arrived when this one was routed (the router could not see it as cached), and which
  had not been evicted since;
* ``elsewhere``: another worker was known to hold a longer prefix, and the router chose a worker with
  less of it (load won);
* ``cold``: no worker held, or had been sent, half of the prompt.

For each class: how many, the router-side TTFT (decision to first token, what the router's own clock
saw; the client's TTFT adds the frontend's tokenization and the HTTP hops) p50 / mean, and how many other
requests were in flight on the chosen worker.  ``event lag``: for decisions whose prompt prefix had been
routed to the chosen worker before, how long after the decision the stored event of that prefix arrived
(negative: before).  With ``--worker-logs`` (llamacpp workers run with ``dynamo.engines.llamacpp=debug``,
as ``benchmarks.router.real --logs`` does), each decision's predicted overlap is set against the blocks
llama.cpp really reused for it (the request ids are the same on both sides).

``what if``: for each ``elsewhere`` decision, from the cost terms the log holds, the smallest
``--kv-overlap-score-weight`` with which the worker holding the prefix would have won (none when its
pending prefill alone outweighs the whole prompt on the chosen worker), and whether it would have won at
the logged weight had the decode term left out the blocks of requests still prefilling (whose tokens the
prefill term already counts).  The second replays which requests were in flight where from the log's own
route / first / done lines, so it holds for logs of a router that counts those blocks (this one).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import orjson

REUSE = re.compile(rb"request (\S+): slot \d+, (\d+) prompt tokens, (\d+) reused from the cache")


def engine_reuse(paths: list[Path]) -> dict[str, tuple[int, int]]:
    """request id -> (prompt tokens, tokens llama.cpp reused), from llamacpp workers' debug logs."""
    out: dict[str, tuple[int, int]] = {}
    for p in paths:
        for m in REUSE.finditer(p.read_bytes()):
            out[m.group(1).decode()] = (int(m.group(2)), int(m.group(3)))
    return out


def load(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def prefix_in(blocks: list[int], have: set[int]) -> int:
    n = 0
    for b in blocks:
        if b not in have:
            break
        n += 1
    return n


def analyse(lines: list[dict[str, Any]]) -> dict[str, Any]:
    cached: dict[str, set[int]] = {}  # worker -> blocks its events say it holds (device tier)
    routed: dict[str, dict[int, float]] = {}  # worker -> block -> when a decision last sent it there
    stored_at: dict[tuple[str, int], float] = {}  # (worker, block) -> when its stored event arrived
    first: dict[str, float] = {}
    for ln in lines:
        if ln["ev"] == "first" and ln["id"] not in first:
            first[ln["id"]] = ln["t"]
    decisions: list[dict[str, Any]] = []
    # worker -> request id -> [its complete blocks, still prefilling?]: what the router had in flight
    inflight: dict[str, dict[str, list[Any]]] = {}
    where: dict[str, str] = {}
    pending_lag: list[tuple[dict[str, Any], str, int]] = []  # (decision, worker, boundary block)
    for ln in lines:
        ev, t = ln["ev"], ln["t"]
        if ev == "stored" and ln.get("tier") in (None, "device"):
            have = cached.setdefault(ln["worker"], set())
            for b in ln["blocks"]:
                have.add(b)
                stored_at.setdefault((ln["worker"], b), t)
        elif ev == "removed" and ln.get("tier") in (None, "device"):
            have = cached.setdefault(ln["worker"], set())
            sent = routed.get(ln["worker"], {})
            for b in ln["blocks"]:
                have.discard(b)
                sent.pop(b, None)  # evicted: no longer on its way either
                stored_at.pop((ln["worker"], b), None)
        elif ev in ("first", "done") and ln["id"] in where:
            w = where[ln["id"]]
            if ev == "first":
                inflight[w][ln["id"]][1] = False
            else:
                inflight[w].pop(ln["id"], None)
                del where[ln["id"]]
        elif ev == "cleared":
            cached[ln["worker"]] = set()
            routed.pop(ln["worker"], None)
        elif ev == "route":
            blocks = ln["blocks"]  # the complete blocks' sequence hashes
            n = max(1, len(blocks))
            chosen = ln["worker"]
            cands = ln["candidates"]
            best_known = max((c["overlap"] for c in cands.values()), default=0)
            best_routed = 0
            for w in cands:
                sent = routed.get(w, {})
                best_routed = max(best_routed, prefix_in(blocks, set(sent)) if sent else 0)
            mine = cands.get(chosen, {})
            o = mine.get("overlap", 0)
            own_prefill = mine.get("prefill", ln.get("isl", 0)) - mine.get("active_tokens", 0)
            if o >= n / 2:
                klass = "hit"
            elif "isl" in ln and own_prefill <= ln["isl"] / 2:
                klass = "restored"
            elif best_routed > best_known and best_routed >= n / 2:
                klass = "unreported"
            elif best_known > o and best_known >= n / 2:
                klass = "elsewhere"
            else:
                klass = "cold"
            d = {"t": t, "id": ln["id"], "worker": chosen, "class": klass, "blocks": n, "overlap": o,
                 "best_known": best_known, "best_routed": best_routed, "inflight": mine.get("inflight", 0),
                 "others_in_flight": mine.get("requests", 0),
                 "ttft": (first[ln["id"]] - t) if ln["id"] in first else None}
            if klass == "elsewhere":
                holder = max(cands, key=lambda w: cands[w]["overlap"])
                d["what_if"] = what_if(cands[holder], mine, inflight.get(holder, {}), inflight.get(chosen, {}))
            decisions.append(d)
            sent = routed.get(chosen, {})
            shared = prefix_in(blocks, set(sent)) if sent else 0
            if shared:
                pending_lag.append((d, chosen, blocks[shared - 1]))
            dest = routed.setdefault(chosen, {})
            for b in blocks:
                dest[b] = t
            if ln["id"]:
                inflight.setdefault(chosen, {})[ln["id"]] = [blocks, True]
                where[ln["id"]] = chosen
    lags = []
    for d, w, b in pending_lag:
        at = stored_at.get((w, b))
        if at is not None:
            lags.append(at - d["t"])
    return {"decisions": decisions, "event_lags": lags}


def prefilling_only_blocks(reqs: dict[str, list[Any]]) -> int:
    """Blocks held only by requests still prefilling (each with its private partial tail), which the
    decode term counts although their tokens are already in the prefill term."""
    decoding = {b for blocks, pre in reqs.values() if not pre for b in blocks}
    only = {b for blocks, pre in reqs.values() if pre for b in blocks} - decoding
    return len(only) + sum(1 for _, pre in reqs.values() if pre)


def what_if(holder: dict[str, Any], chosen: dict[str, Any], holder_reqs: dict[str, list[Any]],
            chosen_reqs: dict[str, list[Any]], block_size: int = 16) -> dict[str, Any]:
    """For an ``elsewhere`` decision, from its logged cost terms: the smallest overlap weight with which the
    worker holding the prefix would have won (None: none would, its pending prefill outweighs the
    prefix), and whether it would have won at the logged weight if the decode term left out the blocks
    of requests still prefilling."""
    dp = chosen["prefill"] - holder["prefill"]
    dd = holder["decode"] - chosen["decode"]
    weight = None if dp <= 0 else round(max(0.0, dd * block_size / dp), 2)
    # the logged weight, recovered from the chosen worker's own terms
    w = (chosen["logit"] - chosen["decode"]) * block_size / chosen["prefill"] if chosen["prefill"] else 0.0
    h_dec = holder["decode"] - prefilling_only_blocks(holder_reqs)
    c_dec = chosen["decode"] - prefilling_only_blocks(chosen_reqs)
    keeps = w * holder["prefill"] / block_size + h_dec < w * chosen["prefill"] / block_size + c_dec
    return {"weight_needed": weight, "kept_without_prefilling_blocks": keeps,
            "holder": {k: holder[k] for k in ("prefill", "decode", "logit", "active_tokens", "requests")},
            "chosen": {k: chosen[k] for k in ("prefill", "decode", "logit", "active_tokens", "requests")}}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def report(result: dict[str, Any], listing: bool = False, reuse: dict[str, tuple[int, int]] | None = None,
           block_size: int = 16) -> str:
    out = []
    ds = result["decisions"]
    out.append(f"{len(ds)} decisions")
    if reuse:
        for d in ds:
            got = reuse.get(d["id"] or "")
            d["reused_blocks"] = None if got is None else got[1] // block_size
        known = [d for d in ds if d.get("reused_blocks") is not None]
        short = [d for d in known if d["reused_blocks"] + 1 < d["overlap"]]
        out.append(f"  predicted vs reused: {len(short)} of {len(known)} decisions reused at least 2 blocks less "
                   f"than the router expected (the slot was given to another prompt before this one came)")
    for klass in ("hit", "restored", "unreported", "elsewhere", "cold"):
        sel = [d for d in ds if d["class"] == klass]
        if not sel:
            continue
        tt = [d["ttft"] * 1000 for d in sel if d["ttft"] is not None]
        busy = sum(1 for d in sel if d["others_in_flight"])
        out.append(f"  {klass:10s} {len(sel):4d}  router TTFT p50 {_f(pct(tt, 50))} ms, mean "
                   f"{_f(statistics.fmean(tt) if tt else None)} ms, p90 {_f(pct(tt, 90))} ms; chosen worker busy in "
                   f"{busy} ({busy / len(sel):.0%})")
    busy = [d for d in ds if d["others_in_flight"]]
    idle = [d for d in ds if not d["others_in_flight"]]
    for name, sel in (("busy worker", busy), ("idle worker", idle)):
        tt = [d["ttft"] * 1000 for d in sel if d["ttft"] is not None]
        out.append(f"  to a {name}: {len(sel)}, router TTFT p50 {_f(pct(tt, 50))} mean "
                   f"{_f(statistics.fmean(tt) if tt else None)} ms")
    elsewhere = [d["what_if"] for d in ds if d.get("what_if")]
    if elsewhere:
        needed = sorted(x["weight_needed"] for x in elsewhere if x["weight_needed"] is not None)
        out.append(f"  what if (elsewhere): the holder would have won with an overlap weight of at least "
                   f"{', '.join(f'{x:g}' for x in needed) or '-'}"
                   f"{f' (never, for {len(elsewhere) - len(needed)})' if len(needed) < len(elsewhere) else ''}; "
                   f"with no decode blocks for requests still prefilling, in "
                   f"{sum(x['kept_without_prefilling_blocks'] for x in elsewhere)} of {len(elsewhere)}")
    lags = result["event_lags"]
    if lags:
        late = sum(1 for x in lags if x > 0)
        out.append(f"  event lag (stored event of a prefix already routed to the chosen worker, after the decision): "
                   f"{late} of {len(lags)} arrived after it; p50 {_f(pct([x * 1000 for x in lags], 50))} ms")
    if listing:
        for d in ds:
            out.append(f"    {d['t']:.3f} {d['id']} -> {d['worker']} {d['class']:10s} blocks {d['blocks']} overlap "
                       f"{d['overlap']} known {d['best_known']} routed {d['best_routed']} inflight {d['inflight']} "
                       f"others {d['others_in_flight']} reused {d.get('reused_blocks', '-')} ttft {_f(d['ttft'] * 1000 if d['ttft'] else None)}")
            if d.get("what_if"):
                out.append(f"      {d['what_if']}")
    return "\n".join(out)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path, help="decision log files (JSON lines)")
    p.add_argument("--list", action="store_true", help="one line per decision")
    p.add_argument("--worker-logs", nargs="*", type=Path, default=[],
                   help="llamacpp workers' debug logs: compare the router's predicted overlap with what they reused")
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    reuse = engine_reuse(args.worker_logs) if args.worker_logs else None
    for path in args.logs:
        print(f"{path}:")
        print(report(analyse(load(path)), args.list, reuse, args.block_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
