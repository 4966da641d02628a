#!/usr/bin/env bash
# The README quick-start training run, asserting that the loss falls by at least 30%.
#   bash end_to_end/cpu/quickstart.sh [OUTPUT_DIR]
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-$(mktemp -d)}"
python3 MaxText/train.py MaxText/configs/quickstart.yml base_output_directory="$OUT" log_config=false
python3 end_to_end/assert_metrics.py "$OUT/quickstart/metrics.jsonl" --steps 400 --min_loss_drop 0.3 --keys loss,mfu
