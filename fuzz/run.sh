#!/usr/bin/env bash
# Builds the fuzz targets with AFL++ instrumentation (cargo-afl, stable Rust) and runs each for
# SECONDS, one after the other; exits 1 if any found a crash or a hang (the inputs are printed and
# kept under fuzz/out/TARGET/default/{crashes,hangs}).
#
#   bash fuzz/run.sh SECONDS [TARGET...]     (targets: request template parser decoder checkpoint)
#
# Needs cargo-afl (`cargo install cargo-afl --locked`, which also builds AFL++). Set
# CARGO_TARGET_DIR to build elsewhere than fuzz/target; FUZZ_OUT to keep the findings elsewhere
# than fuzz/out; FUZZ_RESUME=1 to go on from a previous run's queue instead of the seed corpus.
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:?usage: run.sh SECONDS [TARGET...]}"
shift
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(request template parser decoder checkpoint)
out="${FUZZ_OUT:-$PWD/out}"
bin="${CARGO_TARGET_DIR:-$PWD/target}/release"

cargo afl build --release --locked

# No core-dump handler or CPU governor to set up on a CI machine or a shared one: run as we are.
export AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_UI=1 AFL_NO_AFFINITY=1
export AFL_SKIP_CRASHES=0 AFL_TRY_AFFINITY=0
# The decoder target loads the real tokenizer before its fork server starts; under cmplog
# instrumentation on a busy 2-core machine that can take longer than afl-fuzz's default wait for
# the fork server (ten times -t, 10 s for decoder), and afl-fuzz gave up before fuzzing (CI on
# 293a6ae). Wait up to two minutes (milliseconds).
export AFL_FORKSRV_INIT_TMOUT="${AFL_FORKSRV_INIT_TMOUT:-120000}"

failed=0
for t in "${targets[@]}"; do
  case "$t" in
    request|template) dict=(-x dict/json.dict); timeout=2000 ;;
    checkpoint) dict=(-x dict/json.dict); timeout=2000 ;;
    parser) dict=(-x dict/parser.dict); timeout=1000 ;;
    decoder) dict=(); timeout=1000 ;;
    *) echo "unknown target $t"; exit 2 ;;
  esac
  input=(-i "corpus/$t")
  if [ "${FUZZ_RESUME:-0}" = 1 ] && [ -d "$out/$t/default/queue" ]; then input=(-i -); fi
  mkdir -p "$out/$t"
  echo "== fuzz $t for ${secs}s"
  stats="$out/$t/default/fuzzer_stats"
  # A start that failed before fuzzing (no fuzzer_stats: the machine, not the target) is tried once
  # more, from a fresh output folder; any other failure, or a second failed start, fails the run.
  for attempt in 1 2; do
    if cargo afl fuzz "${input[@]}" -o "$out/$t" -V "$secs" -t "$timeout" "${dict[@]}" -- "$bin/$t" > "$out/$t.log" 2>&1; then
      break
    fi
    echo "afl-fuzz failed for $t (attempt $attempt):"; tail -30 "$out/$t.log"
    if [ "$attempt" = 2 ] || [ -f "$stats" ]; then exit 1; fi
    [ "${FUZZ_RESUME:-0}" = 1 ] || rm -rf "${out:?}/$t"
    mkdir -p "$out/$t"
  done
  grep -E '^(run_time|execs_done|execs_per_sec|corpus_count|saved_crashes|saved_hangs|bitmap_cvg) ' "$stats" | tr -s ' ' | paste -sd' '
  for kind in crashes hangs; do
    found=$(find "$out/$t/default/$kind" -type f ! -name README.txt 2>/dev/null | sort)
    if [ -n "$found" ]; then
      failed=1
      echo "!! $t: $kind:"
      for f in $found; do echo "   $f"; head -c 400 "$f" | od -An -c | head -8; done
    fi
  done
done
exit "$failed"
