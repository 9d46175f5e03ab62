#!/bin/bash
# Runs coat's CUDA kernels on the CPU (one std::thread per CUDA thread, cuda_runtime.h here) and checks them
# against the C core:
#   adamw (csrc/cuda/adamw_*.cu; test_emulated_kernels.cpp says how): quantize_expanded and dequantize_expanded bit
#     for bit; fp8_adamw_step against the C core and a float64 oracle within tests/test_adamw_ops.py's tolerance, for
#     determinism and for independence of layout, over shapes, dtypes, formats, group sizes, misaligned tensors,
#     NaN / Inf / zero / subnormal gradients and multi-tensor launches. The step kernel's hardware
#     approximations (csrc/cuda/adamw_fast_math.cuh) are replaced by adamw_fast_math.cuh here: exact values
#     moved by pseudo-random errors up to the PTX ISA's bounds.
#   norm_act (csrc/cuda/rmsnorm.cu, silu_mul.cu): every output of rmsnorm_quantize / rmsnorm_requantize /
#     rmsnorm_backward / rmsnorm_save / silu_mul_quantize / silu_mul_requantize / silu_mul_backward bit for bit (see
#     test_emulated_norm_act.cpp), and the fast sigmoid against coat_sigmoid (on every float it accepts with `full`,
#     about a minute on two cores). The few hardware instructions it uses on sm_80+ (FP8 and bf16 conversions,
#     MUFU.RCP in rcp.rn's own sequence) are replaced by the C core's functions they equal.
#   rope: rotary_embedding forward and inverse bit for bit (test_emulated_rope.cpp).
#   quantize: the FP8 quantizers (group, tensor, amax, transpose, dequantize) of csrc/cuda/quantize.cu and the FP4
#     codec of quantize_blocks.cu bit for bit (test_emulated_quantize.cpp). Without __CUDA_ARCH__ coat_divide_by_scale divides; the fast
#     quotient of fp8_chunk.cuh runs as on the GPU.
#   stats: quantization_sums' kernel, every measure's sums bit for bit (test_emulated_stats.cpp).
# It checks the kernels' logic (tiles, lanes, shuffles, votes, fast and general paths, prefetching), not the
# GPU's own arithmetic.
#   tools/cuda_emulation/run.sh [quick|full] [adamw|norm_act|rope|quantize|stats]
set -e
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mode=${1:-default}
only=${2:-}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cflags="-std=c99 -O2 -ffp-contract=off -I$root/csrc/include"
cxxflags="-std=c++20 -O2 -ffp-contract=off -fno-strict-aliasing -Wall -Wno-unused-function -Wno-unknown-pragmas -I$here -I$root/csrc/include -I$root/csrc/cuda"
# emulated NAME FILE...: $out/NAME_emulated.cpp, one translation unit of the .cu FILEs of csrc/cuda (the files of one
# C API header), each with its launches rewritten into $out under its own name, as are the .cuh FILEs they share.
# The test programs call the files' internal functions, and the emulated runtime is defined once. An #include "..."
# looks beside the including file first, so the rewritten copies in $out shadow csrc/cuda's, and so does what they
# include from here (adamw_fast_math.cuh: $out has none, and -I$here comes first).
emulated() {
  local name=$1 file
  shift
  : > "$out/${name}_emulated.cpp"
  for file in "$@"; do
    python3 "$here/launch_rewrite.py" "$root/csrc/cuda/$file" "$out/$file"
    case $file in *.cu) echo "#include \"$file\"" >> "$out/${name}_emulated.cpp" ;; esac
  done
}
gcc $cflags -c "$root/csrc/cpu/quantize.c" -o "$out/cpu_quantize.o"
gcc $cflags -c "$root/csrc/common.c" -o "$out/common.o"
if [ -z "$only" ] || [ "$only" = adamw ]; then
  emulated adamw adamw.cuh adamw_step.cu adamw_expanded.cu adamw_moment_stats.cu
  gcc $cflags -c "$root/csrc/cpu/adamw.c" -o "$out/cpu_adamw.o"
  g++ $cxxflags -c "$out/adamw_emulated.cpp" -o "$out/adamw_emulated.o"
  g++ -std=c++20 -O2 -ffp-contract=off -I"$root/csrc/include" -c "$here/test_emulated_kernels.cpp" -o "$out/adamw_test.o"
  g++ "$out/adamw_emulated.o" "$out/adamw_test.o" "$out/cpu_adamw.o" "$out/cpu_quantize.o" "$out/common.o" \
      -o "$out/test_emulated_adamw" -lpthread
  if [ "$mode" = quick ]; then "$out/test_emulated_adamw" quick; else "$out/test_emulated_adamw"; fi
fi
if [ -z "$only" ] || [ "$only" = norm_act ]; then
  emulated norm_act norm_act.cuh rmsnorm.cu silu_mul.cu
  gcc $cflags -c "$root/csrc/cpu/norm_act.c" -o "$out/cpu_norm_act.o"
  g++ $cxxflags -I"$out" -c "$here/test_emulated_norm_act.cpp" -o "$out/norm_act_test.o"
  g++ "$out/norm_act_test.o" "$out/cpu_norm_act.o" "$out/cpu_quantize.o" "$out/common.o" -o "$out/test_emulated_norm_act" -lpthread
  "$out/test_emulated_norm_act" "$mode"
fi
if [ -z "$only" ] || [ "$only" = rope ]; then
  emulated rope rope.cu
  gcc $cflags -c "$root/csrc/cpu/rope.c" -o "$out/cpu_rope.o"
  g++ $cxxflags -c "$out/rope_emulated.cpp" -o "$out/rope_emulated.o"
  g++ -std=c++20 -O2 -ffp-contract=off -I"$root/csrc/include" -c "$here/test_emulated_rope.cpp" -o "$out/rope_test.o"
  g++ "$out/rope_emulated.o" "$out/rope_test.o" "$out/cpu_rope.o" "$out/common.o" -o "$out/test_emulated_rope" -lpthread
  "$out/test_emulated_rope"
fi
if [ -z "$only" ] || [ "$only" = quantize ]; then
  emulated quantize quantize.cu quantize_blocks.cu
  g++ $cxxflags -c "$out/quantize_emulated.cpp" -o "$out/quantize_emulated.o"
  g++ -std=c++20 -O2 -ffp-contract=off -I"$here" -I"$root/csrc/include" -c "$here/test_emulated_quantize.cpp" -o "$out/quantize_test.o"
  g++ "$out/quantize_emulated.o" "$out/quantize_test.o" "$out/cpu_quantize.o" "$out/common.o" -o "$out/test_emulated_quantize" -lpthread
  "$out/test_emulated_quantize" "$mode"
fi
if [ -z "$only" ] || [ "$only" = stats ]; then
  emulated stats stats.cu
  gcc $cflags -c "$root/csrc/cpu/stats.c" -o "$out/cpu_stats.o"
  g++ $cxxflags -c "$out/stats_emulated.cpp" -o "$out/stats_emulated.o"
  g++ -std=c++20 -O2 -ffp-contract=off -I"$root/csrc/include" -c "$here/test_emulated_stats.cpp" -o "$out/stats_test.o"
  g++ "$out/stats_emulated.o" "$out/stats_test.o" "$out/cpu_stats.o" "$out/cpu_quantize.o" "$out/common.o" \
      -o "$out/test_emulated_stats" -lpthread
  "$out/test_emulated_stats" "$mode"
fi
