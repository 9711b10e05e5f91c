#!/usr/bin/env bash
# Idempotent set-up of .venv/ at the repo root: torch pinned to 2.13.0 (the CPU
# wheel on machines that have it; a bare `torch` would pull GBs of CUDA wheels),
# this package with its dev and docs extras, and optionally Horovod (built from source
# with the C++17 fix, see scripts/build_horovod.sh) and DeepSpeed.
#
#   scripts/bootstrap.sh            core + dev
#   scripts/bootstrap.sh --all      core + dev + horovod + deepspeed
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
want_engines=0
[ "${1:-}" = "--all" ] && want_engines=1

TORCH_VERSION=2.13.0
PY=${PYTHON:-python3}
venv="$root/.venv"
stamp_core="$venv/.dsq-core-$(cat setup.cfg pyproject.toml scripts/bootstrap.sh | sha1sum | cut -c1-12)"

if [ ! -x "$venv/bin/python" ]; then
  echo "bootstrap: creating $venv"
  "$PY" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

if [ ! -e "$stamp_core" ]; then
  echo "bootstrap: installing torch==$TORCH_VERSION and dsq-plugins[dev,docs]"
  "${pip[@]}" install "torch==$TORCH_VERSION"
  "${pip[@]}" install -e ".[dev,docs]" "torch==$TORCH_VERSION"
  rm -f "$venv"/.dsq-core-*
  touch "$stamp_core"
fi

if [ "$want_engines" = 1 ]; then
  if ! "$venv/bin/python" -c "import horovod.torch" 2>/dev/null; then
    bash "$root/scripts/build_horovod.sh" "$venv"
  fi
  if ! "$venv/bin/python" -c "import deepspeed" 2>/dev/null; then
    echo "bootstrap: installing deepspeed"
    DS_BUILD_OPS=0 "${pip[@]}" install "deepspeed==0.19.8" "torch==$TORCH_VERSION"
  fi
fi
echo "bootstrap: ready ($venv)"
