#!/usr/bin/env bash
# Set up, then chat with a real model (SmolLM2-135M-Instruct on llama.cpp, CPU).
#   scripts/demo.sh                 interactive chat in the terminal
#   scripts/demo.sh in=http         OpenAI-compatible server on :8080 instead
#   echo "Name three colors." | scripts/demo.sh     one answer and exit
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
exec .venv/bin/dynamo-run out=llamacpp "$(scripts/smollm2-path.sh)" "$@"
