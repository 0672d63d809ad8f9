#!/usr/bin/env bash
# Install Prometheus (the Debian package) for the dashboard test (tests/e2e/test_dashboard_prometheus.py)
# and scripts/plot_dashboard.py; nothing to do when the binary is there.  .ci/run calls it.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
SUDO=()
if [ "$(id -u)" != 0 ]; then SUDO=(sudo); fi
"${SUDO[@]}" apt-get update -qq
# the package's post-install starts a service where systemd runs; the tests start their own on a free port
DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v prometheus >/dev/null
