#!/usr/bin/env bash
# The checks a GPU session runs, as one script that ends inside one device call. A session has 15
# minutes of device time, the machine's start included, so the default part fits in about 9:
#   bash scripts/gpu_check.sh OUT_DIR              the measures and the CUDA tests
#   bash scripts/gpu_check.sh OUT_DIR diagnostics  where a step's time goes (a second session's call)
# The device machine brings its own CUDA torch, and this repo goes on PYTHONPATH. On a fresh machine
# every fused kernel compiles for the first time (Triton: seconds each), which is most of bench.gpu's
# time and of the tests'. The timings run alone, the tests after them. Everything lands in
# OUT_DIR/work; OUT_DIR keeps the main logs and one archive of the rest (the device tool returns at
# most 8 files).
set -u
out=${1:?usage: gpu_check.sh OUT_DIR [main|diagnostics]}
part=${2:-main}
case $part in main|diagnostics) ;; *) echo "gpu_check.sh: no part $part (main or diagnostics)"; exit 2 ;; esac
work=$out/work
mkdir -p "$work"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$work/device.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$work/device.txt"
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS; echo "== $name"
         timeout "$limit" "$@" >"$work/$name.log" 2>&1
         echo "== $name exit $? in $((SECONDS - start)) s"; tail -n 30 "$work/$name.log"; }
case $part in
main)
  # the per-step overhead first (the GPU issue's measure: ms, launches and syncs per step against
  # DDP + AdamW, and the fused kernels whose compile failed), with the profiler's op tables per system
  step gpu 330 python3 -m bench.gpu --device cuda --json "$work/bench-gpu.json" --summary "$work/gpu-summary.txt" \
      --python-profile "$work/gpu-python.txt"
  step kernels 50 python3 -m bench.kernels --device cuda --sizes 1,16,64 --out "$work/bench-kernels"
  # correctness on CUDA: the tests beside the host-read counts (neither is timed); each failure's report
  # lands in failures.txt as it happens, and a test that hangs fails after 150 s
  step syncs 110 python3 -m bench.syncs --json "$work/bench-syncs-cuda.json" &
  DSQ_FAILURES_FILE=$work/failures.txt step tests 170 python3 -m pytest -q -n 10 -p no:cacheprovider \
      -p scripts.pytest_failures --timeout 150 tests/test_cuda_paths.py tests/test_cuda.py tests/test_kernels.py tests/test_radix_select.py \
      tests/test_own_kernels.py tests/test_levels_codec.py tests/test_topk_triton.py tests/test_blocksign_triton.py
  wait
  logs="gpu.log tests.log"; tables="gpu-summary.txt gpu-python.txt" ;;
diagnostics)
  # what one more bucket costs the host, split per kernel into dynamo's guard and the graph's call and, under
  # cProfile, by whose code (first: the open question of the hook's ratio), then what one compiled call costs
  # and where sign's time goes, pass by pass
  step buckets 75 python3 -m bench.bucket_host --device cuda --profile
  step overhead 40 python3 -m bench.call_overhead --device cuda
  step stages 65 python3 -m bench.sign_stages --device cuda
  # the same steps with every kernel eager: on a host-bound step a compiled call may cost more than the ops it fuses
  DSQ_COMPILE=never step eager 90 python3 -m bench.gpu --device cuda --systems ddp-adamw,hook-sign,compressed-adam \
      --json "$work/bench-gpu-eager.json"
  # the hook before a fused AdamW, against DDP + fused AdamW: the GPU idles after the step's one host read while
  # the host launches the optimizer (GPU busy against ms per step), least with a fused optimizer; with the verdict
  # handed to that optimizer on the device (hook-sign-late) no host read waits; inline, in backward's own thread;
  # on backward's own stream instead of the hook's side stream (hook-sign-one-stream)
  step fused 140 python3 -m bench.gpu --device cuda \
      --systems ddp-fused-adamw,hook-sign,hook-sign-one-stream,hook-sign-fused,hook-sign-late,hook-sign-inline \
      --json "$work/bench-gpu-fused.json"
  # the library's Triton kernels against torch's paths for the same bytes: top-k with torch's selection
  # (torch.topk and a sort of its positions) instead of its radix select, sign, QSGD, TernGrad, blocksign and
  # top-k with inductor's encodes and decodes instead of their Triton codecs and bucket kernels (the hook's step,
  # and their kernels against the main part's bench.kernels; top-k's there keeps its radix select)
  DSQ_TOPK_SELECT=torch DSQ_OWN_KERNELS=torch step torch-paths 90 python3 -m bench.gpu --device cuda \
      --systems ddp-adamw,hook-sign,hook-topk,hook-blocksign --json "$work/bench-gpu-torch-paths.json"
  DSQ_OWN_KERNELS=torch step codecs-torch 45 python3 -m bench.kernels --device cuda --sizes 16,64 \
      --compressors sign qsgd terngrad blocksign topk --out "$work/bench-kernels-codecs-torch"
  # sign's stages with graphs compiled for their sizes (a CPU's default, where sign's payloads with their int8
  # residual took 1.7x less time for one chunk and 3-6x less for eight), against the stages above (a graph for
  # any size, a GPU's default)
  DSQ_SIZED_GRAPHS=always step sized 45 python3 -m bench.sign_stages --device cuda
  logs="buckets.log overhead.log stages.log eager.log fused.log torch-paths.log codecs-torch.log sized.log"; tables="" ;;
esac
for f in $logs $tables failures.txt; do [ -f "$work/$f" ] && cp "$work/$f" "$out/"; done
tar czf "$out/gpu-check.tgz" -C "$work" . && rm -rf "$work"
