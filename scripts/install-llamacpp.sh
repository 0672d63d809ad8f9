#!/usr/bin/env bash
# Install llama-cpp-python (the version constraints.txt pins) into a virtualenv, built for the instruction
# sets that really run on this machine, from a wheel cache of our own keyed by the build's flags.
#
#   scripts/install-llamacpp.sh VENV [--rebuild] [--no-amx]
#
# The flags: $CMAKE_ARGS when you set it, else what scripts/llamacpp_cmake_args.py proves runs here (each
# instruction set compiled and run by a probe; GGML_NATIVE would also compile AMX kernels that GCC 12
# miscompiles into SIGILL).  pip's own wheel cache is not used for llama-cpp-python: it keys a wheel built
# from the sdist by the sdist alone, so a machine that once built a wheel with other flags would get that one
# back.  Ours is under ${XDG_CACHE_HOME:-~/.cache}/dynamo-run/wheels/, one folder per (version, flags,
# compiler); --rebuild builds it again.  A build takes 7 to 20 minutes on 2 cores; a cached wheel, seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:?usage: scripts/install-llamacpp.sh VENV [--rebuild] [--no-amx]}
shift
REBUILD=0
PROBE_ARGS=()
for a in "$@"; do
  case "$a" in
    --rebuild) REBUILD=1 ;;
    --no-amx) PROBE_ARGS+=(--no-amx) ;;
    *) echo "install-llamacpp: unknown option $a" >&2; exit 2 ;;
  esac
done
PY="$VENV/bin/python"
VERSION=$(sed -n 's/^llama_cpp_python==//p' constraints.txt)
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/dynamo-run
if [ -n "${CMAKE_ARGS:-}" ]; then
  ARGS=$CMAKE_ARGS
else
  ARGS=$("$PY" scripts/llamacpp_cmake_args.py "${PROBE_ARGS[@]}")
fi
COMPILER=$("${CXX:-c++}" --version 2>/dev/null | head -1 || true)
KEY=$(printf '%s\n%s\n%s\n' "$VERSION" "$ARGS" "$COMPILER" | sha256sum | cut -c1-16)
WHEELS="$CACHE/wheels/llama-cpp-python-$VERSION-$KEY"
wheel() { ls "$WHEELS"/llama_cpp_python-*.whl 2>/dev/null | head -1; }
if [ "$REBUILD" = 1 ] || [ -z "$(wheel)" ]; then
  echo "install-llamacpp: building llama-cpp-python $VERSION with CMAKE_ARGS=\"$ARGS\" (7-20 minutes on 2 cores)" >&2
  rm -rf "$WHEELS.tmp"
  mkdir -p "$WHEELS.tmp"
  start=$(date +%s)
  CMAKE_ARGS="$ARGS" "$PY" -m pip wheel -q --no-deps --no-cache-dir --no-binary llama-cpp-python \
    -w "$WHEELS.tmp" "llama-cpp-python==$VERSION"
  printf '%s\n' "$ARGS" >"$WHEELS.tmp/CMAKE_ARGS"
  rm -rf "$WHEELS"
  mv "$WHEELS.tmp" "$WHEELS"
  echo "install-llamacpp: built in $(( $(date +%s) - start )) s: $(wheel)" >&2
fi
WHL=$(wheel)
MARK="$VENV/.llamacpp-wheel"
if [ "$(cat "$MARK" 2>/dev/null)" != "$WHL" ]; then
  "$PY" -m pip install -q --no-deps --force-reinstall "$WHL"
  printf '%s\n' "$WHL" >"$MARK"
fi
