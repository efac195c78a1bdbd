#!/usr/bin/env bash
# The ledgers on the GPU machine: `lily profile` (decode at CONTEXTS, prefill of PROMPTS) with the
# bundle's lily, and, when a second binary is given in BEFORE (a stripped lily, .xz allowed), the same
# with it first, so one call records the ledger before and after a change. MODEL as in gpu_suite.sh.
#   BEFORE=.device-before/lily.xz CONTEXTS=4K,128K PROMPTS=4K bash tools/gpu_ledger.sh .device
set -uo pipefail
dir=${1:-.device}
if [ -f "$dir/bundle.tar.xz" ] && [ ! -x /tmp/lily-device/d/lily ]; then
  mkdir -p /tmp/lily-device && tar xJf "$dir/bundle.tar.xz" -C /tmp/lily-device
fi
[ -f "$dir/bundle.tar.xz" ] && dir=/tmp/lily-device/d
out=${OUT:-gpu_suite_out}
model=${MODEL:-/tmp/q35}
mkdir -p "$out"
if [ ! -f "$model/config.json" ]; then
  "$dir/lily" synth --config qwen3.6-35b-a3b --out "$model" 2>&1 | tail -1
fi
status=0
run() {  # name binary
  "$2" profile --backend cuda --model "$model" --context "${CONTEXTS:-4K}" ${PROMPTS:+--prompt "$PROMPTS"} \
    --repeats "${REPEATS:-5}" --json "$out/ledger_$1.json" >"$out/ledger_$1.md" 2>"$out/ledger_$1.err" || { status=1; tail -5 "$out/ledger_$1.err"; }
  echo "== ledger ($1)"; cat "$out/ledger_$1.md"
}
if [ -n "${BEFORE:-}" ]; then
  b=/tmp/lily-before
  case "$BEFORE" in *.xz) xz -dc "$BEFORE" >"$b" ;; *) cp "$BEFORE" "$b" ;; esac
  chmod +x "$b"
  run before "$b"
fi
run after "$dir/lily"
exit $status
