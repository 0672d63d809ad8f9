"""benchmarks/llamacpp_compare.py's report: the medians over repeated runs of a server, and the table of
all servers with ours' ratios to each."""
from __future__ import annotations

import statistics
from typing import Any

from benchmarks import machine
from benchmarks.llamacpp_servers import ANCHOR, OURS, THEIRS


def format_value(v: float | None, spec: str = ".1f") -> str:
    """A number for the tables and progress lines; ``-`` for none."""
    return "-" if v is None else format(v, spec)


def summarize(runs: list[dict[str, Any]], levels: list[int]) -> dict[str, Any]:
    """Medians over repeated runs of one server (each run: a fresh server process)."""
    ok = [r for r in runs if "levels" in r]

    def med(values: list[Any]) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    out: dict[str, Any] = {"runs": len(ok), "levels": {}}
    for c in levels:
        per = [r["levels"][c] for r in ok if c in r["levels"]]
        out["levels"][c] = {
            "tokens_per_s": med([p["tokens_per_s"] for p in per]),
            "tokens_per_s_all": [round(p["tokens_per_s"], 1) for p in per],
            "ttft_p50_ms": med([p["ttft_ms"]["p50"] for p in per]),
            "ttft_p99_ms": med([p["ttft_ms"]["p99"] for p in per]),
            "itl_ms_mean": med([p["itl_ms_mean"] for p in per]),
            "server_cpu_s": med([p["server_cpu_s"] for p in per]),
            "server_cpu_ms_per_token": med([p.get("server_cpu_ms_per_token") for p in per]),
            "server_decode_ms_per_token": med([p.get("server_decode_ms_per_token") for p in per]),
            "loadavg_before": [p.get("loadavg_before") for p in per],
            "errors": sum(len(p["errors"]) for p in per),
        }
    out["startup_s"] = med([r["startup"]["startup_s"] for r in ok])
    out["rss_ready_mib"] = med([r["startup"]["rss_ready_mib"] for r in ok])
    out["greedy_different"] = sum(g["different"] for r in ok for k, g in r.get("greedy_consistency", {}).items()
                                  if k != "reference_level")
    out["greedy_compared"] = sum(g["different"] + g["identical"] for r in ok
                                 for k, g in r.get("greedy_consistency", {}).items() if k != "reference_level")
    return out


def table(summary: dict[str, Any], levels: list[int]) -> str:
    """One column per server that ran, then ours / each other server; the goals are those against
    llama-server and the older ones against llama_cpp.server."""
    names = [n for n in (OURS, ANCHOR, THEIRS) if n in summary]
    others = [n for n in names if n != OURS] if OURS in names else []
    rows = [("streams", "metric", *names, *(f"ours/{n}" for n in others), "goal")]

    def add(level: str, label: str, key: str, goal: str = "", spec: str = ".1f", top: bool = False) -> None:
        vals = {n: (summary[n].get(key) if top else summary[n].get("levels", {}).get(int(level), {}).get(key))
                for n in names}
        ratios = []
        for n in others:
            a, b = vals.get(OURS), vals.get(n)
            ratios.append(f"{a / b:.2f}" if a is not None and b else "-")
        rows.append((level, label, *(format_value(vals[n], spec) for n in names), *ratios, goal))

    for c in levels:
        if ANCHOR in names:
            goal = ">= 1 (llama-server)" if c in (1, 8) else ""
        else:
            goal = ">= 3" if c == 8 else (">= 1" if c == 1 else "")
        add(str(c), "tokens/s", "tokens_per_s", goal)
        add(str(c), "TTFT p50 ms", "ttft_p50_ms", "<= 1 (llama-server)" if ANCHOR in names and c in (1, 8) else "")
        add(str(c), "TTFT p99 ms", "ttft_p99_ms")
        add(str(c), "ITL mean ms", "itl_ms_mean", spec=".2f")
        add(str(c), "server CPU s", "server_cpu_s")
        add(str(c), "CPU ms/token", "server_cpu_ms_per_token", spec=".2f")
        if ANCHOR in names:
            add(str(c), "its decode ms/token", "server_decode_ms_per_token", spec=".2f")
    add("-", "start-up s", "startup_s", spec=".2f", top=True)
    add("-", "RSS ready MiB", "rss_ready_mib", spec=".0f", top=True)
    return machine.text_table(rows)
