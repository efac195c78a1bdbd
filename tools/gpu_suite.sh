#!/usr/bin/env bash
# The one script for the GPU machine: the lily-cuda test binaries (CPU-vs-GPU kernel tests and the
# whole-model tests), then on the full-size synthetic qwen3.6-35b-a3b checkpoint the score parity run
# and `lily bench`, and a short table at the end. Stage the binaries here first:
#   bash tools/stage_device.sh
# then on the GPU machine (device tool, carrying .device):
#   SUITE=tests,parity,bench LENGTHS=256,4K bash tools/gpu_suite.sh .device
# SUITE picks the parts (default tests); opbench adds every kernel's #[ignore] timing test.
# MODEL (default /tmp/q35) is made with `lily synth` when missing. MLX (for the parity reference) is
# used when `python3 -c "import mlx_lm"` works (see ../shared/tools/fetch-mlx-wheels.sh); it scores
# on MLX_DEVICE (default gpu), within MLX_TIMEOUT seconds (default 480).
# parity: `lily score --backend cuda` on 193 random ids against MLX-LM (when installed); cpuref: the
# same against `lily score --backend cpu`. bench: `lily bench` over LENGTHS (default the ten lengths
# 256…128K), REPEATS (default 3), 64 decode tokens.
# ab: `lily bench` under each of the environments in AB_ENVS (space-separated; each VAR=VALUE, several
# joined by commas, `-` for none: e.g. AB_ENVS="- LILY_GDN_CHUNK=tc1 LILY_GDN_CHUNK=ffma"), ROUNDS
# (default 2) rounds in turn, over AB_LENGTHS (default 4K,32K), AB_DECODE_TOKENS decode tokens (default
# 8: a prefill A/B; 64 for a decode one, whose 8-token figures move ±5% between rounds), one repeat;
# then a table of prefill / decode tok/s, one row per environment, a column per round and length.
# scoreab: full-size `lily score --backend cuda` on SCORE_IDS random ids (default 1024; SCORE_CHUNK, when
# set, passed as --chunk) under each environment of SCORE_ENVS (as AB_ENVS), each compared with the
# first by tools/compare_scores.py (different kernels' numerics at full size; the issue's bar applies).
# TEST_ENV (VAR=VALUE, several joined by commas): the environment of every test binary the tests part runs.
# side: the side-by-side with MLX-LM on MODEL's bytes: ROUNDS (default 2) rounds, each MLX-LM's
# mlx_baseline.py (path in MLX_BASELINE) then `lily bench`, over SIDE_LENGTHS (default 256,1024,4096),
# 64 decode tokens, prefill in 2048-token steps for both; tools/side_table.py prints the table.
# Logs and JSON go to $OUT (default ./gpu_suite_out). Exit status non-zero when a part failed.
set -uo pipefail
dir=${1:-.device}
# A bundle made by stage_device.sh (binaries share their embedded cubins; xz packs 12 of them in ~3 MB).
if [ -f "$dir/bundle.tar.xz" ]; then
  mkdir -p /tmp/lily-device && tar xJf "$dir/bundle.tar.xz" -C /tmp/lily-device && dir=/tmp/lily-device/d
fi
out=${OUT:-gpu_suite_out}
suite=",${SUITE:-tests},"
model=${MODEL:-/tmp/q35}
mkdir -p "$out"
status=0
# The test binaries to run: TESTS (space-separated names) or all of them.
test_bins() {
  if [ -n "${TESTS:-}" ]; then for n in $TESTS; do echo "$dir/tests/$n"; done; else ls -d "$dir"/tests/*; fi
}
summary=()

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader | tee "$out/nvidia-smi.txt"

if [[ $suite == *,tests,* ]]; then
  test_env=(); [ -z "${TEST_ENV:-}" ] || IFS=, read -ra test_env <<<"$TEST_ENV"
  for t in $(test_bins); do
    name=$(basename "$t")
    env "${test_env[@]}" "$t" --test-threads=1 --nocapture >"$out/$name.log" 2>&1
    rc=$?
    res=$(grep -E "^test result" "$out/$name.log" | tail -1)
    echo "tests $name: rc $rc, $res"
    summary+=("tests $name | $( [ $rc = 0 ] && echo pass || echo FAIL ) | ${res#test result: }")
    if [ $rc != 0 ]; then status=1; grep -E "panicked|FAILED|assert" "$out/$name.log" | head -20; fi
  done
  grep -hE "rel err|ppl|worst|argmax|vs one call" "$out"/*.log | head -60
fi

if [[ $suite == *,opbench,* ]]; then
  for t in $(test_bins); do
    "$t" --ignored --nocapture --test-threads=1 bench 2>&1 | grep -vE "^(running|test |$)" | tee -a "$out/opbench.log"
  done
fi

if [[ $suite == *,parity,* || $suite == *,bench,* || $suite == *,ab,* || $suite == *,scoreab,* ]] && [ ! -f "$model/config.json" ]; then
  t0=$(date +%s)
  "$dir/lily" synth --config qwen3.6-35b-a3b --out "$model" 2>&1 | tail -2
  echo "synth: $(( $(date +%s) - t0 )) s"
fi

if [[ $suite == *,parity,* ]]; then
  python3 -c 'import json, random; r = random.Random(7); print(json.dumps([r.randrange(248077) for _ in range(193)]))' >"$out/tokens.json"
  if "$dir/lily" score --backend cuda --model "$model" --tokens "$out/tokens.json" >"$out/lily_score.json" 2>"$out/lily_score.err"; then
    echo "lily score (cuda): ppl $(python3 -c "import json; print(json.load(open('$out/lily_score.json'))['perplexity'])")"
  else
    status=1; cat "$out/lily_score.err"
  fi
  if python3 -c "import mlx_lm" 2>/dev/null; then
    t0=$(date +%s)
    if timeout "${MLX_TIMEOUT:-480}" python3 -u tools/mlx_score.py --device "${MLX_DEVICE:-gpu}" --model "$model" \
        --tokens "$out/tokens.json" >"$out/mlx_score.json" 2>"$out/mlx_score.err"; then
      echo "mlx score (${MLX_DEVICE:-gpu}, $(( $(date +%s) - t0 )) s): ppl $(python3 -c "import json; print(json.load(open('$out/mlx_score.json'))['perplexity'])")"
      line=$(python3 tools/compare_scores.py "$out/lily_score.json" "$out/mlx_score.json"); rc=$?
      echo "parity vs MLX-LM: $line"
      summary+=("parity vs MLX-LM | $( [ $rc = 0 ] && echo pass || echo FAIL ) | $line")
      [ $rc = 0 ] || status=1
    else
      status=1; echo "mlx score failed after $(( $(date +%s) - t0 )) s:"; tail -5 "$out/mlx_score.err"
    fi
  else
    echo "parity: mlx_lm is not installed here; lily's score is in $out/lily_score.json"
  fi
fi

if [[ $suite == *,cpuref,* ]]; then
  # The CPU backend (held to MLX-LM and transformers on the fixtures) as the full-size reference.
  t0=$(date +%s)
  if "$dir/lily" score --backend cpu --model "$model" --tokens "$out/tokens.json" >"$out/cpu_score.json" 2>"$out/cpu_score.err"; then
    line=$(python3 tools/compare_scores.py "$out/lily_score.json" "$out/cpu_score.json"); rc=$?
    echo "parity vs lily CPU ($(( $(date +%s) - t0 )) s): $line"
    summary+=("parity vs lily CPU | $( [ $rc = 0 ] && echo pass || echo FAIL ) | $line")
    [ $rc = 0 ] || status=1
  else
    status=1; tail -5 "$out/cpu_score.err"
  fi
fi

if [[ $suite == *,bench,* ]]; then
  "$dir/lily" bench --backend cuda --model "$model" --lengths "${LENGTHS:-256,512,1K,2K,4K,8K,16K,32K,64K,128K}" \
    --decode-tokens 64 --repeats "${REPEATS:-3}" --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  grep -E "^\|" "$out/bench.log" >"$out/bench.md"
fi

if [[ $suite == *,ab,* ]]; then
  envs=(${AB_ENVS:--})
  for r in $(seq 1 "${ROUNDS:-2}"); do
    for i in "${!envs[@]}"; do
      e=${envs[$i]}
      assigns=(); [ "$e" = - ] || IFS=, read -ra assigns <<<"$e"
      env "${assigns[@]}" "$dir/lily" bench --backend cuda --model "$model" --lengths "${AB_LENGTHS:-4K,32K}" \
        --decode-tokens "${AB_DECODE_TOKENS:-8}" --repeats 1 >"$out/ab_${i}_$r.log" 2>&1 || status=1
    done
  done
  echo "| environment | $(for r in $(seq 1 "${ROUNDS:-2}"); do echo -n "round $r (length: prefill / decode tok/s) | "; done)"
  for i in "${!envs[@]}"; do
    row="| ${envs[$i]} |"
    for r in $(seq 1 "${ROUNDS:-2}"); do
      row+=" $(grep -E '^\| [0-9]' "$out/ab_${i}_$r.log" | awk -F'|' '{gsub(/ /, ""); printf "%s: %s / %s; ", $2, $3, $4}') |"
    done
    echo "$row"
  done | tee "$out/ab.md"
fi

if [[ $suite == *,scoreab,* ]]; then
  python3 -c "import json, random; r = random.Random(13); print(json.dumps([r.randrange(248077) for _ in range(${SCORE_IDS:-1024})]))" >"$out/score_tokens.json"
  envs=(${SCORE_ENVS:--})
  chunk=(); [ -z "${SCORE_CHUNK:-}" ] || chunk=(--chunk "$SCORE_CHUNK")
  for i in "${!envs[@]}"; do
    e=${envs[$i]}
    assigns=(); [ "$e" = - ] || IFS=, read -ra assigns <<<"$e"
    if ! env "${assigns[@]}" "$dir/lily" score --backend cuda --model "$model" --tokens "$out/score_tokens.json" "${chunk[@]}" \
        >"$out/score_$i.json" 2>"$out/score_$i.err"; then
      status=1; echo "score [$e] failed:"; tail -3 "$out/score_$i.err"; continue
    fi
    if [ "$i" != 0 ]; then
      line=$(python3 tools/compare_scores.py "$out/score_$i.json" "$out/score_0.json"); rc=$?
      echo "score [$e] vs [${envs[0]}]: $line"
      summary+=("score [$e] vs [${envs[0]}] | $( [ $rc = 0 ] && echo pass || echo FAIL ) | $line")
      [ $rc = 0 ] || status=1
    fi
  done
fi

if [[ $suite == *,side,* ]]; then
  side=${SIDE_LENGTHS:-256,1024,4096}
  for r in $(seq 1 "${ROUNDS:-2}"); do
    mkdir -p "$out/side$r"
    t0=$(date +%s)
    OUT="$out/side$r" MODEL_DIR="$model" BUDGET_S="${MLX_TIMEOUT:-480}" timeout "$(( ${MLX_TIMEOUT:-480} + 60 ))" \
      python3 -u "${MLX_BASELINE:-tools/mlx_baseline.py}" ${side//,/ } >"$out/side$r/mlx.log" 2>&1
    echo "round $r mlx-lm: rc $?, $(( $(date +%s) - t0 )) s"; grep -E '^\{' "$out/side$r/mlx.log"
    t0=$(date +%s)
    "$dir/lily" bench --backend cuda --model "$model" --lengths "$side" --decode-tokens 64 --repeats "${REPEATS:-3}" \
      --json "$out/side$r/lily.json" >"$out/side$r/lily.log" 2>&1
    echo "round $r lily: rc $?, $(( $(date +%s) - t0 )) s"; grep -E '^\|' "$out/side$r/lily.log"
  done
  python3 tools/side_table.py "$out"/side* | tee "$out/side.md"
fi

# Few files come back from the device tool: pack the logs into one archive.
(cd "$out" && tar czf logs.tar.gz --remove-files *.log *.err side* 2>/dev/null)
echo "== summary"
for s in "${summary[@]}"; do echo "| $s |"; done
[ -f "$out/bench.md" ] && cat "$out/bench.md"
exit $status
