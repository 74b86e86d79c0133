#!/usr/bin/env bash
# The GPU check (issue 21, item 6), one script for one device lease: the parity tests on CUDA
# (tests/test_cuda.py) and the offline benchmark (tokenloom against transformers, bf16) on two model shapes:
# SmolLM2-135M and a 1B-class Llama (hidden 2048, 16 layers, 32 heads / 8 KV heads, SmolLM2's tokenizer),
# both with random weights drawn on the GPU (benchmarks/random_model.py): the model files cannot travel.
#
#   bash benchmarks/gpu_check.sh OUTDIR [LIKE]     LIKE: config.json + tokenizer files of SmolLM2-135M
#
# DEVICE=cpu QUICK=1 runs the same steps on the CPU with small sizes: the dry run before a lease.
# It runs under the device machine's own python3 and packages (torch with CUDA there); gguf travels as a wheel.
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUTDIR [LIKE]}
LIKE=${2:-.gpu/smollm2-like}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
quiet() { grep -v -E "leaked|nanobind|Writing model shards|Loading weights|skipped remainder"; }

echo "== machine"
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" -c "import torch, transformers, platform; print('python', platform.python_version(), 'torch', torch.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU', \
'transformers', transformers.__version__)"
  nproc; } 2>&1 | tee "$OUT/machine.txt"

echo "== parity tests on $DEVICE"
[ "${SKIP_TESTS:-0}" = 1 ] || timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py --device-under-test "$DEVICE" -rfEs --durations=5 \
  2>&1 | tail -80 | tee "$OUT/tests.txt"

if [ "${QUICK:-0}" = 1 ]; then
  BENCH=(--repeats 1 --batch-prompts 8 --batch-output-len 16 --decode-tokens 16 --prefill-len 256)
else
  BENCH=(--repeats 3)
fi
bench() {  # NAME TIMEOUT RANDOM_MODEL_ARGS...
  local name=$1 limit=$2; shift 2
  echo "== offline benchmark: $name"
  "$PY" benchmarks/random_model.py --like "$LIKE" --out "/tmp/gpu-$name" --device "$DEVICE" "$@" 2>&1 | quiet
  timeout "$limit" "$PY" benchmarks/offline.py --model "/tmp/gpu-$name" --dtype bfloat16 --device "$DEVICE" \
    --kv-cache-memory "${KV:-16GiB}" "${BENCH[@]}" --out "$OUT/offline_$name.json" 2>&1 | quiet | tee "$OUT/offline_$name.txt"
}
bench smollm2-135m 150
bench llama-1b 200 --set hidden_size=2048 --set intermediate_size=8192 --set num_hidden_layers=16 \
  --set num_attention_heads=32 --set num_key_value_heads=8 --set head_dim=64
echo "== done"
