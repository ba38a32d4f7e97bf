#!/bin/bash
# Runs the GPU suite from a built wheel on a machine with an NVIDIA GPU (no Rust needed):
#
#   maturin build --release                      # on the build machine
#   bash scripts/gpu_suite.sh target/wheels/ds4-*.whl [WHEELHOUSE]   # on the GPU machine, in a checkout
#
# WHEELHOUSE: a folder of wheels for pytest, hypothesis and gguf when the GPU machine has no
# network (`pip download pytest hypothesis gguf -d WHEELHOUSE --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64` elsewhere). Then: the CUDA tests, and
# decode / verify / prefill timings of a random MID model on the GPU (DS4_PROFILE split).
set -euo pipefail
wheel=${1:?usage: gpu_suite.sh WHEEL [WHEELHOUSE]}
python3 -m venv --system-site-packages /tmp/ds4-gpu-venv
. /tmp/ds4-gpu-venv/bin/activate
if [ -n "${2:-}" ]; then
    pip install -q --no-index --find-links "$2" "$wheel" pytest hypothesis gguf
else
    pip install -q "$wheel" pytest hypothesis gguf
fi
python -c "import ds4, sys; print('CUDA:', ds4.cuda_available(), ds4.cuda_device_name()); sys.exit(0 if ds4.cuda_available() else 1)"
(cd tests && python -m pytest -q -p no:cacheprovider test_cuda.py)
ds4 random MID /tmp/ds4-mid-q8_0.gguf --dtype q8_0 -q
python benches/verify_bench.py /tmp/ds4-mid-q8_0.gguf --backend cuda --ctx 2048 --prefill 2048 --profile
