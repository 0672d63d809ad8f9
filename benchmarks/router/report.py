"""The router benchmark's report: a run's summary of its request records (TTFT, ITL, throughput, cache
hits), and the table, Markdown and TTFT plot of all runs."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.loadgen import pct
from benchmarks.router.client import Record


def summarize(records: list[Record], start: float, end: float, warmup: float) -> dict[str, Any]:
    ok = [r for r in records if r.status == 200 and not r.error]
    measured = [r for r in ok if r.sent >= warmup]
    ttft = [r.ttft for r in measured if r.ttft is not None]
    gaps = [g for r in measured for g in r.gaps]
    span = end - start
    out_tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "error_samples": sorted({f"{r.status} {r.error}" for r in records if r not in ok})[:5],
        "measured": len(measured),
        "ttft_p50_ms": _ms(pct(ttft, 50)), "ttft_p90_ms": _ms(pct(ttft, 90)), "ttft_p99_ms": _ms(pct(ttft, 99)),
        "ttft_mean_ms": _ms(statistics.fmean(ttft)) if ttft else None,
        "itl_p50_ms": _ms(pct(gaps, 50)), "itl_p99_ms": _ms(pct(gaps, 99)),
        "ttft_p50_by_turn_ms": {
            t: _ms(pct([r.ttft for r in measured if r.turn == t and r.ttft is not None], 50))
            for t in sorted({r.turn for r in measured})},
        "span_s": round(span, 2),
        "tokens_per_s": round(out_tokens / span, 1) if span > 0 else None,
        "requests_per_s": round(len(ok) / span, 2) if span > 0 else None,
        "mean_isl": round(statistics.fmean(r.prompt_tokens for r in ok), 1) if ok else None,
        "usage_hit_rate": (round(sum(r.cached_tokens or 0 for r in ok) / max(1, sum(r.prompt_tokens for r in ok)), 3)
                           if any(r.cached_tokens is not None for r in ok) else None),
        **hits_and_misses(measured, ok),
    }


def hits_and_misses(measured: list[Record], everything: list[Record] | None = None) -> dict[str, Any]:
    """Where the engine says how much it reused: the share of measured requests that took at least half of
    their prompt from the cache, and the TTFT p50 of those and of the rest (a mode's p50 is one or the
    other, whichever is the majority).  The hits are split in two: ``history`` hits reused the whole
    prompt of the conversation's previous turn (``everything``, measured or not, gives the previous
    turns), ``prefix`` hits reused less (the group's system prompt, as a worker that has served another
    conversation of the group holds it); a first turn's hit is always a prefix hit."""
    known = [r for r in measured if r.cached_tokens is not None and r.ttft is not None and r.prompt_tokens]
    if not known:
        return {}
    hits = [r for r in known if 2 * (r.cached_tokens or 0) >= r.prompt_tokens]
    misses = [r for r in known if r not in hits]
    previous = {(r.cid, r.turn): r.prompt_tokens for r in (everything or measured)}
    history = [r for r in hits if r.turn and (r.cached_tokens or 0) >= previous.get((r.cid, r.turn - 1), 1 << 30) - 8]
    prefix = [r for r in hits if r not in history]
    return {"hit_share": round(len(hits) / len(known), 2),
            "history_hit_share": round(len(history) / len(known), 2),
            "ttft_p50_hits_ms": _ms(pct([r.ttft for r in hits if r.ttft is not None], 50)),
            "ttft_p50_history_hits_ms": _ms(pct([r.ttft for r in history if r.ttft is not None], 50)),
            "ttft_p50_prefix_hits_ms": _ms(pct([r.ttft for r in prefix if r.ttft is not None], 50)),
            "ttft_p50_misses_ms": _ms(pct([r.ttft for r in misses if r.ttft is not None], 50))}


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 1)


COLUMNS = [("prefix", "prefix_ratio", "{:.2f}"), ("mode", "mode", "{}"), ("req", "ok", "{}"),
           ("err", "errors", "{}"), ("TTFT p50", "ttft_p50_ms", "{:.0f}"), ("TTFT p99", "ttft_p99_ms", "{:.0f}"),
           ("ITL p50", "itl_p50_ms", "{:.1f}"), ("ITL p99", "itl_p99_ms", "{:.1f}"),
           ("tok/s", "tokens_per_s", "{:.0f}"), ("req/s", "requests_per_s", "{:.2f}"),
           ("hit", "hit_rate", "{:.2f}"), ("router hit", "router_hit_rate", "{:.2f}"),
           ("engine reuse", "engine_reuse", "{:.2f}"),
           ("per worker", "worker_requests", "{}"), ("max/mean", "spread_max_over_mean", "{:.2f}"),
           ("vs rr", "ttft_vs_rr", "{:.2f}"), ("load", "load", "{}")]


def _cell(row: dict[str, Any], key: str, spec: str) -> str:
    v = row.get(key)
    if v is None:
        return "-"
    if isinstance(v, list):
        return "/".join(str(x) for x in v)
    return spec.format(v)


def add_ratios(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        # compared with round-robin of the same stack (ours, or Dynamo 1.6's for d16: modes)
        base = "d16:round-robin" if r["mode"].startswith("d16:") else "round-robin"
        rr = next((x for x in rows if x["prefix_ratio"] == r["prefix_ratio"] and x["mode"] == base), None)
        if rr and rr.get("ttft_p50_ms") and r.get("ttft_p50_ms") is not None:
            r["ttft_vs_rr"] = r["ttft_p50_ms"] / rr["ttft_p50_ms"]
        r["load"] = f"{r['loadavg_before'][0]:.1f}-{r['loadavg_after'][0]:.1f}"


def text_table(rows: list[dict[str, Any]]) -> str:
    cells = [[c[0] for c in COLUMNS]] + [[_cell(r, k, s) for _, k, s in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(c[0] for c in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(_cell(r, k, s) for _, k, s in COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    ratios = sorted({r["prefix_ratio"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4.6), dpi=110)
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        ys = []
        for ratio in ratios:
            r = next((x for x in rows if x["mode"] == mode and x["prefix_ratio"] == ratio), None)
            ys.append(r["ttft_p50_ms"] if r and r.get("ttft_p50_ms") is not None else 0)
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(ratios))]
        bars = ax.bar(xs, ys, width, label=LABELS.get(mode, mode))
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
    ax.set_xticks(range(len(ratios)), [f"{r:g}" for r in ratios])
    ax.set_xlabel("prefix ratio (shared system prompt / first-turn prompt)")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title(title, fontsize=9)
    top = max((r.get("ttft_p50_ms") or 0) for r in rows) or 1
    ax.set_ylim(0, top * 1.4)
    ax.legend(fontsize=8, ncol=2, loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


LABELS = {"kv": "kv (our default overlap weight: 2, 6 on llama.cpp workers)",
          "kv+w=1": "kv, overlap weight 1 (the original's default)",
          "kv-approx": "kv, --use-kv-events false"}


def plot_title(a: dict[str, Any], meta: dict[str, Any]) -> str:
    if a.get("engine") == "llamacpp":
        return (f"{a['workers']} llamacpp workers (SmolLM2-135M, {a['llamacpp_slots']} slots, "
                f"{a['llamacpp_threads']} thread), {a['groups']} groups, {a['isl']}-token first turns, {a['turns']} turns, "
                f"{a['rate']:g} req/s\n"
                f"{meta['date']}, git {meta['git']}, load average {meta['loadavg_start'][0]:.1f} at start")
    return (f"{a['workers']} mocker workers x {a['num_gpu_blocks']} KV blocks of {a['block_size']}, {a['groups']} groups, "
            f"first turn {a['isl']} tokens, {a['turns']} turns, {a['rate']:g} req/s, {a['osl']} output tokens\n"
            f"{meta['date']}, git {meta['git']}, load average {meta['loadavg_start'][0]:.1f} at start")
