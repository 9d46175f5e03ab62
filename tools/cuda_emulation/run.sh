#!/bin/bash
# Runs csrc/cuda/adamw.cu's kernels on the CPU (one std::thread per CUDA thread, cuda_runtime.h here) and
# compares every result with the C core bit for bit: params, codes and meta of fp8_adamw_step over shapes,
# dtypes, formats, group sizes, misaligned tensors, NaN / Inf / subnormal inputs and multi-tensor launches;
# quantize_expanded and dequantize_expanded. It checks the kernels' logic (tiles, lanes, shuffles, fast
# paths), not the GPU's arithmetic: the host's fmaf, / and sqrtf are IEEE like the GPU's with the build's
# flags, and the kernels use no other floating-point operation. Then the same for csrc/cuda/rope.cu
# (test_emulated_rope.cpp), built as a program of its own: cuda_runtime.h is included by one translation unit.
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
