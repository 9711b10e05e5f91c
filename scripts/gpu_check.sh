#!/usr/bin/env bash
# The checks a GPU session runs, as one script (the device machine brings its
# own CUDA torch; this repo goes on PYTHONPATH). Logs and JSON go to $1.
#   bash scripts/gpu_check.sh OUT_DIR
set -u
out=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/device.txt"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" >"$out/$name.log" 2>&1
         echo "== $name exit $?"; tail -n 4 "$out/$name.log"; }
# the per-step overhead first (the GPU issue's measure: ms, launches and syncs per step against DDP + AdamW)
step gpu 200 python3 -m bench.gpu --device cuda --json "$out/bench-gpu.json"
step paths 150 python3 -m pytest -q tests/test_cuda_paths.py
step kernels 75 python3 -m bench.kernels --device cuda --sizes 1,16,64 --out "$out/bench-kernels"
step syncs 50 python3 -m bench.syncs --json "$out/bench-syncs-cuda.json"
step cuda 300 python3 -m pytest -q tests/test_cuda.py tests/test_kernels.py
