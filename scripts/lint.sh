#!/usr/bin/env bash
# Lint (ruff: F, B, ASYNC, I) src/, the tests, the benchmarks, the harness and these scripts; type-check
# (mypy) and check the layering contracts (import-linter) of src/, as configured in pyproject.toml; .ci/run
# runs it before the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
.venv/bin/ruff check src tests benchmarks harness scripts
.venv/bin/mypy
.venv/bin/lint-imports
.venv/bin/python scripts/check_structure.py
