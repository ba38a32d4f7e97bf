#!/bin/bash
# The first steps of a kernel-lab session on a GPU machine that has Python but no Rust, from a
# kit that scripts/gpu_kit.sh built (OUT/ds4-*.whl, OUT/wheelhouse):
#
#   . scripts/kernel_lab/device_prep.sh KIT [GEN TOKENIZER]
#
# installs the wheel into /tmp/ds4-gpu-venv (once a machine) and activates it; with GEN (the
# synthetic Flash generator, gen_flash_q2_gguf.py) and TOKENIZER (the V4 tokenizer.json, or
# .gz) it also starts writing /tmp/ds4-flash-q2.gguf in the background, its routed experts
# filled (scripts/fill_experts.py: about 50 s on an H200 machine for both), unless a file from
# an earlier call on this machine is there. Tests can run meanwhile; `flash_wait` waits for the
# file and says how it went. Sourced, so that the venv and `flash_wait` stay in the caller's
# shell. The file's writer is then a background job of that shell: a bare `wait` there (to
# join builds started with `&`) waits for it too, and in bash 5.2 (checked) also for a
# `exec > >(tee LOG)` process substitution, which never ends; wait for the builds' PIDs.
kit=${1:?usage: . device_prep.sh KIT [GEN TOKENIZER]}
if [ ! -e /tmp/ds4-gpu-venv/.ds4 ]; then
    python3 -m venv --system-site-packages /tmp/ds4-gpu-venv
    /tmp/ds4-gpu-venv/bin/pip install -q --no-index --find-links "$kit/wheelhouse" "$kit"/ds4-*.whl pytest hypothesis gguf &&
        touch /tmp/ds4-gpu-venv/.ds4
fi
. /tmp/ds4-gpu-venv/bin/activate
python -c "import ds4; print('CUDA:', ds4.cuda_available(), ds4.cuda_device_name())"
if [ -n "${2:-}" ] && [ -n "${3:-}" ] && [ ! -e /tmp/ds4-flash-q2.gguf.done ]; then
    # The log exists before this returns: flash_wait, called at once, must see a writer.
    : > /tmp/ds4-flash-q2.gguf.log
    (
        t=$SECONDS
        python "$2" /tmp/ds4-flash-q2.gguf "$3" && python scripts/fill_experts.py /tmp/ds4-flash-q2.gguf &&
            touch /tmp/ds4-flash-q2.gguf.done
        echo "the Flash file: exit $? after $((SECONDS - t)) s"
    ) >> /tmp/ds4-flash-q2.gguf.log 2>&1 &
fi

# Waits for the background Flash file, then prints its log's last lines; fails if it failed.
flash_wait() {
    if [ ! -e /tmp/ds4-flash-q2.gguf.done ] && [ ! -e /tmp/ds4-flash-q2.gguf.log ]; then
        echo "flash_wait: no Flash file is being written (device_prep.sh without GEN and TOKENIZER)" >&2
        return 1
    fi
    while [ ! -e /tmp/ds4-flash-q2.gguf.done ] && ! grep -q "^the Flash file" /tmp/ds4-flash-q2.gguf.log 2>/dev/null; do
        sleep 2
    done
    tail -2 /tmp/ds4-flash-q2.gguf.log 2>/dev/null
    [ -e /tmp/ds4-flash-q2.gguf.done ]
}
