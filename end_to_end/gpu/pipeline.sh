#!/usr/bin/env bash
# Train with pipeline parallelism on GPU nodes: the parallelism as flags, everything else as key=value.
#   bash end_to_end/gpu/pipeline.sh --dp 2 --pp 4 --mp 1 --batch_size_per_device 4 \
#     --num_pipeline_microbatches 8 [--dcn_pp 2] [--config MaxText/configs/base.yml] run_name=pp [key=value ...]
# --dp/--pp/--mp: data, pipeline (stage) and tensor parallelism within a node (their product: the GPUs of a
# node); --dcn_pp: pipeline stages across nodes (the other nodes are data parallel). Runs through
# launch.sh, so run it on every node with launch.sh's variables (NNODES, NODE_RANK, JAX_COORDINATOR_ADDRESS).
# DRY_RUN=1 prints the train.py arguments instead of running.
set -euo pipefail
cd "$(dirname "$0")/../.."
dp=1 pp=1 mp=1 dcn_pp=1 batch=1 micro=-1 config=MaxText/configs/base.yml
overrides=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dp) dp="$2"; shift 2 ;;
    --pp) pp="$2"; shift 2 ;;
    --mp) mp="$2"; shift 2 ;;
    --dcn_pp) dcn_pp="$2"; shift 2 ;;
    --batch_size_per_device) batch="$2"; shift 2 ;;
    --num_pipeline_microbatches) micro="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --*) echo "pipeline.sh: unknown flag $1 (flags: --dp --pp --mp --dcn_pp --batch_size_per_device --num_pipeline_microbatches --config)" >&2; exit 2 ;;
    *) overrides+=("$1"); shift ;;
  esac
done
args=("$config" "ici_data_parallelism=$dp" "ici_pipeline_parallelism=$pp" "ici_tensor_parallelism=$mp"
  "ici_fsdp_parallelism=1" "dcn_pipeline_parallelism=$dcn_pp" "dcn_data_parallelism=-1"
  "per_device_batch_size=$batch" "num_pipeline_microbatches=$micro" "${overrides[@]}")
if [ -n "${DRY_RUN:-}" ]; then
  echo "${args[@]}"
  exit 0
fi
exec bash end_to_end/gpu/launch.sh "${args[@]}"
