#!/usr/bin/env bash
# Smoke run of train.py on synthetic data (the cpu/smoke recipe), then assertions on its metrics file.
#   bash end_to_end/cpu/smoke.sh [OUTPUT_DIR]
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-$(mktemp -d)}"
python3 MaxText/train.py cpu/smoke base_output_directory="$OUT" log_config=false | tee "$OUT/smoke.log"
grep -q "MFU" "$OUT/smoke.log"
python3 end_to_end/assert_metrics.py "$OUT/smoke/metrics.jsonl" --steps 20 --keys loss,perplexity,mfu,tokens_per_s_per_device,eta_s
