#!/bin/bash
# Runs the GPU suite from a built wheel on a machine with an NVIDIA GPU (no Rust needed):
#
#   maturin build --release                      # on the build machine
#   cargo test --release --features cuda --lib --no-run   # optional: the Rust kernel tests
#   bash scripts/gpu_suite.sh target/wheels/ds4-*.whl [WHEELHOUSE] [TESTS_BINARY]
#
# (scripts/gpu_kit.sh OUT builds all three into OUT: OUT/ds4-*.whl OUT/wheelhouse OUT/ds4-tests.)
#
# WHEELHOUSE: a folder of wheels for pytest, hypothesis and gguf when the GPU machine has no
# network (`pip download pytest hypothesis gguf -d WHEELHOUSE --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64` elsewhere); "" to use the index.
# TESTS_BINARY: the engine's test executable built with `--features cuda` (its CUDA kernel
# tests run first, then all of them again with DS4_CUDA_Q8=fma (Q8_0 on the float-x kernel
# only: by default the test models' short rows go to the tensor cores), the product and
# routed-expert ones with DS4_CUDA_Q8=mma (Q8_0 on the tensor cores only), and the
# attention-side ones with DS4_CUDA_INDEX=row). Then: the CUDA tests (in the three Q8_0
# modes), decode / verify / prefill timings of a random MID model at
# 2K and 32K context, and its drafters' proposal and cycle costs (on the device and with
# DS4_CUDA_DRAFT=0); with FLASH_GEN (the synthetic full-size
# Flash generator, gen_flash_q2_gguf.py) and TOKENIZER (the V4 tokenizer.json) set, the same
# for a full-size Flash file (80.8 GiB, sparse on disk) at 2K context (by default and with
# DS4_CUDA_Q8=mma), its 2K and 8K prompts with and without the prefill products on the tensor
# cores (DS4_CUDA_GEMM),
# and with FLASH_32K=1 at 32K context with an 8K-token prefill too; with FLASH_FILL=1 the
# routed experts of as many layers as the disk holds get pseudo-random blocks first
# (scripts/fill_experts.py: the generator's zero experts make the IQ2_XXS kernels look up one
# lattice entry only, which flatters them); with TRACE=1 the kernels of two Flash decode steps
# as they ran, summed per kernel, then layer 10's kernels in order (scripts/kernel_lab/
# kernel_trace.cpp, built here with nvcc against the toolkit's CUPTI; ncu_step.py --timeline).
set -euo pipefail
wheel=${1:?usage: gpu_suite.sh WHEEL [WHEELHOUSE] [TESTS_BINARY]}
python3 -m venv --system-site-packages /tmp/ds4-gpu-venv
. /tmp/ds4-gpu-venv/bin/activate
if [ -n "${2:-}" ]; then
    pip install -q --no-index --find-links "$2" "$wheel" pytest hypothesis gguf
else
    pip install -q "$wheel" pytest hypothesis gguf
fi
python -c "import ds4, sys; print('CUDA:', ds4.cuda_available(), ds4.cuda_device_name()); sys.exit(0 if ds4.cuda_available() else 1)"
if [ -n "${3:-}" ]; then
    "$3" backend::cuda --test-threads=1
    # Q8_0 on the float-x kernel only (the default for rows of 2048 to 4096 elements), then on
    # the tensor cores only (the default for shorter and longer rows): the tests again.
    DS4_CUDA_Q8=fma "$3" backend::cuda --test-threads=1
    DS4_CUDA_Q8=mma "$3" backend::cuda::tests backend::cuda::decode::tests_moe --test-threads=1
    # The indexer's one-thread-per-row kernels (DS4_CUDA_INDEX=row): the attention-side tests again.
    DS4_CUDA_INDEX=row "$3" backend::cuda::decode::tests_attn --test-threads=1
fi
(cd tests && python -m pytest -q -p no:cacheprovider test_cuda.py)
(cd tests && DS4_CUDA_Q8=fma python -m pytest -q -p no:cacheprovider test_cuda.py)
(cd tests && DS4_CUDA_Q8=mma python -m pytest -q -p no:cacheprovider test_cuda.py)
# A plane on the tensor cores whose group products alone would not be (the tiny models' o_a,
# 128 x 256 in groups of 64 rows, as Flash's o_a is by default, 8192 x 4096 in groups of
# 1024): the decoder's o_a launch must take the plane's kernel, which laid out its weights.
(cd tests && DS4_CUDA_Q8_MMA_MAX_IN=0 DS4_CUDA_Q8_MMA_SHAPES=256x128 python -m pytest -q -p no:cacheprovider \
    test_cuda.py -k "quantized or device_decode or invariant")
ds4 random MID /tmp/ds4-mid-q8_0.gguf --dtype q8_0 -q
python benches/verify_bench.py /tmp/ds4-mid-q8_0.gguf --backend cuda --ctx 2048 --prefill 2048,8192
python benches/verify_bench.py /tmp/ds4-mid-q8_0.gguf --backend cuda --ctx 32768 --prefill "" --runs 3
# The drafters' proposals and speculative cycles on the device, then on the host path.
python benches/draft_bench.py MID --backend cuda --runs 9 --dir /tmp
DS4_CUDA_DRAFT=0 python benches/draft_bench.py MID --backend cuda --runs 9 --dir /tmp
if [ -n "${FLASH_GEN:-}" ] && [ -n "${TOKENIZER:-}" ]; then
    python "$FLASH_GEN" /tmp/ds4-flash-q2.gguf "$TOKENIZER"
    if [ -n "${FLASH_FILL:-}" ]; then
        python scripts/fill_experts.py /tmp/ds4-flash-q2.gguf
    fi
    python benches/verify_bench.py /tmp/ds4-flash-q2.gguf --backend cuda --ctx 2048 --prefill 2048 --runs 5
    # A prompt's steps with their F16 and Q8_0 products on the tensor cores (the default) and on
    # the decode's kernels, interleaved in one process.
    python benches/verify_bench.py /tmp/ds4-flash-q2.gguf --backend cuda --prefill 2048,8192 --prefill-only \
        --ab DS4_CUDA_GEMM --runs 6
    # The rows of a prompt's step, and its routed expert products on the tensor cores or not,
    # interleaved in one process.
    python benches/verify_bench.py /tmp/ds4-flash-q2.gguf --backend cuda --prefill 2048,8192 --prefill-only \
        --ab DS4_CUDA_PREFILL_ROWS=16,256,512 --runs 6
    python benches/verify_bench.py /tmp/ds4-flash-q2.gguf --backend cuda --prefill 2048,8192 --prefill-only \
        --ab DS4_CUDA_EXPERT_MMA=1,0 --runs 6
    python benches/verify_bench.py /tmp/ds4-flash-q2.gguf --backend cuda --prefill 2048,8192 --prefill-only \
        --ab DS4_CUDA_EXPERT_MMA_DOWN=1,0 --runs 6
    # The routing's rows and the compressors' windows spread over the GPU in a prompt's step, or
    # each in one block.
    python benches/verify_bench.py /tmp/ds4-flash-q2.gguf --backend cuda --prefill 2048,8192 --prefill-only \
        --ab DS4_CUDA_ROUTE_PICK=1,0 --runs 6
    python benches/verify_bench.py /tmp/ds4-flash-q2.gguf --backend cuda --prefill 2048,8192 --prefill-only \
        --ab DS4_CUDA_COMPRESS_SPLIT=1,0 --runs 6
    python benches/verify_bench.py /tmp/ds4-flash-q2.gguf --backend cuda --prefill 2048,8192 --prefill-only \
        --ab DS4_CUDA_ATTN_MMA=1,0 --runs 6
    # Compile-time switches take a process each (the kernels are built once a process).
    for d in GEMM_STAGE=2 GEMM_STAGE=1; do
        DS4_CUDA_DEFINES=$d python benches/verify_bench.py /tmp/ds4-flash-q2.gguf --backend cuda \
            --prefill 2048,8192 --prefill-only --runs 3
    done
    DS4_CUDA_Q8=mma python benches/verify_bench.py /tmp/ds4-flash-q2.gguf --backend cuda --ctx 2048 --prefill 2048 --runs 5
    if [ -n "${TRACE:-}" ]; then
        cuda=$(dirname "$(dirname "$(command -v nvcc)")")
        nvcc -shared -Xcompiler -fPIC -DKREC=CUpti_ActivityKernel10 -I"$cuda/extras/CUPTI/include" \
            -o /tmp/kernel_trace.so scripts/kernel_lab/kernel_trace.cpp -L"$cuda/extras/CUPTI/lib64" -lcupti \
            -Xlinker -rpath="$cuda/extras/CUPTI/lib64"
        CUDA_INJECTION64_PATH=/tmp/kernel_trace.so DS4_TRACE_OUT=/tmp/ds4-trace.csv \
            python scripts/kernel_lab/ncu_step.py /tmp/ds4-flash-q2.gguf 2 --cupti /tmp/kernel_trace.so
        python scripts/kernel_lab/ncu_step.py --trace /tmp/ds4-trace.csv 2
        # One layer's kernels as they ran (a CSA layer with its indexer; the CSV stays in /tmp).
        python scripts/kernel_lab/ncu_step.py --timeline /tmp/ds4-trace.csv 0 --layer 10
    fi
    if [ -n "${FLASH_32K:-}" ]; then
        # About 4 minutes on an H200: the 32K-token context is filled by a prefill first.
        python benches/verify_bench.py /tmp/ds4-flash-q2.gguf --backend cuda --ctx 32768 --prefill 8192 --runs 3
    fi
fi
