#!/usr/bin/env bash
# Create (or update) .venv-dynamo1x: NVIDIA Dynamo 1.6.1 from PyPI (ai-dynamo + ai-dynamo-runtime), for the
# interop tier (scripts/test-dynamo1x.sh), whose tests run 1.6.1's own frontend and mocker beside our processes.
#
# A virtualenv of its own: 1.6.1 ships a package named `dynamo` too, and must never shadow ours.  The wheels
# are installed without their declared dependencies (transformers, kubernetes, redis and the rest pull
# gigabytes that the frontend and the mocker do not import); the list below is what those two import,
# found by running them (../shared/notes/dynamo-1x.md).  A second run takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-dynamo1x
D16_VERSION=1.6.1
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
have=$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("ai-dynamo"))' 2>/dev/null || true)
if [ "$have" != "$D16_VERSION" ]; then
  "$VENV/bin/python" -m pip install -q --no-deps "ai-dynamo==$D16_VERSION" "ai-dynamo-runtime==$D16_VERSION"
  "$VENV/bin/python" -m pip install -q aiohttp msgspec prometheus-client pyzmq uvloop "pydantic<=2.13.5" \
      typing-extensions tqdm certifi zstandard packaging pyyaml
fi
# both entry points the tier starts must import (one line, exit 1 otherwise)
"$VENV/bin/python" -c 'import dynamo.frontend, dynamo.mocker' \
  || { echo "setup-dynamo1x-venv: Dynamo $D16_VERSION does not import in $VENV" >&2; exit 1; }
