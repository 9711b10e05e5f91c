#!/usr/bin/env bash
# Build Horovod 0.28.1 for the venv given as $1, from the PyPI sdist, with the
# one change it needs for PyTorch >= 2.1: C++17 instead of its hard-coded C++14
# (Horovod issues #3996, #4014). PyTorch + Gloo only. The wheel is cached
# outside the repo, keyed by Horovod, torch and Python versions, so a second
# set-up installs in seconds. A failed build stops here with the compiler's log.
set -euo pipefail
venv=${1:?usage: build_horovod.sh VENV}
HVD_VERSION=0.28.1
py="$venv/bin/python"
torch_v=$("$py" -c "import torch; print(torch.__version__.split('+')[0])")
py_v=$("$py" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
cache=${DSQ_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dsq-plugins/horovod-$HVD_VERSION-torch$torch_v-$py_v}
mkdir -p "$cache"
pip=("$py" -m pip --disable-pip-version-check -q)

if ! ls "$cache"/horovod-*.whl >/dev/null 2>&1; then
  command -v cmake >/dev/null || { echo "build_horovod: needs the system cmake (apt-get install cmake)" >&2; exit 1; }
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "build_horovod: building Horovod $HVD_VERSION against torch $torch_v (several minutes, log in $cache/build.log)"
  "${pip[@]}" download --no-deps --no-binary :all: -d "$work" "horovod==$HVD_VERSION"
  tar -xzf "$work"/horovod-$HVD_VERSION.tar.gz -C "$work"
  src="$work/horovod-$HVD_VERSION"
  for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$f"
    grep -q 'CMAKE_CXX_STANDARD 17' "$f" || { echo "build_horovod: C++17 patch did not apply to $f" >&2; exit 1; }
  done
  # Horovod's build needs these in the venv, and the system cmake (pip's cmake 4.x refuses its gloo).
  "${pip[@]}" install wheel setuptools packaging cloudpickle psutil pyyaml
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
         HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo \
         MAKEFLAGS="-j$(nproc)"
  export PATH="$(dirname "$(command -v cmake)"):$PATH"
  if ! "$py" -m pip wheel --no-build-isolation --no-deps -w "$cache" "$src" >"$cache/build.log" 2>&1; then
    echo "build_horovod: build failed; the compiler's errors:" >&2
    grep -E -m 40 'error|Error' "$cache/build.log" >&2 || tail -n 60 "$cache/build.log" >&2
    exit 1
  fi
fi
"${pip[@]}" install cloudpickle psutil pyyaml packaging
"${pip[@]}" install --no-deps "$cache"/horovod-*.whl
"$venv/bin/horovodrun" --check-build
