#!/usr/bin/env bash
# The docs/dpo.md walk-through on a tiny model: make a Hugging Face Llama with a chat tokenizer, convert it, write
# "a+b=" preference pairs (chosen: the sum; rejected: another digit) and train with DPO (cpu/dpo recipe). Asserts
# the first loss is ln 2, the loss falls, and the held-out pairs' accuracy ends above 0.8.
#   bash end_to_end/cpu/dpo.sh [OUTPUT_DIR]
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-$(mktemp -d)}"
python3 end_to_end/cpu/make_tiny_chat_model.py "$OUT"
python3 -m MaxText.convert.hf_to_maxtext --hf_path "$OUT/hf" --output "$OUT/converted"
python3 end_to_end/cpu/make_prefs.py "$OUT/prefs.jsonl"
python3 MaxText/train.py cpu/dpo base_output_directory="$OUT" log_config=false \
  load_parameters_path="$OUT/converted/params" tokenizer_path="$OUT/converted/tokenizer.json" \
  dataset_path="$OUT/prefs.jsonl"
python3 end_to_end/assert_metrics.py "$OUT/dpo/metrics.jsonl" --steps 200 --max_final_loss 0.2 --keys loss
python3 - "$OUT/dpo/metrics.jsonl" <<'PY'
import json
import math
import sys

records = [json.loads(line) for line in open(sys.argv[1])]
first = next(r for r in records if r.get("step") == 1 and "loss" in r)
held = [r for r in records if "eval_dpo_accuracy" in r][-1]
assert abs(first["loss"] - math.log(2)) < 1e-5, first["loss"]
assert held["eval_dpo_accuracy"] > 0.8, held
print(f"first loss {first['loss']:.6f} (ln 2), held-out accuracy {held['eval_dpo_accuracy']:.3f}")
PY
echo "OK dpo: converted, preference-tuned, held-out pairs preferred"
