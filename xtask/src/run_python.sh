#!/usr/bin/env bash
# The Python package's GPU suite, on the device machine. Written by `cargo xtask device-bundle`.
#
#   bash bundle/python/run.sh            install the wheel (no internet), run the GPU pytest files
#                                        (2 and 4 ranks as processes), then the torchrun example
#   EP_IBGDA_TEST_RANKS=2,8 bash bundle/python/run.sh    other rank counts
#   EP_IBGDA_TEST_RANKS=4 bash bundle/python/run.sh      the 4-rank cases only
#   EXAMPLE_RANKS=4 bash bundle/python/run.sh            ranks of the example (default 2)
#   EP_IBGDA_RANKS_PER_NODE=1 bash bundle/python/run.sh  the example internode, over virtual nodes
#                                        of 1 rank (the pytest files set it themselves, per test)
#   EP_PY_TESTS='test_gpu_internode.py' bash bundle/python/run.sh   only these pytest files (a glob of
#                                        python/tests names; default test_gpu_*.py)
#   bash bundle/python/run.sh --bench    instead of the tests: the host overhead of the Python
#                                        layer over the Rust core and CUDA-graph replay of
#                                        low-latency dispatch/combine (bench/host_overhead.py),
#                                        beside bench_low_latency --procs where the full bundle
#                                        has it (EP_PY_BENCH_RUST=0 skips it)
#   EP_IBGDA_BENCH_RANKS=2,4 bash bundle/python/run.sh --bench     other rank counts (default 2)
# Bounds: EP_PY_SUITE_TIMEOUT (480 s), EP_PY_EXAMPLE_TIMEOUT (90 s), EP_IBGDA_TEST_TIMEOUT_S (200 s a case),
# EP_PY_BENCH_TIMEOUT (240 s), EP_PY_RUST_BENCH_TIMEOUT (90 s a rank count).
# Every GPU test must pass at least one case: a skip, or a test that ran none (NOCASE), fails.
#
# Logs go to $OUT (or bundle/python/out): python_suite.log, python_example.log; with --bench
# python_bench.log and python_bench.json (records with ranks and gpus), rust_ll_procs_<R>.json.
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
py=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
work=$(mktemp -d)

# Install beside the machine's own Python, which is where torch lives (on the device image
# python3 is itself a venv, /opt/torch/.venv: a venv made from it with --system-site-packages
# would see the base interpreter's packages, not torch). pytest comes from the wheels only
# when the machine has none.
pyx="$py"
pkgs=ep_ibgda
"$pyx" -c "import pytest" >/dev/null 2>&1 || pkgs="$pkgs pytest"
# shellcheck disable=SC2086
"$pyx" -m pip install --quiet --no-index --find-links "$here/wheels" --target "$work/site" $pkgs || exit 1
export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
"$pyx" -c "import ep_ibgda, torch; print('ep_ibgda', ep_ibgda.__version__, 'from', ep_ibgda.__file__, '| torch', torch.__version__, '| GPUs', torch.cuda.device_count())" >"$out/python_suite.log" 2>&1
ok=$?
cat "$out/python_suite.log"
if [ $ok != 0 ]; then echo "FAIL: $pyx cannot import ep_ibgda and torch (see above)"; exit 1; fi
# Here every GPU test must run: a skip is a failure.
export EP_IBGDA_REQUIRE_GPU=1

if [ "${1:-}" = "--bench" ]; then
  ranks=${EP_IBGDA_BENCH_RANKS:-2}
  rust=()
  rb="$here/../bin/bench_low_latency"
  if [ -x "$rb" ] && [ "${EP_PY_BENCH_RUST:-1}" = 1 ]; then
    for r in ${ranks//,/ }; do
      echo "[run.sh] bench_low_latency --procs --ranks $r (the Rust figures to compare with)" | tee -a "$out/python_bench.log"
      if CUDA_DEVICE_MAX_CONNECTIONS=32 timeout "${EP_PY_RUST_BENCH_TIMEOUT:-90}" "$rb" --procs --ranks "$r" --no-transport \
          --iters 4 --json "$out/rust_ll_procs_$r.json" >>"$out/python_bench.log" 2>&1; then
        rust+=(--rust-json "$out/rust_ll_procs_$r.json")
      else
        echo "[run.sh] bench_low_latency --procs --ranks $r failed (see above): no Rust figures for $r ranks" | tee -a "$out/python_bench.log"
      fi
    done
  elif [ ! -x "$rb" ]; then
    echo "[run.sh] no bundle/bin/bench_low_latency (a --python bundle): Python figures only" | tee -a "$out/python_bench.log"
  fi
  timeout "${EP_PY_BENCH_TIMEOUT:-240}" "$pyx" "$here/bench/host_overhead.py" --ranks "$ranks" \
    --json "$out/python_bench.json" --profile "$out/python_bench_profile" ${rust[@]+"${rust[@]}"} 2>&1 | tee -a "$out/python_bench.log"
  bench=${PIPESTATUS[0]}
  echo "python bench: exit $bench" | tee -a "$out/python_bench.log"
  exit "$bench"
fi

cd "$here/tests" || exit 1
# shellcheck disable=SC2086
timeout "${EP_PY_SUITE_TIMEOUT:-480}" env -u EP_IBGDA_RANKS_PER_NODE "$pyx" -m pytest -v -rs -s --durations=0 -p no:cacheprovider ${EP_PY_TESTS:-test_gpu_*.py} 2>&1 | tee -a "$out/python_suite.log"
suite=${PIPESTATUS[0]}

timeout "${EP_PY_EXAMPLE_TIMEOUT:-90}" "$pyx" -m torch.distributed.run --standalone --nproc-per-node "${EXAMPLE_RANKS:-2}" \
  "$here/examples/dispatch_combine.py" 2>&1 | tee "$out/python_example.log"
example=${PIPESTATUS[0]}

echo "python suite: exit $suite; torchrun example: exit $example" | tee -a "$out/python_suite.log"
[ "$suite" = 0 ] && [ "$example" = 0 ]
