#!/bin/bash
# Builds, on a machine with Rust, what scripts/gpu_suite.sh needs on a GPU machine that has
# Python but no Rust (and maybe no network), into one folder to copy there:
#
#   bash scripts/gpu_kit.sh OUT [PYTHON_VERSION]     # PYTHON_VERSION of the GPU machine, 3.12
#
# OUT then holds the ds4 wheel (abi3: any CPython >= 3.10), wheelhouse/ (pytest, hypothesis and
# gguf with their dependencies, binary wheels for that Python on manylinux x86_64) and ds4-tests
# (the engine's unit tests built with --features cuda). On the GPU machine, from a checkout of
# the same commit:
#
#   bash scripts/gpu_suite.sh OUT/ds4-*.whl OUT/wheelhouse OUT/ds4-tests
#
# Needs maturin and pip on PATH (or PYTHON, whose -m maturin and -m pip are used).
set -euo pipefail
out=${1:?usage: gpu_kit.sh OUT [PYTHON_VERSION]}
py_version=${2:-3.12}
python=${PYTHON:-python3}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out/wheelhouse"
out=$(cd "$out" && pwd)
cd "$root"
rm -f "$out"/ds4-*.whl
"$python" -m maturin build --release --quiet --out "$out"
# The unit-test executable of the engine's library (the one whose target is lib.rs); cargo's
# own messages, a compile error among them, stay on stderr.
tests=$(cargo test --release --features cuda --lib --no-run --message-format=json \
    | "$python" -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "lib" in m["target"]["kind"]:
        print(m["executable"])')
[ -n "$tests" ] || { echo "gpu_kit.sh: no test executable from cargo" >&2; exit 1; }
cp "$tests" "$out/ds4-tests"
# Without its debug info the binary is a fifth of the size, to copy over.
if command -v strip >/dev/null; then
    strip "$out/ds4-tests"
fi
"$python" -m pip download --quiet --only-binary=:all: --python-version "$py_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$out/wheelhouse" pytest hypothesis gguf
ls "$out"/ds4-*.whl "$out/ds4-tests" >/dev/null
echo "gpu_kit.sh: $(ls "$out"/ds4-*.whl), $(ls "$out/wheelhouse" | wc -l) wheels, $out/ds4-tests"
