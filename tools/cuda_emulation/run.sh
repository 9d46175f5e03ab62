#!/bin/bash
# Runs csrc/cuda/adamw.cu's kernels on the CPU (one std::thread per CUDA thread, cuda_runtime.h here) and checks
# them (test_emulated_kernels.cpp says how): quantize_expanded and dequantize_expanded against the C core bit for
# bit; fp8_adamw_step against the C core and a float64 oracle within tests/test_adamw_ops.py's tolerance, for
# determinism and for independence of layout, over shapes, dtypes, formats, group sizes, misaligned tensors,
# NaN / Inf / zero / subnormal gradients and multi-tensor launches. The step kernel's hardware approximations
# (csrc/cuda/adamw_fast_math.cuh) are replaced by adamw_fast_math.cuh here: exact values moved by pseudo-random
# errors up to the PTX ISA's bounds. It checks the kernels' logic (tiles, lanes, shuffles, votes, fast and
# general paths) and their tolerance at the documented error bounds, not the GPU's own bits.
# Then csrc/cuda/rope.cu (test_emulated_rope.cpp) against the C core bit for bit, built as a program of its own:
# cuda_runtime.h is included by one translation unit.
#   tools/cuda_emulation/run.sh [quick]
set -e
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python3 "$here/launch_rewrite.py" "$root/csrc/cuda/adamw.cu" "$out/adamw_emulated.cpp"
gcc -std=c99 -O2 -ffp-contract=off -c -I"$root/csrc/include" "$root/csrc/cpu/adamw.c" -o "$out/cpu_adamw.o"
gcc -std=c99 -O2 -ffp-contract=off -c -I"$root/csrc/include" "$root/csrc/cpu/quantize.c" -o "$out/cpu_quantize.o"
gcc -std=c99 -O2 -c -I"$root/csrc/include" "$root/csrc/common.c" -o "$out/common.o"
g++ -std=c++20 -O2 -ffp-contract=off -fno-strict-aliasing -Wall -Wno-unused-function -Wno-unknown-pragmas \
    -I"$here" -I"$root/csrc/include" -c "$out/adamw_emulated.cpp" -o "$out/emulated.o"
g++ -std=c++20 -O2 -ffp-contract=off -I"$root/csrc/include" -c "$here/test_emulated_kernels.cpp" -o "$out/test.o"
g++ "$out"/*.o -o "$out/test_emulated_kernels" -lpthread
"$out/test_emulated_kernels" "$@"

mkdir "$out/rope"
python3 "$here/launch_rewrite.py" "$root/csrc/cuda/rope.cu" "$out/rope/rope_emulated.cpp"
gcc -std=c99 -O2 -ffp-contract=off -c -I"$root/csrc/include" "$root/csrc/cpu/rope.c" -o "$out/rope/cpu_rope.o"
g++ -std=c++20 -O2 -ffp-contract=off -fno-strict-aliasing -Wall -Wno-unused-function -Wno-unknown-pragmas \
    -I"$here" -I"$root/csrc/include" -I"$root/csrc/cuda" -c "$out/rope/rope_emulated.cpp" -o "$out/rope/emulated.o"
g++ -std=c++20 -O2 -ffp-contract=off -I"$root/csrc/include" -c "$here/test_emulated_rope.cpp" -o "$out/rope/test.o"
g++ "$out"/rope/*.o "$out/common.o" -o "$out/rope/test_emulated_rope" -lpthread
"$out/rope/test_emulated_rope"
