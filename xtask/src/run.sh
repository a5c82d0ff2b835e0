#!/usr/bin/env bash
# The GPU suite, on the device machine. Written by `cargo xtask device-bundle`; do not edit the copy.
#
#   bash bundle/run.sh                 every GPU test and example smoke run
#   bash bundle/run.sh --only REGEX    the tests whose "binary::test" name matches REGEX
#   bash bundle/run.sh --bench [REGEX] the benchmarks (bin/bench_*) matching REGEX (all if none)
#   bash bundle/run.sh --list          list what would run
#
# Logs go to $OUT (or bundle/out): suite.log (every test's output), summary.txt (the table),
# bench JSON files. The table is printed last. A test that prints "SKIPPED (needs N GPUs, found M)"
# on a machine with at least N GPUs counts as a failure (BADSKIP): nothing the machine could run is
# skipped. A test that printed neither a skip nor the harness's "gpus:"/"ranks:" line ran no case:
# NOCASE, a failure, unless it printed "AUX (why)" (a child process or a CPU check: not a failure).
set -u
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export RUST_BACKTRACE=1
# Ranks as threads sharing one GPU each bring their own streams; with the driver's default of 8
# hardware queues, streams of different ranks share a queue and a rank's kernel can wait in it
# behind another rank's spinning one. 32 is the driver's maximum (see ep::residency).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
# NVLink multicast stays off on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-$here/out}
mkdir -p "$out"
log="$out/suite.log"; summary="$out/summary.txt"
: >"$log"; : >"$summary"
per_test_limit=${EP_TEST_TIMEOUT:-300}

mode=tests; pattern='.'; list=0
while [ $# -gt 0 ]; do
  case "$1" in
    --only) pattern="$2"; shift 2 ;;
    --bench) mode=bench; shift; if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then pattern="$1"; shift; fi ;;
    --list) list=1; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
# What the tests can see: CUDA_VISIBLE_DEVICES narrows the machine's GPUs.
if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
  ngpu=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c . || true)
fi
echo "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1) x $ngpu; $(date -u +%FT%TZ)" | tee -a "$log"

rows=(); failed=0
record() { # name result seconds
  rows+=("$(printf '%-58s %-8s %8s' "$1" "$2" "$3")")
  [ "$2" = PASS ] || [ "$2" = AUX ] || failed=$((failed + 1))
}

# Runs a command with the per-test bound. A command still running when the bound is near first
# gets every thread's stack written to $out/stacks-<name>.txt (cuda-gdb attaches, where the machine
# has it), so a hang leaves the evidence of where each thread waits, then it is killed: exit 124
# as from timeout(1).
run_bounded() { # name, log, command...
  local name=$1 log=$2; shift 2
  "$@" >"$log" 2>&1 &
  local pid=$! t=0 dump_at=$((per_test_limit > 20 ? per_test_limit - 15 : per_test_limit))
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$t" -ge "$dump_at" ] && [ "$t" -lt "$per_test_limit" ] && [ "${dumped:-}" != "$pid" ]; then
      dumped=$pid
      local stacks="$out/stacks-$(echo "$name" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-80).txt"
      if command -v cuda-gdb >/dev/null 2>&1; then
        echo "[run.sh] $name still running after ${t}s: thread stacks in $stacks" >>"$log"
        timeout 30 cuda-gdb -q -p "$pid" -batch -ex "set pagination off" -ex "info threads" \
          -ex "thread apply all bt 30" >"$stacks" 2>&1
      else
        echo "[run.sh] $name still running after ${t}s (no cuda-gdb here: no stacks)" >>"$log"
      fi
    fi
    if [ "$t" -ge "$per_test_limit" ]; then
      kill -9 "$pid" 2>/dev/null
      wait "$pid" 2>/dev/null
      return 124
    fi
    sleep 1; t=$((t + 1))
  done
  wait "$pid"
}

run_one() { # name, command...
  local name=$1; shift
  if [ $list = 1 ]; then echo "$name"; return; fi
  echo "=== $name" >>"$log"
  local t0 t1 rc tmp; tmp=$(mktemp); t0=$(date +%s.%N)
  run_bounded "$name" "$tmp" "$@"; rc=$?
  t1=$(date +%s.%N)
  cat "$tmp" >>"$log"
  local secs; secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}')
  local result=PASS
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then result=TIMEOUT
  elif [ $rc -ne 0 ]; then result=FAIL
  elif grep -q 'SKIPPED (needs' "$tmp"; then
    local need; need=$(grep -o 'SKIPPED (needs [0-9]*' "$tmp" | head -1 | grep -o '[0-9]*$')
    if [ "$need" -le "$ngpu" ]; then result=BADSKIP; else result=SKIP; fi
  fi
  # A test that passed without taking GPUs from the harness (no "gpus:"/"ranks:" line) and
  # without a skip ran no case: that is a failure, not a pass.
  if [ $result = PASS ] && [ "${name#example::}" = "$name" ] && ! grep -Eq '(gpus: [0-9]+ of [0-9]+ visible|ranks: [0-9]+ ranks? on [0-9]+ GPU)' "$tmp"; then
    result=NOCASE
    # ... unless it says it runs no GPU case by design (a child process, a CPU check).
    grep -q 'AUX (' "$tmp" && result=AUX
  fi
  # A skip the machine could not have run is not a failure.
  if [ $result = SKIP ]; then rows+=("$(printf '%-58s %-8s %8s' "$name" SKIP "$secs")"); else record "$name" "$result" "$secs"; fi
  echo "--- $name: $result ($secs s, exit $rc)" >>"$log"
  rm -f "$tmp"
}

if [ $mode = tests ]; then
  for bin in "$here"/tests/*; do
    [ -x "$bin" ] || continue
    b=$(basename "$bin")
    while IFS= read -r line; do
      t=${line%: test}
      [ "$t" = "$line" ] && continue
      name="$b::$t"
      echo "$name" | grep -Eq -- "$pattern" || continue
      run_one "$name" "$bin" --exact "$t" --nocapture --test-threads=1
    done < <("$bin" --list --format terse 2>/dev/null)
  done
  while IFS='|' read -r name args; do
    [ -n "$name" ] || continue
    row="example::$name${args:+ $args}"
    echo "$row" | grep -Eq -- "$pattern" || continue
    # shellcheck disable=SC2086
    run_one "$row" "$here/bin/$name" $args
  done <"$here/examples.txt"
else
  for bin in "$here"/bin/bench_*; do
    [ -x "$bin" ] || continue
    b=$(basename "$bin")
    echo "$b" | grep -Eq -- "$pattern" || continue
    run_one "$b" "$bin" --json "$out/$b.json"
  done
fi

[ $list = 1 ] && exit 0
{
  printf '%-58s %-8s %8s\n' TEST RESULT SECONDS
  for r in "${rows[@]}"; do echo "$r"; done
  echo "gpus: $ngpu; failed: $failed; logs: $log"
} | tee "$summary"
[ $failed -eq 0 ]
