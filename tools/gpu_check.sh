#!/usr/bin/env bash
# The GPU checks of luwu_rt, as one run on a machine with a CUDA GPU (CI has none): builds the package in
# place, runs every test that needs a GPU (they skip elsewhere), the P8 benchmark (the CuPy and Numba CUDA
# AdamW kernels against the device's memory bandwidth) and a short `luwu train` on the GPU.
# Usage, from the repository root: OUT=DIR tools/gpu_check.sh   (OUT: where the logs go; default a temp dir)
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
echo "logs in $OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$py -c "import torch, cupy, numba; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cupy', cupy.__version__, 'numba', numba.__version__)" | tee -a "$OUT/gpu.txt"
start=$(date +%s)
$py -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
timeout 300 $py -m pytest -q -p no:cacheprovider -rs tests/kernels tests/exec/test_streams.py tests/io/test_buffers.py \
    tests/engine/test_workload.py tests/engine/test_unitwise.py tests/engine/test_engine_gpu.py 2>&1 | tee "$OUT/gpu-tests.txt" | tail -40
timeout 240 $py benchmarks/bench_optim.py --device cuda --rounds 7 --out "$OUT/gpu-optim.md" > /dev/null 2> "$OUT/gpu-optim.log" \
    && cat "$OUT/gpu-optim.md" || tail -20 "$OUT/gpu-optim.log"
run=$(mktemp -d)
(cd "$run" && timeout 240 $py -m luwu_rt train --steps 60 --quiet --json-log train.jsonl 2>&1 | tail -6) | tee "$OUT/gpu-train.txt"
