#!/usr/bin/env bash
# Train with pipeline parallelism on GPU nodes: the parallelism as flags, everything else as key=value.
#   bash end_to_end/gpu/pipeline.sh --dp 2 --pp 4 --mp 1 --batch_size_per_device 4 \
#     --num_pipeline_microbatches 8 [--dcn_pp 2] [--config MaxText/configs/base.yml] run_name=pp [key=value ...]
# --dp/--pp/--mp: data, pipeline (stage) and tensor parallelism within a node (their product: the GPUs of a
# node); --dcn_pp: pipeline stages across nodes (the other nodes are data parallel). --max_target_length and
# --model (model_name) are accepted too, and every flag also as --flag=value (the JaxPP fork's form, see
# scripts/multigpu_jaxpp.sh). A key=value word after the flags wins over them. Runs through launch.sh, so run
# it on every node with launch.sh's variables (NNODES, NODE_RANK, JAX_COORDINATOR_ADDRESS).
# DRY_RUN=1 prints the train.py arguments instead of running.
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/../.."
dp=1 pp=1 mp=1 dcn_pp=1 batch=1 micro=-1 config=MaxText/configs/base.yml
flagged=() overrides=()
FLAGS="--dp --pp --mp --dcn_pp --batch_size_per_device --num_pipeline_microbatches --max_target_length --model --config"
while [ $# -gt 0 ]; do
  case "$1" in
    --*=*) flag="${1%%=*}" value="${1#*=}"; shift ;;
    --*)
      [ $# -ge 2 ] || { echo "pipeline.sh: $1 needs a value" >&2; exit 2; }
      flag="$1" value="$2"; shift 2 ;;
    *) overrides+=("$1"); shift; continue ;;
  esac
  case "$flag" in
    --dp) dp="$value" ;;
    --pp) pp="$value" ;;
    --mp) mp="$value" ;;
    --dcn_pp) dcn_pp="$value" ;;
    --batch_size_per_device) batch="$value" ;;
    --num_pipeline_microbatches) micro="$value" ;;
    --max_target_length) flagged+=("max_target_length=$value") ;;
    --model) flagged+=("model_name=$value") ;;
    --config) config="$value" ;;
    *) echo "pipeline.sh: unknown flag $flag (flags: $FLAGS)" >&2; exit 2 ;;
  esac
done
args=("$config" "ici_data_parallelism=$dp" "ici_pipeline_parallelism=$pp" "ici_tensor_parallelism=$mp"
  "ici_fsdp_parallelism=1" "dcn_pipeline_parallelism=$dcn_pp" "dcn_data_parallelism=-1"
  "per_device_batch_size=$batch" "num_pipeline_microbatches=$micro" "${flagged[@]}" "${overrides[@]}")
if [ -n "${DRY_RUN:-}" ]; then
  echo "${args[@]}"
  exit 0
fi
exec bash end_to_end/gpu/launch.sh "${args[@]}"
