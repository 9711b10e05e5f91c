#!/usr/bin/env bash
# The checks a GPU session runs, as one script that ends inside one device call
# (under 10 minutes; about 7 as seen before bench.bucket_host and sign_stages' merged rows were added; the device machine brings its own CUDA torch, and
# this repo goes on PYTHONPATH). The timings run alone, the tests after them in
# parallel. Everything lands in OUT_DIR/work; OUT_DIR keeps the main logs and
# one archive of the rest (the device tool returns at most 8 files).
#   bash scripts/gpu_check.sh OUT_DIR
set -u
out=${1:?usage: gpu_check.sh OUT_DIR}
work=$out/work
mkdir -p "$work"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$work/device.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$work/device.txt"
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS; echo "== $name"
         timeout "$limit" "$@" >"$work/$name.log" 2>&1
         echo "== $name exit $? in $((SECONDS - start)) s"; tail -n 30 "$work/$name.log"; }
# the per-step overhead first (the GPU issue's measure: ms, launches and syncs per step against DDP + AdamW),
# with the profiler's op tables per system
step gpu 240 python3 -m bench.gpu --device cuda --json "$work/bench-gpu.json" --summary "$work/gpu-summary.txt" \
    --python-profile "$work/gpu-python.txt"
step kernels 50 python3 -m bench.kernels --device cuda --sizes 1,16,64 --out "$work/bench-kernels"
# where sign's time goes, pass by pass, and what one compiled call costs the host
step stages 70 python3 -m bench.sign_stages --device cuda
step overhead 40 python3 -m bench.call_overhead --device cuda
step buckets 40 python3 -m bench.bucket_host --device cuda
# the same steps with every kernel eager: on a host-bound step a compiled call may cost more than the ops it fuses
DSQ_COMPILE=never step eager 60 python3 -m bench.gpu --device cuda --systems ddp-adamw,hook-sign,compressed-adam \
    --json "$work/bench-gpu-eager.json"
# correctness on CUDA: the tests in parallel with the host-read counts (neither is timed)
step syncs 110 python3 -m bench.syncs --json "$work/bench-syncs-cuda.json" &
# (each failure's report lands in failures.txt as it happens; a test that hangs fails after 150 s)
DSQ_FAILURES_FILE=$work/failures.txt step tests 150 python3 -m pytest -q -n 4 -p no:cacheprovider \
    -p scripts.pytest_failures --timeout 150 tests/test_cuda_paths.py tests/test_cuda.py tests/test_kernels.py
wait
cp "$work/gpu.log" "$work/eager.log" "$work/tests.log" "$out/" 2>/dev/null
[ -f "$work/failures.txt" ] && cp "$work/failures.txt" "$out/"
for f in gpu-summary.txt gpu-python.txt; do [ -f "$work/$f" ] && cp "$work/$f" "$out/"; done
tar czf "$out/gpu-check.tgz" -C "$work" . && rm -rf "$work"
