#!/usr/bin/env bash
# Create (or update) .venv-lmeval: EleutherAI's lm-evaluation-harness with its API models only
# (`lm_eval[api]`), for the lm-eval test tier (scripts/test-lmeval.sh) and for scoring a served model.
#
# A separate virtualenv from .venv: lm_eval pulls datasets, pyarrow, pandas, scikit-learn and more that
# the server never imports, and pins none of ours.  No torch, no transformers: `local-completions` asks
# our server for its tokenizer (/tokenizer_info, /tokenize, /detokenize), so nothing is downloaded from
# the Hugging Face hub.  Only lm_eval runs here; the server under test runs from .venv.  A second run
# takes seconds (nothing to do when the pinned version is installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-lmeval
LM_EVAL_VERSION=$(sed -n 's/^lm[-_]eval==//p' constraints.txt)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('lm_eval') != sys.argv[1])" \
    "$LM_EVAL_VERSION" 2>/dev/null; then
  echo "setup-lmeval-venv: installing lm_eval[api]==$LM_EVAL_VERSION into $VENV (a minute or two the first time)" >&2
  "$VENV/bin/python" -m pip install -q "lm_eval[api]==$LM_EVAL_VERSION"
fi
