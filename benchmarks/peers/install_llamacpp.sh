#!/usr/bin/env bash
# llama.cpp's OpenAI-compatible server, built from source by pip (about 5 minutes on 2 cores).
# Usage: benchmarks/peers/install_llamacpp.sh [VENV]   (default: .peers/llamacpp)
set -euo pipefail
VENV=${1:-.peers/llamacpp}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then "$PYTHON" -m venv "$VENV"; fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# -DGGML_NATIVE=ON: build for this CPU (AVX-512 / bf16 where present), as a user installing from source gets.
CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=ON"} "$VENV/bin/python" -m pip install --quiet "llama-cpp-python[server]"
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
