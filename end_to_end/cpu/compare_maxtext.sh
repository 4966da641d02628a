#!/usr/bin/env bash
# Tokens/s of our train.py against upstream MaxText's on the quick-start model (synthetic data, CPU),
# in interleaved pairs (ours, MaxText, ours, ...) so load from other jobs on a shared host falls on
# both alike; prints each run's median step time over its steady-state steps, then the medians.
#   MAXTEXT_PY=/path/to/venv/bin/python bash end_to_end/cpu/compare_maxtext.sh [PAIRS] [STEPS] [key=value ...]
# Run it with this repository's venv active (source .venv/bin/activate). MAXTEXT_PY: a Python with the
# `maxtext` package (0.2.5 tested, in its own Python 3.12 venv). Extra key=value (e.g. dtype=float32
# remat_policy=none) go to both runs. The first SKIP steps (compilation, warm-up) are not counted.
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/../.."
PAIRS="${1:-3}"
STEPS="${2:-15}"
shift $(($# < 2 ? $# : 2))
SKIP=3
MAXTEXT_PY="${MAXTEXT_PY:?set MAXTEXT_PY to a python with the maxtext package}"
MT_BASE="$("$MAXTEXT_PY" -c 'import maxtext, os; print(os.path.dirname(maxtext.__file__))')/configs/base.yml"
OUT="$(mktemp -d)"
MODEL=(base_emb_dim=256 base_num_query_heads=4 base_num_kv_heads=2 base_mlp_dim=768 base_num_decoder_layers=4
  head_dim=64 vocab_size=4096 max_target_length=256 per_device_batch_size=8 dataset_type=synthetic
  enable_checkpointing=false steps="$STEPS" dtype=bfloat16 remat_policy=full)

median_ours() {  # step_time_s of every logged step past SKIP in a metrics.jsonl
  python3 -c 'import json, statistics, sys
t = [r["step_time_s"] for r in map(json.loads, open(sys.argv[1])) if "loss" in r and r["step"] >= int(sys.argv[2])]
print(statistics.median(t))' "$1" "$SKIP"
}
median_maxtext() {  # MaxText logs "completed step: N, seconds: S, ..." per step
  python3 -c 'import re, statistics, sys
t = [float(s) for n, s in re.findall(r"completed step: (\d+), seconds: ([\d.]+)", open(sys.argv[1]).read())
     if int(n) >= int(sys.argv[2])]
print(statistics.median(t))' "$1" "$SKIP"
}

ours=() theirs=()
for i in $(seq "$PAIRS"); do
  python3 MaxText/train.py MaxText/configs/base.yml run_name="ours$i" base_output_directory="$OUT" \
    log_config=false log_period=1 eval_interval=-1 "${MODEL[@]}" "$@" > "$OUT/ours$i.log" 2>&1
  ours+=("$(median_ours "$OUT/ours$i/metrics.jsonl")")
  JAX_PLATFORMS=cpu "$MAXTEXT_PY" -m maxtext.trainers.pre_train.train "$MT_BASE" run_name="mt$i" \
    base_output_directory="$OUT" hardware=cpu skip_jax_distributed_system=true "${MODEL[@]}" "$@" \
    > "$OUT/mt$i.log" 2>&1
  theirs+=("$(median_maxtext "$OUT/mt$i.log")")
  echo "pair $i: ours ${ours[-1]} s/step, MaxText ${theirs[-1]} s/step"
done
python3 - "$STEPS" "${ours[*]}" "${theirs[*]}" <<'PY'
import statistics, sys
tokens = 8 * 256
a = statistics.median(map(float, sys.argv[2].split()))
b = statistics.median(map(float, sys.argv[3].split()))
print(f"median step: ours {a:.3f} s ({tokens / a:,.0f} tokens/s), MaxText {b:.3f} s ({tokens / b:,.0f} tokens/s)")
print(f"ours / MaxText tokens/s: {b / a:.2f}x")
PY
echo "logs in $OUT"
