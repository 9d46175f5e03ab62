#!/usr/bin/env bash
# scripts/gpu_check.sh stages longer than one call to the GPU machine may run (the device tool stops a command
# after 10 minutes; a machine kept busy by successive calls keeps what runs detached):
#
#   scripts/gpu_background.sh start OUTDIR STAGE...   starts scripts/gpu_check.sh OUTDIR STAGE... detached, returns
#   scripts/gpu_background.sh wait OUTDIR SECONDS     waits until it has finished or SECONDS have passed, prints each
#                                                     stage's log tail and each convergence run's last progress line,
#                                                     and packs OUTDIR into $OUT/OUTDIR's-name.tgz (the device tool
#                                                     returns only a few files, so one archive)
#
# For example, one call: `scripts/gpu_background.sh start /tmp/c build convergence:gpu && scripts/gpu_background.sh
# wait /tmp/c 560`, then `scripts/gpu_background.sh wait /tmp/c 560` in the next calls until it says "finished".
set -uo pipefail
action=${1:?usage: scripts/gpu_background.sh start OUTDIR STAGE... | wait OUTDIR SECONDS}
out=${2:?usage: scripts/gpu_background.sh start OUTDIR STAGE... | wait OUTDIR SECONDS}
shift 2
cd "$(dirname "$0")/.."
case $action in
  start)
    mkdir -p "$out"
    rm -f "$out/exit_status"
    setsid bash -c 'scripts/gpu_check.sh "$@" > "$0/gpu_check.out" 2>&1; echo $? > "$0/exit_status"' \
      "$out" "$out" "$@" < /dev/null > /dev/null 2>&1 &
    echo "started scripts/gpu_check.sh $out $*" ;;
  wait)
    seconds=${1:?usage: scripts/gpu_background.sh wait OUTDIR SECONDS}
    end=$((SECONDS + seconds))
    while [ ! -f "$out/exit_status" ] && [ $SECONDS -lt "$end" ]; do sleep 5; done
    tr '\r' '\n' < "$out/gpu_check.out" | grep -v '^\s*$' | tail -n 30
    for log in "$out"/logs/convergence-*.log; do
      [ -f "$log" ] && echo "$(basename "$log"): $(tr '\r' '\n' < "$log" | grep -v '^\s*$' | tail -n 1)"
    done
    if [ -f "$out/exit_status" ]; then echo "finished, exit status $(cat "$out/exit_status")"; else echo "running"; fi
    if [ -n "${OUT:-}" ]; then tar czf "$OUT/$(basename "$out").tgz" -C "$(dirname "$out")" "$(basename "$out")"; fi ;;
  *)
    echo "usage: scripts/gpu_background.sh start OUTDIR STAGE... | wait OUTDIR SECONDS"; exit 2 ;;
esac
