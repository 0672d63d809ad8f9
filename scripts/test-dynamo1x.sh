#!/usr/bin/env bash
# The Dynamo 1.x interop tier: set up .venv (ours) and .venv-dynamo1x (Dynamo 1.6.1 from PyPI), then run the
# tests marked `dynamo1x`: 1.6.1's frontend in front of our workers, ours in front of its mockers, mixed kv
# fleets, on file and etcd discovery (tests/dynamo1x).  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
scripts/setup-dynamo1x-venv.sh
export DYN16_PYTHON="$PWD/.venv-dynamo1x/bin/python"
exec .venv/bin/python -m pytest -q -m dynamo1x tests/dynamo1x "$@"
