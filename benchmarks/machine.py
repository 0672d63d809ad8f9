"""What a benchmark's figures were measured on: the checkout's git revision, the CPU, the load average;
waiting for a quiet machine; and the aligned text table the comparisons print.

Every result file records these so that a figure quoted in docs/ can say which code, which machine and how
busy it was (on a shared machine the load average is the first thing to read beside a timing).  One module
so that every benchmark writes them the same way.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

from benchmarks.loadgen import machine_cpu

REPO = Path(__file__).resolve().parent.parent


def git_revision() -> str | None:
    """The checkout's short HEAD, with ``+dirty(src)`` when ``src/`` has uncommitted changes (the figures
    are then of code no commit holds); ``None`` outside a git checkout or without git."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=5).stdout.strip()
        if not rev:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=REPO, capture_output=True,
                               text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty(src)" if dirty else "")


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded to two places (as they go into result files)."""
    return [round(x, 2) for x in os.getloadavg()]


def format_load(load: list[float]) -> str:
    """``0.52 0.40 0.33``: a load average as a line of output shows it."""
    return " ".join(f"{x:.2f}" for x in load)


def describe() -> dict[str, Any]:
    """The machine part of a result file's ``meta``: when, which code, which CPU, how busy."""
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "git_rev": git_revision(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "loadavg_at_start": load_average(),
    }


def busy_share(seconds: float = 2.0) -> float:
    """Share of the machine's CPU time that was busy over the next ``seconds``."""
    b0, t0 = machine_cpu()
    time.sleep(seconds)
    b1, t1 = machine_cpu()
    return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


def wait_quiet(threshold: float, max_wait: float, poll: float = 3.0) -> float:
    """Wait (up to ``max_wait`` s) until other work leaves the machine at most ``threshold`` busy.

    The machine is shared: a run taken while something else holds the cores measures the scheduler, not
    the servers.  Returns the last busy share seen (recorded with the run).
    """
    deadline = time.monotonic() + max_wait
    busy = busy_share()
    while busy > threshold and time.monotonic() < deadline:
        print(f"  (machine {busy:.0%} busy; waiting for it to quiet down)", flush=True)
        time.sleep(poll)
        busy = busy_share()
    return busy


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as aligned text: the first row a header underlined with dashes, the first two columns
    left-aligned (names), the others right-aligned (figures)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[i]) if i < 2 else c.rjust(widths[i]) for i, c in enumerate(r)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
