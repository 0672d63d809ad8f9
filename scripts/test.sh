#!/usr/bin/env bash
# Set up, then run the whole test suite (unit, integration with real etcd/NATS, end-to-end CLI).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
exec .venv/bin/python -m pytest -q "$@"
