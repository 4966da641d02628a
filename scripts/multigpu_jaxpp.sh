#!/usr/bin/env bash
# The launcher lines of the JaxPP fork of MaxText (NVIDIA/maxtext-jaxpp), run here as written:
#   bash scripts/multigpu_jaxpp.sh --max_target_length=64 --model=default --dp=1 --pp=2 --mp=1 \
#     --batch_size_per_device=1 --num_pipeline_microbatches=2 jaxpp_remote=false base_emb_dim=1024 ... decoder_block=llama2
# The flags go to end_to_end/gpu/pipeline.sh: --dp/--pp/--mp -> ici_data/pipeline/tensor_parallelism (within a
# node; other nodes are data parallel), --batch_size_per_device -> per_device_batch_size,
# --num_pipeline_microbatches, --max_target_length, --model -> model_name. Every key=value word passes through.
# jaxpp_remote is ignored with a note: the pipeline here is one SPMD program over the `stage` mesh axis
# (docs/pipeline_parallelism.md), not JaxPP's MPMD runtime with remote workers, so it has nothing to choose.
# As the fork's script does, the run trains 30 steps on synthetic tokens without checkpoints; key=value words
# (steps=..., dataset_type=..., enable_checkpointing=true) override that. Run it on every node as launch.sh says;
# DRY_RUN=1 prints the train.py arguments instead of running.
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
words=()
for arg in "$@"; do
  case "$arg" in
    jaxpp_remote=*) echo "multigpu_jaxpp.sh: note: $arg ignored (the pipeline here is one SPMD program, no JaxPP remote workers)" >&2 ;;
    *) words+=("$arg") ;;
  esac
done
exec bash "$(dirname "$0")/../end_to_end/gpu/pipeline.sh" dataset_type=synthetic steps=30 enable_checkpointing=false \
  "${words[@]}"
