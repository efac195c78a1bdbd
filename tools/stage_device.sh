#!/usr/bin/env bash
# Builds, here on the CPU machine, everything tools/gpu_suite.sh runs on the GPU machine (which has
# no Rust): every lily-cuda test binary and the `lily` binary, with `--features cuda`, stripped into
# .device/bundle.tar.xz (git-ignored; the device tool carries it: `carry: [".device"]`).
#   bash tools/stage_device.sh            # CARGO_TARGET_DIR defaults to target/
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
stage=$(mktemp -d)/d
mkdir -p "$stage/tests"
export STAGE=$stage
cargo test --release -p lily-cuda --features cuda --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys, shutil, os
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        name = m["target"]["name"]
        shutil.copy(m["executable"], os.environ["STAGE"] + "/tests/" + name)
        print("staged test", name)
'
cargo build --release -p lily --features cuda
cp "$CARGO_TARGET_DIR/release/lily" "$stage/lily"
strip "$stage/lily" "$stage"/tests/*
# The binaries all embed the same cubins: one solid xz -9 archive (64 MiB window) keeps them ~22 MB (the
# carry limit, 64 MiB, counts the tracked files too). STAGE_EXTRA: more binaries to pack (e.g. an example).
rm -rf .device && mkdir -p .device
for b in ${STAGE_EXTRA:-}; do cp "$b" "$stage/" && strip "$stage/$(basename "$b")"; done
tar cf - -C "$(dirname "$stage")" d | xz -9 -T2 >.device/bundle.tar.xz
rm -rf "$(dirname "$stage")"
ls -la .device
