"""Draw the Grafana dashboard's queries (deploy/observability/grafana/dashboard.json) over a run of a small
fleet, as Prometheus answers them, into docs/img/dashboard.png: the picture in docs/metrics.md.

    pip install -e '.[plot]'   # matplotlib
    .venv/bin/python scripts/plot_dashboard.py [--seconds 40] [--out docs/img/dashboard.png]

Starts the fleet of harness/observability.py (a KV-routing frontend, two mockers, a real Prometheus; one
worker killed mid-stream for a migration) and asks Prometheus for each panel's queries over the run
(``query_range``, ``$__rate_interval`` = 10 s).  The planner's panels stay empty: no planner runs here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.observability import dashboard_targets, observed_fleet, promql  # noqa: E402

RATE = "10s"


def legend(template: str, metric: dict[str, str]) -> str:
    out = template
    for key, value in metric.items():
        out = out.replace("{{" + key + "}}", value[-6:] if key == "worker_id" else value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="seconds of traffic before the migration")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = dashboard_targets()
    panels = list(dict.fromkeys(t.panel for t in targets))
    with observed_fleet(seconds=args.seconds) as run:
        start, end = run.started - 5, run.ended + 5
        series = {t: run.prometheus.query_range(promql(t.expr, RATE), start, end, 1.0) for t in targets}
    cols = 2
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(14, 3.0 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        ax.set_title(panel, fontsize=9)
        for t in (t for t in targets if t.panel == panel):
            for s in series[t]:
                xs = [float(x) - start for x, _ in s["values"]]
                ys = [float(y) for _, y in s["values"]]
                ax.plot(xs, ys, label=legend(t.legend, s["metric"]), linewidth=1.2)
        if ax.lines:
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data (no planner in this run)", ha="center", va="center", transform=ax.transAxes)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("seconds", fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("Dynamo fleet dashboard: a KV-routing frontend, two mockers, one killed mid-stream", fontsize=11)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
