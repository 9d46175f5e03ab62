#!/bin/bash
# Runs csrc/cuda/adamw.cu's and csrc/cuda/norm_act.cu's kernels on the CPU (one std::thread per CUDA thread,
# cuda_runtime.h here) and compares every result with the C core bit for bit.
#   adamw: params, codes and meta of fp8_adamw_step over shapes, dtypes, formats, group sizes, misaligned
#     tensors, NaN / Inf / subnormal inputs and multi-tensor launches; quantize_expanded and dequantize_expanded.
#   norm_act: every output of rmsnorm_quantize / rmsnorm_backward / silu_mul_quantize / silu_mul_backward (see
#     test_emulated_norm_act.cpp), and the fast sigmoid against coat_sigmoid (on every float it accepts with
#     `full`, about a minute on two cores).
# It checks the kernels' logic (tiles, lanes, shuffles, fast paths, prefetching), not the GPU's arithmetic:
# the host's fmaf, / and sqrtf are IEEE like the GPU's with the build's flags; the few hardware instructions
# the kernels use on sm_80+ (FP8 and bf16 conversions, MUFU.RCP in rcp.rn's own sequence) are replaced by the
# C core's functions they equal.
#   tools/cuda_emulation/run.sh [quick|full] [adamw|norm_act]
set -e
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mode=${1:-default}
only=${2:-}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cflags="-std=c99 -O2 -ffp-contract=off -I$root/csrc/include"
cxxflags="-std=c++20 -O2 -ffp-contract=off -fno-strict-aliasing -Wall -Wno-unused-function -Wno-unknown-pragmas -I$here -I$root/csrc/include -I$root/csrc/cuda"
gcc $cflags -c "$root/csrc/cpu/quantize.c" -o "$out/cpu_quantize.o"
gcc $cflags -c "$root/csrc/common.c" -o "$out/common.o"
if [ -z "$only" ] || [ "$only" = adamw ]; then
  python3 "$here/launch_rewrite.py" "$root/csrc/cuda/adamw.cu" "$out/adamw_emulated.cpp"
  gcc $cflags -c "$root/csrc/cpu/adamw.c" -o "$out/cpu_adamw.o"
  g++ $cxxflags -c "$out/adamw_emulated.cpp" -o "$out/adamw_emulated.o"
  g++ -std=c++20 -O2 -ffp-contract=off -I"$root/csrc/include" -c "$here/test_emulated_kernels.cpp" -o "$out/adamw_test.o"
  g++ "$out/adamw_emulated.o" "$out/adamw_test.o" "$out/cpu_adamw.o" "$out/cpu_quantize.o" "$out/common.o" \
      -o "$out/test_emulated_adamw" -lpthread
  if [ "$mode" = quick ]; then "$out/test_emulated_adamw" quick; else "$out/test_emulated_adamw"; fi
fi
if [ -z "$only" ] || [ "$only" = norm_act ]; then
  python3 "$here/launch_rewrite.py" "$root/csrc/cuda/norm_act.cu" "$out/norm_act_emulated.cpp"
  gcc $cflags -c "$root/csrc/cpu/norm_act.c" -o "$out/cpu_norm_act.o"
  g++ $cxxflags -I"$out" -c "$here/test_emulated_norm_act.cpp" -o "$out/norm_act_test.o"
  g++ "$out/norm_act_test.o" "$out/cpu_norm_act.o" "$out/cpu_quantize.o" "$out/common.o" -o "$out/test_emulated_norm_act" -lpthread
  "$out/test_emulated_norm_act" "$mode"
fi
