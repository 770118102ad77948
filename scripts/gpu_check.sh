#!/usr/bin/env bash
# jdp's GPU check in one command (scripts/gpu_check.py says what it measures; docs/performance.md#gpu-check what
# each number means):
#   scripts/gpu_check.sh [--out DIR] [--budget-s 480]   on a GPU machine with jdp's dependencies (pip install -e ".[cuda12]")
#   scripts/gpu_check.sh --cpu --out DIR                the same steps on CPU with tiny configs (its test in CI)
#   scripts/gpu_check.sh --wheels                       here, with a package index: the wheels a machine without one
#                                                       lacks, into .whl/ (carried with the check; see below)
# It runs this checkout's jdp, installed or not (a lent machine's image has JAX but not jdp). Where .whl/ holds wheels
# (made by --wheels and carried), those of jdp's requirements the interpreter lacks or holds at a version jdp does
# not support are installed first, into /tmp/jdp-site, with what they need in turn; nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [[ ${1:-} == --wheels ]]; then
  # The GPU image: Python 3.12, jax 0.11 with flax, optax, orbax, jinja2, tokenizers... but no datasets.
  # --no-deps: each missing requirement is named; the fallbacks are the versions CI tests (used only where the
  # image's own are out of jdp's range).
  rm -rf .whl && mkdir -p .whl
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "datasets==5.2.0" "dill==0.4.0" "multiprocess==0.70.18" "tensorboardX==2.6.4" \
    "flax==0.12.12" "optax==0.2.8" "orbax-checkpoint==0.12.8"
  ls -l .whl && du -sh .whl
  exit 0
fi

export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's jdp, installed or not
if compgen -G ".whl/*.whl" >/dev/null; then
  # the carried wheels whose project the interpreter lacks or holds out of jdp's range (pyproject.toml)
  need=$("$PY" scripts/gpu_check.py --needs .whl)
  if [[ -n $need ]]; then
    echo "[gpu_check] installing carried wheels: $need"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/jdp-site $need
    export PYTHONPATH=/tmp/jdp-site:$PYTHONPATH  # before the image's own
  fi
fi
exec "$PY" scripts/gpu_check.py "$@"
