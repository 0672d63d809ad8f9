#!/usr/bin/env bash
# The lm-evaluation-harness tier: set up .venv-lmeval (lm_eval[api], no torch; seconds once pip's cache has
# the wheels), then run tests/lmeval: `lm_eval --model local-completions` with its default settings on local
# tasks against out=llamacpp (SmolLM2) and out=dyn, every score checked against llama-cpp-python in process.
# The server runs from .venv (scripts/setup-venv.sh).  Extra arguments go to pytest.  Measured: the install
# took 3 min cold and 30 s from the pip cache; the tests 83 s in one run, 7.7 min in another at load 8-10.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-lmeval-venv.sh
DYN_LMEVAL_REQUIRED=1 exec .venv/bin/python -m pytest -q -m lmeval tests/lmeval "$@"
