#!/usr/bin/env bash
# One short GPU check for a single H100/H200 (10-minute limit, fresh checkout): first tests/test_cuda.py (the CUDA
# path's tests: FP8 GEMMs, packed attention, the trainer on the GPU vs the CPU, resume from GPU memory; its log and
# JUnit XML into $OUT, at most GPU_CHECK_TESTS_S = 200 s, GPU_CHECK_TESTS=0 skips it), then scripts/gpu_check.py
#   (a) Transformer Engine backend vs local backend: same losses from the same checkpoint (skipped without TE)
#   (b) bf16 tokens/s and MFU of a ~1B Llama at seq 4096        (goal: Megatron MFU >= 45%)
#   (c) FP8 vs bf16 tokens/s and MFU of the same model at seq 8192 (goal: FP8 >= 1.3x bf16)
#   (d) the megatron-core engine vs the native engine on (b)'s model: tokens/s, MFU, losses (skipped without
#       megatron-core; run scripts/gpu_wheels.sh here first and carry .gpu-wheels); with TE importable also
#       megatron-core's TE layer spec, bf16 and FP8 delayed ("skipped: no Transformer Engine" otherwise)
#   (e) (b)'s and (d)'s peak GPU memory vs `shardkit plan`'s estimate of the same run (goal: within 10%)
# and writes $OUT/gpu_check.json (./gpu_check_out/ when OUT is unset).
#
#   bash scripts/gpu_check.sh                 # on the GPU machine
#   bash scripts/gpu_check.sh --cpu-smoke     # the same code, tiny sizes, on the CPU (what tests/test_fp8.py runs)
#
# Python: .venv if its torch sees a GPU; else a .venv-gpu on top of the system's CUDA torch
# (--system-site-packages, so no multi-GB download when the image has one); else `make install`.
# GPU_CHECK_INSTALL_TE=1 tries `pip install transformer-engine[pytorch]` first (a source build: minutes).
# Extra arguments go to gpu_check.py (e.g. --steps 6 --parts b,c). Parts that would start too late for
# GPU_CHECK_BUDGET_S (540 s from the script's start, installation included) are skipped and say so in the JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"

# tests/test_cuda.py with python $1; on the CPU (--cpu-smoke) rehearsed (SHARDKIT_CUDA_REHEARSE=1), GPU_CHECK_TESTS_K
# selecting cases (pytest -k); a failure is recorded in $OUT/test_cuda.log and the JSON's parts still run
cuda_tests() {
  [ "${GPU_CHECK_TESTS:-1}" = 0 ] && { echo "gpu_check: tests/test_cuda.py skipped (GPU_CHECK_TESTS=0)"; return 0; }
  local k=()
  [ -n "${GPU_CHECK_TESTS_K:-}" ] && k=(-k "$GPU_CHECK_TESTS_K")
  timeout "${GPU_CHECK_TESTS_S:-200}" "$1" -m pytest -p no:cacheprovider tests/test_cuda.py "${k[@]}" \
    --junitxml "$OUT/test_cuda.xml" > "$OUT/test_cuda.log" 2>&1
  local rc=$?
  echo "gpu_check: tests/test_cuda.py exit $rc ($(grep -E "passed|failed|error|no tests" "$OUT/test_cuda.log" | tail -n 1); log: $OUT/test_cuda.log)"
}

if [ "${1:-}" = "--cpu-smoke" ]; then
  shift
  SHARDKIT_CUDA_REHEARSE=1 cuda_tests "${PYTHON:-.venv/bin/python}"
  exec "${PYTHON:-.venv/bin/python}" scripts/gpu_check.py --cpu-smoke --out "$OUT/gpu_check.json" "$@"
fi

has_cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
if [ -x .venv/bin/python ] && has_cuda_torch .venv/bin/python; then
  PY=.venv/bin/python
elif has_cuda_torch python3; then
  [ -x .venv-gpu/bin/python ] || python3 -m venv --system-site-packages .venv-gpu
  PY=.venv-gpu/bin/python
else
  make install || { echo "gpu_check: could not install (no CUDA torch on this machine and no network?)"; exit 1; }
  PY=.venv/bin/python
fi
"$PY" -c "import shardkit, tensorstore, transformers" 2>/dev/null || "$PY" -m pip install -q -e . || {
  echo "gpu_check: pip install -e . failed"; exit 1; }
# wheels carried from the CPU host (scripts/gpu_wheels.sh: megatron-core for part (d)); no network here
if compgen -G ".gpu-wheels/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps .gpu-wheels/*.whl || echo "gpu_check: the carried wheels did not install"
fi
if [ "${GPU_CHECK_INSTALL_TE:-0}" = 1 ]; then
  timeout 420 "$PY" -m pip install -q --no-build-isolation "transformer-engine[pytorch]" \
    || echo "gpu_check: Transformer Engine did not install; part (a) will be skipped"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
cuda_tests "$PY"
# whatever the installation and the tests took comes off the budget (GPU_CHECK_BUDGET_S, default 540 s of a 600 s limit)
LEFT=$(( ${GPU_CHECK_BUDGET_S:-540} - SECONDS ))
exec "$PY" scripts/gpu_check.py --out "$OUT/gpu_check.json" --deadline-s "$LEFT" "$@"
