#!/usr/bin/env bash
# Smoke run of train.py on synthetic data, then assertions on its metrics file.
#   bash end_to_end/cpu/smoke.sh [OUTPUT_DIR]
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-$(mktemp -d)}"
python3 MaxText/train.py MaxText/configs/base.yml run_name=smoke base_output_directory="$OUT" \
  dataset_type=synthetic steps=20 base_emb_dim=256 base_num_query_heads=4 base_num_kv_heads=2 \
  base_mlp_dim=512 base_num_decoder_layers=2 head_dim=64 vocab_size=32000 max_target_length=128 \
  per_device_batch_size=2 enable_checkpointing=false log_config=false | tee "$OUT/smoke.log"
grep -q "MFU" "$OUT/smoke.log"
python3 end_to_end/assert_metrics.py "$OUT/smoke/metrics.jsonl" --steps 20 --keys loss,perplexity,mfu,tokens_per_s_per_device,eta_s
