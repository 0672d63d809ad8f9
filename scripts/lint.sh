#!/usr/bin/env bash
# Lint (ruff: F, B, ASYNC, I) and type-check (mypy) src/, as configured in pyproject.toml; .ci/run runs it
# before the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
.venv/bin/ruff check src
.venv/bin/mypy
