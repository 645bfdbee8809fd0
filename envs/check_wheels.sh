#!/usr/bin/env bash
# Do the compiled extensions of the locked vllm and lmcache wheels link the locked torch? Downloads
# the three wheels (~0.9 GB, PyPI, Linux x86_64, Python 3.11) into a temporary folder, then checks
# that every c10/ATen/torch symbol each extension imports is defined by torch/lib/*.so, and which
# CUDA runtime each links (docs/cluster.md). Needs pip and readelf (binutils); no GPU.
set -euo pipefail
lock="${1:-envs/gpu.lock.txt}"
pin() { grep -E "^$1==" "$lock" | head -1 | sed -E 's/ .*//'; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for req in "$(pin torch)" "$(pin vllm)" "$(pin lmcache)"; do
    pip --isolated download --quiet --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
        --python-version 3.11 -d "$work/wheels" "$req"
done
for wheel in "$work"/wheels/*.whl; do unzip -q -o "$wheel" '*.so*' -d "$work/x" 2>/dev/null || true; done
defined="$work/torch-defined.txt"
for lib in "$work"/x/torch/lib/*.so*; do readelf --dyn-syms -W "$lib" | awk '$7 != "UND" && NF >= 8 {print $8}'; done \
    | sed 's/@.*//' | sort -u > "$defined"
status=0
for ext in "$work"/x/vllm/_C*.so "$work"/x/lmcache/cuda_ops*.so; do
    needed="$(readelf --dyn-syms -W "$ext" | awk '$7 == "UND" {print $8}' | sed 's/@.*//' \
        | grep -E '^_ZNK?(3c10|2at|5torch|6caffe2)|c10|torch|at6' | sort -u)"
    missing="$(comm -23 <(echo "$needed") "$defined")"
    cudart="$(readelf -d "$ext" | grep -o 'libcudart\.so\.[0-9]*' || echo 'no libcudart')"
    count="$(echo -n "$missing" | grep -c . || true)"
    echo "$(basename "$ext"): $cudart, $(echo "$needed" | wc -l) torch symbols, $count missing"
    if [ -n "$missing" ]; then echo "$missing" | sed 's/^/  missing: /'; status=1; fi
done
unzip -p "$work"/wheels/torch-*.whl torch/version.py | grep -E "^(__version__|cuda)"
exit $status
