#!/usr/bin/env bash
# Elastic resume on CPU (docs/checkpoints.md, "Resuming on a different number of chips"): a tiny run checkpointed
# on 8 devices resumes on 4 and then on 8 again, and a 2-process job (jax.distributed on 127.0.0.1, 4 devices
# each) resumes as one process of 4 devices and then as two again. Each run's per-step losses are compared with
# an uninterrupted 12-step run on 8 devices with the same global batch (16); prints the largest relative
# difference and fails above 1e-5.
#   bash end_to_end/cpu/elastic.sh [OUTPUT_DIR]
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-$(mktemp -d)}"
mkdir -p "$OUT"
COMMON=(MaxText/configs/base.yml "base_output_directory=$OUT" hardware=cpu dataset_type=synthetic log_config=false
  base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 base_mlp_dim=128 base_num_decoder_layers=2 head_dim=16
  vocab_size=256 max_target_length=32 dtype=float32 learning_rate=1e-2 warmup_steps_fraction=0
  learning_rate_schedule_steps=12 per_device_batch_size=2 checkpoint_period=4 async_checkpointing=false
  enable_tensorboard=false log_period=1)

train() {  # DEVICES key=value ...: one process
  local devices=$1
  shift
  XLA_FLAGS="--xla_force_host_platform_device_count=$devices" JAX_PLATFORMS=cpu \
    python3 MaxText/train.py "${COMMON[@]}" "$@"
}

two_processes() {  # key=value ...: two processes of 4 devices; process 0's output on stdout
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  JAX_COORDINATOR_ADDRESS=127.0.0.1 JAX_COORDINATOR_PORT=$port NNODES=2 NODE_RANK=1 train 4 "$@" >"$OUT/rank1.log" 2>&1 &
  local other=$!
  JAX_COORDINATOR_ADDRESS=127.0.0.1 JAX_COORDINATOR_PORT=$port NNODES=2 NODE_RANK=0 train 4 "$@"
  wait "$other" || { tail -20 "$OUT/rank1.log"; exit 1; }
}

train 8 run_name=whole steps=12 >"$OUT/whole.log"
train 8 run_name=devices steps=4 >"$OUT/devices.log"
train 4 run_name=devices steps=8 | tee -a "$OUT/devices.log" | grep "resuming on"
train 8 run_name=devices steps=12 | tee -a "$OUT/devices.log" | grep "resuming on"
two_processes run_name=processes steps=4 >"$OUT/processes.log"
train 4 run_name=processes steps=8 | tee -a "$OUT/processes.log" | grep "resuming on"
two_processes run_name=processes steps=12 | tee -a "$OUT/processes.log" | grep "resuming on"

python3 - "$OUT" <<'PY'
import json, sys
losses = lambda name: {r["step"]: r["loss"] for r in map(json.loads, open(f"{sys.argv[1]}/{name}/metrics.jsonl"))}
whole = losses("whole")
for name in ("devices", "processes"):
  got = losses(name)
  assert sorted(got) == sorted(whole) == list(range(1, 13)), (name, sorted(got))
  worst = max(abs(got[s] - whole[s]) / abs(whole[s]) for s in whole)
  print(f"{name}: 12 steps, largest relative loss difference to the uninterrupted run {worst:.1e}")
  assert worst <= 1e-5, name
PY
