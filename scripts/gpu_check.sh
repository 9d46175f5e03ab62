#!/usr/bin/env bash
# On a GPU machine with torch and nvcc: build coat with CUDA, run the test suite (CUDA cases compare against
# the C CPU core bit for bit) and the GPU benchmarks. Logs and benchmark JSON go to OUTDIR (logs/, results/)
# and are packed into OUTDIR/gpu_check.tgz; the tail of each stage is printed.
#
#   usage: scripts/gpu_check.sh OUTDIR [STAGE...]   (stages longer than one device call: scripts/gpu_background.sh)
#   stages: build, tests, tests:PATTERN (pytest -k), test:NAME[:PATTERN] (tests/test_NAME.py alone, with -k),
#           bench (every benchmarks/*.py but the CPU probes, *_probe.py, and results_pages.py),
#           bench:NAME[:ARGS] (one script, extra ARGS comma-separated, e.g. bench:layer:--settings,4096x2048,--profile),
#           torchrun:NAME[:ARGS] (benchmarks/NAME.py on every visible GPU under torchrun, ARGS as for bench),
#           script:NAME[:ARGS] (scripts/NAME.py, e.g. script:check_sdpa_backward; its output in logs/script_NAME.log),
#           beside:STAGE (STAGE in the background, beside the stages after it, e.g. the CUDA tests beside long
#           convergence runs once a benchmark has had the GPU alone; waited for before packing),
#           convergence:PRESET[:ARGS] (examples/train_llama.py --preset PRESET, BF16 and coat side by side, or
#           the runs CONVERGENCE_RUNS names, e.g. "bf16=;coat=--coat;coat-fp8g=--coat,--bf16-weights,--fp8-grads,e5m2",
#           spread over the GPUs; extra ARGS comma-separated, for every run; CSVs, summaries and the plot in
#           OUTDIR/results/convergence-PRESET; with CONVERGENCE_EXAMPLE=train_vlm, examples/train_vlm.py's
#           presets and options, e.g. "coat-vision=--coat,--vision-linears", in OUTDIR/results/convergence-vlm-PRESET)
#   default: build tests bench
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR [STAGE...]}
shift
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(build tests bench)
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"  # for beside: stages, wherever the script was started from
cd "$(dirname "$0")/.."
mkdir -p "$out/logs" "$out/results"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MAX_JOBS=${MAX_JOBS:-16}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
# The GPU image's Python is configured with a GCC (/opt/gcc) that links libstdc++ statically into
# extensions; two libstdc++ copies in one process crash when an error message formats a number. The
# system compiler links it dynamically, like torch.
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
status=0
# The GPU machine has no network: optional packages (torchao and Liger-Kernel for the benchmarks' anchors) travel
# as wheels in .wheels/ (pip download torchao==0.18.0 --no-deps --only-binary=:all: --python-version 3.12 -d .wheels,
# the same for liger-kernel==0.8.5, which needs only torch and triton).
# A beside: stage's own run finds them installed (COAT_WHEELS on PYTHONPATH already).
if compgen -G ".wheels/*.whl" > /dev/null && [ -z "${COAT_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/coat-wheels .wheels/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/coat-wheels" COAT_WHEELS=/tmp/coat-wheels
fi

{ nvidia-smi; nvcc --version; "${CXX:-g++}" --version | head -n 1; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"; } \
  > "$out/logs/env.txt" 2>&1

run_bench() {
  local name=$1
  shift
  echo "== benchmark $name $* =="
  python3 "benchmarks/$name.py" --results-dir "$out/results" "$@" 2>&1 | tee -a "$out/logs/bench_$name.log" | tail -n 60
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

beside=()
for stage in "${stages[@]}"; do
  case $stage in
    beside:*)
      inner=${stage#beside:}
      echo "== beside: $inner (its output in logs/beside_${inner//[^A-Za-z0-9_.-]/_}.out) =="
      "$self" "$out" "$inner" > "$out/logs/beside_${inner//[^A-Za-z0-9_.-]/_}.out" 2>&1 &
      beside+=("$!:$inner") ;;
    build)
      echo "== build =="
      if ! python3 setup.py build_ext --inplace > "$out/logs/build.log" 2>&1; then
        tail -n 40 "$out/logs/build.log"; echo "BUILD FAILED"; exit 1
      fi
      python3 -c "import coat; assert coat.built_with_cuda(), 'extension built without CUDA'" || exit 1
      ldd coat/_C*.so | grep -q libstdc++ || echo "WARNING: coat/_C links libstdc++ statically" ;;
    tests | tests:*)
      echo "== tests ${stage#tests} =="
      filter=(); [ "$stage" = tests ] || filter=(-k "${stage#tests:}")
      # One pytest process per file, so that a crash costs one file's results, not the run's.
      : > "$out/logs/tests.log"
      for file in tests/test_*.py; do
        python3 -m pytest "$file" -q -rfEs -p no:cacheprovider "${filter[@]}" > "$out/logs/tests_file.log" 2>&1
        code=$?
        cat "$out/logs/tests_file.log" >> "$out/logs/tests.log"
        [ $code -eq 0 ] || [ $code -eq 5 ] || { status=1; echo "$file: exit $code"; grep -E "^(FAILED|ERROR)|Fatal Python" "$out/logs/tests_file.log" | head -n 20; }
        echo "$file: $(tail -n 1 "$out/logs/tests_file.log")"
      done
      rm -f "$out/logs/tests_file.log" ;;
    test:*)
      IFS=: read -r _ name filter <<< "$stage"
      echo "== tests/test_$name.py ${filter:+-k \"$filter\"} =="
      python3 -m pytest "tests/test_$name.py" -q -rfEs -p no:cacheprovider ${filter:+-k "$filter"} \
        > "$out/logs/test_$name.log" 2>&1
      code=$?
      [ $code -eq 0 ] || { status=1; echo "exit $code"; grep -E "^(FAILED|ERROR)|Fatal Python" "$out/logs/test_$name.log" | head -n 20; }
      tail -n 1 "$out/logs/test_$name.log" ;;
    bench)
      for script in benchmarks/[a-z]*.py; do
        case $script in *_probe.py | */results_pages.py) continue ;; esac
        run_bench "$(basename "$script" .py)"
      done ;;
    bench:*)
      IFS=: read -r _ name extra <<< "$stage"
      IFS=, read -r -a extra_args <<< "$extra"
      run_bench "$name" "${extra_args[@]}" ;;
    script:*)
      IFS=: read -r _ name extra <<< "$stage"
      IFS=, read -r -a extra_args <<< "$extra"
      echo "== scripts/$name.py ${extra_args[*]} =="
      python3 "scripts/$name.py" "${extra_args[@]}" > "$out/logs/script_$name.log" 2>&1 || status=1
      grep -v "Warning\|^  " "$out/logs/script_$name.log" | tail -n 40 ;;
    torchrun:*)
      IFS=: read -r _ name extra <<< "$stage"
      IFS=, read -r -a extra_args <<< "$extra"
      echo "== benchmark $name ${extra_args[*]}, torchrun on $(nvidia-smi -L | wc -l) GPUs =="
      torchrun --standalone --nproc_per_node "$(nvidia-smi -L | wc -l)" "benchmarks/$name.py" --results-dir "$out/results" \
        "${extra_args[@]}" 2>&1 | tee "$out/logs/torchrun_$name.log" | grep -v "step/s" | tail -n 40
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    convergence:*)
      IFS=: read -r _ preset extra <<< "$stage"
      IFS=, read -r -a extra_args <<< "$extra"
      # CONVERGENCE_EXAMPLE: the script, train_llama (the default) or train_vlm; the latter's runs are named
      # PRESET-vlm-NAME, as train_vlm.py names its own, in a directory of their own.
      example=${CONVERGENCE_EXAMPLE:-train_llama}
      case $example in
        train_llama) model=$preset; runs="$out/results/convergence-$preset" ;;
        train_vlm) model=$preset-vlm; runs="$out/results/convergence-vlm-$preset" ;;
        *) echo "CONVERGENCE_EXAMPLE=$example: use train_llama or train_vlm"; exit 2 ;;
      esac
      # CONVERGENCE_RUNS: NAME=FLAGS entries separated by ';', FLAGS comma-separated options of the script.
      IFS=';' read -r -a entries <<< "${CONVERGENCE_RUNS:-bf16=;coat=--coat}"
      gpus=$(nvidia-smi -L | wc -l)
      # On a shared GPU the runs' tokens/s are not speed figures (benchmarks/e2e.py measures speed). Each run
      # stops after CONVERGENCE_TIMEOUT seconds, so that a slow run still leaves its CSV and this script its tarball.
      echo "== convergence $example $preset: ${#entries[@]} runs at the same time on $gpus GPU(s) =="
      pids=(); names=(); csvs=()
      for i in "${!entries[@]}"; do
        name=${entries[$i]%%=*}
        IFS=, read -r -a flags <<< "${entries[$i]#*=}"
        CUDA_VISIBLE_DEVICES=$((i % gpus)) timeout "${CONVERGENCE_TIMEOUT:-3000}" python3 "examples/$example.py" \
          --preset "$preset" --out "$runs" --name "$model-$name" "${flags[@]}" "${extra_args[@]}" \
          > "$out/logs/convergence-$model-$name.log" 2>&1 &
        pids+=($!); names+=("$name"); csvs+=("$runs/$model-$name.csv")
      done
      for i in "${!pids[@]}"; do
        wait "${pids[$i]}"
        code=$?
        [ $code -eq 0 ] || { status=1; echo "${names[$i]}: exit $code"; }
        tail -n 3 "$out/logs/convergence-$model-${names[$i]}.log" | tr '\r' '\n' | tail -n 3
      done
      (cd examples && python3 -c "import sys, training_common as t; t.try_plot(sys.argv[2:], sys.argv[1])" \
        "$runs/$model.png" "${csvs[@]}") ;;
    *)
      echo "unknown stage $stage"; exit 2 ;;
  esac
done

for entry in "${beside[@]}"; do
  wait "${entry%%:*}" || { status=1; echo "beside ${entry#*:}: failed"; }
  tail -n 5 "$out/logs/beside_$(sed 's/[^A-Za-z0-9_.-]/_/g' <<< "${entry#*:}").out"
done
tar czf "$out/gpu_check.tgz" -C "$out" logs results
echo "gpu_check status: $status"
exit $status
