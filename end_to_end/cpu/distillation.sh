#!/usr/bin/env bash
# The docs/distillation.md walk-through on one CPU device, on the default text data (the Python standard library's
# sources, its tokenizer trained by the first run): train a small teacher, distil a 4x smaller student from it online
# (objective=distill) and offline (the teacher's stored top-k logits), train the same student from scratch at equal
# steps on the same data, and assert that both distilled students' held-out loss is below the scratch student's and
# that their KL to the teacher falls.
#   bash end_to_end/cpu/distillation.sh [OUTPUT_DIR]
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-$(mktemp -d)}"
export XLA_FLAGS="--xla_force_host_platform_device_count=1"  # one device: the same batches wherever it runs
COMMON=(base_output_directory="$OUT" log_config=false dataset_type=text vocab_size=1024 max_target_length=128
  per_device_batch_size=8 dtype=float32 learning_rate=3e-3 warmup_steps_fraction=0.05 log_period=20
  eval_steps=8 enable_tensorboard=false)
TEACHER=(base_emb_dim=128 base_num_query_heads=4 base_num_kv_heads=2 base_mlp_dim=512 base_num_decoder_layers=4
  head_dim=32)
STUDENT=(base_emb_dim=64 base_num_query_heads=2 base_num_kv_heads=1 base_mlp_dim=256 base_num_decoder_layers=3
  head_dim=32 steps=100 eval_interval=50 enable_checkpointing=false)

# 1. The teacher: 4x the student's parameters, trained 3x longer; its tokenizer serves every run.
python3 MaxText/train.py MaxText/configs/base.yml run_name=teacher "${COMMON[@]}" "${TEACHER[@]}" steps=300 \
  eval_interval=300 checkpoint_period=300
TOKENIZER=(tokenizer_path="$OUT/teacher/tokenizer/tokenizer.model")
# A run caches the tokenized corpus beside its tokenizer, in <run dir>/tokenizer; each later run reads the teacher's
# (same tokenizer, same files), so the corpus is tokenized once rather than five times.
for run in online topk offline scratch; do mkdir -p "$OUT/$run" && ln -sfn ../teacher/tokenizer "$OUT/$run/tokenizer"; done
# 2. The student distilled online: the teacher's config is its run's config.yml, its params the last checkpoint.
ONLINE=(objective=distill teacher_config="$OUT/teacher/config.yml"
  teacher_load_parameters_path="$OUT/teacher/checkpoints/300/state")
python3 MaxText/train.py MaxText/configs/base.yml run_name=online "${COMMON[@]}" "${STUDENT[@]}" "${TOKENIZER[@]}" \
  "${ONLINE[@]}" distill_alpha=0.5
# 3. Offline: the teacher's top-64 logits over the same 100 train batches (and 8 eval batches), stored once; then the
# same student trained on them, no teacher in memory.
python3 -m MaxText.distill_topk MaxText/configs/base.yml run_name=topk "${COMMON[@]}" "${STUDENT[@]}" "${TOKENIZER[@]}" \
  "${ONLINE[@]}" distill_topk_path="$OUT/topk" distill_topk_k=64
python3 MaxText/train.py MaxText/configs/base.yml run_name=offline "${COMMON[@]}" "${STUDENT[@]}" "${TOKENIZER[@]}" \
  objective=distill distill_topk_path="$OUT/topk" distill_alpha=0.5
# 4. The same student from scratch, same data, same steps.
python3 MaxText/train.py MaxText/configs/base.yml run_name=scratch "${COMMON[@]}" "${STUDENT[@]}" "${TOKENIZER[@]}"

python3 - "$OUT" <<'PY'
import json
import sys

def read(run):
  return [json.loads(line) for line in open(f"{sys.argv[1]}/{run}/metrics.jsonl")]

def last_eval(records):
  return [r for r in records if "eval_loss" in r][-1]["eval_loss"]

runs = {run: read(run) for run in ("teacher", "online", "offline", "scratch")}
print("held-out loss: " + ", ".join(f"{run} {last_eval(records):.3f}" for run, records in runs.items()))
for run in ("online", "offline"):
  kl = [r["distill_kl"] for r in runs[run] if "distill_kl" in r]
  print(f"{run}: KL to the teacher {kl[0]:.3f} -> {kl[-1]:.3f} (train batches, first and last logged step)")
  assert last_eval(runs[run]) < last_eval(runs["scratch"]), f"the {run} student is not better than the scratch one"
  assert kl[-1] < 0.5 * kl[0], f"the {run} student's KL to the teacher did not fall"
PY
echo "OK distillation: the online and offline students beat the scratch student at equal steps"
