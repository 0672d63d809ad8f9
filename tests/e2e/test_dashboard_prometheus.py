"""deploy/observability's dashboard against a real Prometheus scraping a real fleet: every query of the
dashboard returns data (a series with a number), so each panel draws something on a fresh clone.

The planner's panels are the exception: the fleet here runs no planner (it would start and stop workers of
its own), so their queries are only checked to be valid PromQL that Prometheus accepts (docs/metrics.md,
"Dashboard")."""

from __future__ import annotations

import pytest

from harness.observability import dashboard_targets, finite_values, observed_fleet, prometheus_binary, promql

pytestmark = pytest.mark.skipif(prometheus_binary() is None,
                                reason="prometheus is not installed (scripts/setup-prometheus.sh installs it)")

RATE = "30s"  # $__rate_interval: wide enough to hold the whole traffic when evaluated at its end


@pytest.mark.slow
def test_every_dashboard_query_returns_data_from_a_scraped_fleet() -> None:
    targets = dashboard_targets()
    assert any(t.planner for t in targets) and any(not t.planner for t in targets)
    with observed_fleet() as run:
        assert run.migrated, run.frontend.stderr_text()
        empty = []
        for t in targets:
            result = run.prometheus.query(promql(t.expr, RATE), run.ended)  # raises on invalid PromQL
            if not t.planner and not finite_values(result):
                empty.append(f"{t.panel}: {t.expr} -> {result}")
        assert empty == []
        # the migration panel shows the kill, the KV panel hits from the shared system prompt
        migrations = run.prometheus.query(promql(
            'sum(increase(dynamo_frontend_model_migration_total{migration_type="ongoing_request"}[$__rate_interval]))',
            RATE), run.ended)
        assert finite_values(migrations) and finite_values(migrations)[0] > 0
        hit = run.prometheus.query(promql(next(t.expr for t in targets if "kv_hit_rate" in t.expr), RATE), run.ended)
        assert 0 < finite_values(hit)[0] <= 1
