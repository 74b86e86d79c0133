#!/usr/bin/env bash
# llama.cpp's C++ tools (llama-server, llama-perplexity, llama-bench), built from the llama.cpp
# sources vendored in the pinned llama-cpp-python sdist: the server users actually run, which
# batches parallel slots (llama-cpp-python's own Python server runs one request at a time and
# is not a fair peer; see DESIGN.md "Peers to measure against").
# About 10-20 minutes on 2 cores; idempotent (skips whatever is already built).
# Usage: benchmarks/peers/install_llamacpp.sh [DIR]   (default: .peers/llamacpp)
#   env: LLAMA_CPP_PYTHON_VERSION (pin, default 0.3.36), JOBS (default 2), PYTHON (default python3)
set -euo pipefail
DIR=${1:-.peers/llamacpp}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-python3}
TARGETS=(llama-server llama-perplexity llama-bench)

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
SRC="$DIR/llama_cpp_python-$VERSION"
LLAMA="$SRC/vendor/llama.cpp"
BIN="$LLAMA/build/bin"

all_built() {
    local t
    for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || return 1; done
}

if all_built; then
    echo "llama.cpp tools already built in $BIN (delete $LLAMA/build to rebuild)"
else
    # 1. The sdist (sources only, no wheel), pinned so every run measures the same llama.cpp.
    if [ ! -d "$LLAMA" ]; then
        SDIST=$(ls "$DIR"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)
        if [ -z "$SDIST" ]; then
            "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
                "llama-cpp-python==$VERSION" -d "$DIR"
            SDIST="$DIR/llama_cpp_python-$VERSION.tar.gz"
        fi
        tar -xzf "$SDIST" -C "$DIR"
    fi
    [ -f "$LLAMA/CMakeLists.txt" ] || { echo "no llama.cpp sources in $LLAMA" >&2; exit 1; }

    # 2. cmake: the system's if it has one, otherwise PyPI's in a small venv of our own.
    CMAKE=$(command -v cmake || true)
    if [ -z "$CMAKE" ]; then
        [ -x "$DIR/cmake-venv/bin/cmake" ] || {
            "$PYTHON" -m venv "$DIR/cmake-venv"
            "$DIR/cmake-venv/bin/python" -m pip install --quiet cmake
        }
        CMAKE="$DIR/cmake-venv/bin/cmake"
    fi
    command -v g++ >/dev/null || { echo "g++ not found: install a C++ compiler" >&2; exit 1; }

    # 3. Configure and build. GGML_NATIVE=ON builds for this CPU (AVX-512, bf16, VNNI where
    # present), as a user building from source gets; no curl (nothing downloads models here).
    "$CMAKE" -S "$LLAMA" -B "$LLAMA/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DCMAKE_BUILD_TYPE=Release
    "$CMAKE" --build "$LLAMA/build" -j "$JOBS" --target "${TARGETS[@]}"
    all_built || { echo "build finished but binaries are missing from $BIN" >&2; exit 1; }
fi

# Stable paths for the harnesses: $DIR/bin/<tool> -> the built binaries.
mkdir -p "$DIR/bin"
for t in "${TARGETS[@]}"; do
    ln -sfn "$BIN/$t" "$DIR/bin/$t"
    echo "$t: $DIR/bin/$t"
done
"$DIR/bin/llama-server" --version 2>&1 | tail -n 2
