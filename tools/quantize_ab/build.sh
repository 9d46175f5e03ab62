#!/bin/bash
# Builds tools/quantize_ab/bench.cu against versions of csrc/cuda/quantize.cu, one binary per version, for an
# A/B of kernel changes on the GPU machine without building the torch extension (carry OUTDIR there).
#   tools/quantize_ab/build.sh OUTDIR NAME=QUANTIZE_CU [NAME=QUANTIZE_CU...]   (e.g. old=<(git show HEAD:csrc/cuda/quantize.cu))
#   then, on the GPU: for name in ...; do OUTDIR/bench_$name $name; done
set -e
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:?usage: build.sh OUTDIR NAME=QUANTIZE_CU...}
shift
mkdir -p "$out"
arch=${ARCH:-sm_90}
flags="$(cat "$root/csrc/cuda/nvcc.flags") -arch=$arch -I$root/csrc/include -I$root/csrc/cuda"
gcc -std=c99 -O2 -I"$root/csrc/include" -c "$root/csrc/common.c" -o "$out/common.o"
nvcc -O2 -std=c++17 -arch=$arch -I"$root/csrc/include" -c "$here/bench.cu" -o "$out/bench.o"
for spec in "$@"; do
  name=${spec%%=*}
  cp "${spec#*=}" "$out/quantize_$name.cu"  # nvcc wants a .cu file, and process substitutions are pipes
  nvcc $flags -c "$out/quantize_$name.cu" -o "$out/quantize_$name.o"
  nvcc -arch=$arch "$out/bench.o" "$out/quantize_$name.o" "$out/common.o" -o "$out/bench_$name"
  rm "$out/quantize_$name.o"
done
rm "$out/bench.o" "$out/common.o"
