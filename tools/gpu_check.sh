#!/usr/bin/env bash
# The one script that runs on the GPU machine (which has no Rust): the prebuilt lily-cuda test binary,
# its CPU-vs-GPU checks, compute-sanitizer over them, then the timing table.
#
# Build and stage here (the CPU machine):
#   export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
#   bin=$(cargo test --release -p lily-cuda --features cuda --no-run 2>&1 | sed -n 's/.*tests\/gpu_ops.rs (\(.*\))/\1/p')
#   mkdir -p .device && cp "$bin" .device/gpu_ops          # .device/ is git-ignored: carry it
# Run there (e.g. the device tool, carrying .device):
#   bash tools/gpu_check.sh .device
# Logs go to $OUT (or ./gpu_check_out): nvidia-smi.txt, tests.log, memcheck.log, racecheck.log, bench.log.
# The timing table is printed last. Exit status: non-zero if the tests failed.
#
# Optional: GPU_CHECK_SANITIZE=0 skips compute-sanitizer; GPU_CHECK_BENCH=0 skips the timings.
set -uo pipefail
dir=${1:-.device}
bin="$dir/gpu_ops"
out=${OUT:-gpu_check_out}
mkdir -p "$out"
[ -x "$bin" ] || { echo "no test binary at $bin (see the top of this script)"; exit 2; }

echo "== GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv 2>&1 | tee "$out/nvidia-smi.txt"

echo "== CPU-vs-GPU tests"
"$bin" --nocapture 2>&1 | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}
grep -E "^test result|worst relative" "$out/tests.log"

if [ "${GPU_CHECK_SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer memcheck (all tests)"
  timeout 100 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 3 "$bin" >"$out/memcheck.log" 2>&1
  echo "memcheck exit $? (0 clean, 3 errors found, 124 timed out)"; grep -E "ERROR SUMMARY|test result" "$out/memcheck.log" | tail -3
  echo "== compute-sanitizer racecheck (shared-memory kernels)"
  timeout 60 compute-sanitizer --tool racecheck --error-exitcode 3 "$bin" gemv_indexed swiglu rmsnorm >"$out/racecheck.log" 2>&1
  echo "racecheck exit $? (0 clean, 3 hazards found, 124 timed out)"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" "$out/racecheck.log" | tail -3
fi

if [ "${GPU_CHECK_BENCH:-1}" = 1 ]; then
  echo "== timings"
  "$bin" --ignored --nocapture --exact bench_ops 2>&1 | tee "$out/bench.log" | grep -vE "^(running|test |$)"
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader >>"$out/nvidia-smi.txt" 2>&1
fi
exit "$tests_rc"
