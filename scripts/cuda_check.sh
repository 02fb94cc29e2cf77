#!/usr/bin/env bash
# The CUDA path on a machine with a GPU (not part of the suite: CI has no GPU). Installs nothing: it runs under
# the machine's own python3 with its torch and Triton (PYTHON= picks another), the repo on PYTHONPATH.
#   1. the kernel tests, their Triton calls compiled and run on the GPU (tests/triton_on_cuda.py), junit XML;
#   2. python -m benchmarks.cuda_check: rooflines, Triton kernel speed, the model on CUDA in fp32 and bf16
#      against the CPU fp32 reference, the decode step on CUDA (cuda_check.json).
# Results go to $OUT (default ./cuda-check-out); arguments go to cuda_check (e.g. --parts kernels,sweep).
# Exit status: non-zero if either part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/cuda-check-out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print('cuda_check:', torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" || exit 2

workers=()
"$PY" -c "import xdist" 2>/dev/null && workers=(-n "${K3SERVE_CUDA_TEST_WORKERS:-8}")
# every kernel test but the fused CPU kernel's and the CPU bench's (no Triton call in either)
timeout "${K3SERVE_CUDA_TEST_TIMEOUT:-300}" "$PY" -m pytest -p no:cacheprovider -p tests.triton_on_cuda -q \
  "${workers[@]}" --junitxml="$OUT/kernel_tests.xml" --ignore=tests/kernels/test_kda_cpu.py \
  --ignore=tests/kernels/test_bench_kernels.py tests/kernels 2>&1 | tee "$OUT/kernel_tests.log"
tests_rc=${PIPESTATUS[0]}

timeout "${K3SERVE_CUDA_CHECK_TIMEOUT:-420}" "$PY" -m benchmarks.cuda_check --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/cuda_check.log"
check_rc=${PIPESTATUS[0]}

echo "cuda_check: kernel tests rc=$tests_rc, cuda_check rc=$check_rc"
[ "$tests_rc" = 0 ] && [ "$check_rc" = 0 ]
