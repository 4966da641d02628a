#!/usr/bin/env bash
# Post-training on a tiny model, end to end (docs/rl.md): make a Hugging Face Llama with a chat tokenizer, convert
# it, teach it "a+b=" sums by SFT, prefer right sums by DPO, improve it with GRPO and the exact-answer reward,
# decode a sum with the result and export it back to Hugging Face. Asserts on each stage's metrics file.
#   bash end_to_end/cpu/post_train.sh [OUTPUT_DIR]
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-$(mktemp -d)}"
python3 end_to_end/cpu/make_tiny_chat_model.py "$OUT"
python3 -m MaxText.convert.hf_to_maxtext --hf_path "$OUT/hf" --output "$OUT/converted"
# The data: every single-digit sum as a chat (SFT) and as a prompt the chat template renders (GRPO).
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
sums = [(a, b) for a in range(10) for b in range(10)]
with open(f"{out}/sums_chat.jsonl", "w") as f:
  for a, b in sums:
    turns = [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]
    f.write(json.dumps({"messages": turns}) + "\n")
with open(f"{out}/sums_prompts.jsonl", "w") as f:
  for a, b in sums:  # the ChatML template of make_tiny_chat_model.py, with the generation prompt
    f.write(json.dumps({"prompt": f"<|im_start|>user\n{a}+{b}=<|im_end|>\n<|im_start|>assistant\n"}) + "\n")
PY
TOK="tokenizer_path=$OUT/converted/tokenizer.json"
python3 MaxText/train.py cpu/sft base_output_directory="$OUT" log_config=false steps=150 checkpoint_period=150 \
  load_parameters_path="$OUT/converted/params" "$TOK" dataset_path="$OUT/sums_chat.jsonl"
python3 end_to_end/assert_metrics.py "$OUT/sft/metrics.jsonl" --steps 150 --max_final_loss 1.0 --keys loss
POLICY="$OUT/sft/checkpoints/150/state"
# DPO (docs/dpo.md): preference-tune the SFT model on "a+b=" pairs (chosen: the sum, rejected: a wrong digit);
# its first loss is ln 2 (the policy starts as the reference). GRPO then starts from the DPO model.
python3 end_to_end/cpu/make_prefs.py "$OUT/sums_prefs.jsonl" 9
python3 MaxText/train.py cpu/dpo base_output_directory="$OUT" log_config=false load_parameters_path="$POLICY" "$TOK" \
  dataset_path="$OUT/sums_prefs.jsonl" steps=20 checkpoint_period=20 eval_interval=20 log_period=10 learning_rate=1e-3
python3 end_to_end/assert_metrics.py "$OUT/dpo/metrics.jsonl" --steps 20 --keys loss,dpo_accuracy,dpo_reward_margin
POLICY="$OUT/dpo/checkpoints/20/state"
python3 -m MaxText.rl "$OUT/converted/config.yml" run_name=grpo base_output_directory="$OUT" log_config=false \
  load_parameters_path="$POLICY" "$TOK" dataset_path="$OUT/sums_prompts.jsonl" rl_reward=arithmetic add_bos=false \
  steps=10 per_device_batch_size=8 num_generations=4 learning_rate=1e-4 max_target_length=64 \
  max_prefill_predict_length=32 decode_max_new_tokens=4 decode_sampling_strategy=weighted
python3 end_to_end/assert_metrics.py "$OUT/grpo/metrics.jsonl" --steps 10 --keys loss,reward_mean,kl,clip_fraction
python3 MaxText/decode.py "$OUT/converted/config.yml" load_parameters_path="$OUT/grpo/checkpoints/10/state" \
  prompt=$'<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n' add_bos=false \
  max_prefill_predict_length=32 max_target_length=64 decode_max_new_tokens=4 | tee "$OUT/decode.log"
grep -Eq "Output: '[0-9]+' " "$OUT/decode.log"  # a number (the right one is 7, not asserted: a 140K model)
python3 -m MaxText.convert.maxtext_to_hf "$OUT/converted/config.yml" \
  load_parameters_path="$OUT/grpo/checkpoints/10/state" --output "$OUT/hf_grpo"
test -f "$OUT/hf_grpo/config.json"
echo "OK post_train: converted, SFT, DPO, GRPO, decoded and exported"
