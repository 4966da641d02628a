#!/usr/bin/env bash
# The docs/sft.md walk-through on a tiny model: make a Hugging Face Llama with a chat tokenizer and a chat .jsonl,
# convert it, fine-tune it (cpu/sft recipe: loss on the assistant turns only), decode a question, export it back
# to Hugging Face and generate with transformers. Asserts the loss falls near 0 and both generate the answer.
# Needs only `bash setup.sh`; the transformers step runs where torch and transformers are (TORCH=1 bash setup.sh).
#   bash end_to_end/cpu/sft.sh [OUTPUT_DIR]
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-$(mktemp -d)}"
python3 end_to_end/cpu/make_tiny_chat_model.py "$OUT"
python3 -m MaxText.convert.hf_to_maxtext --hf_path "$OUT/hf" --output "$OUT/converted"
python3 MaxText/train.py cpu/sft base_output_directory="$OUT" log_config=false \
  load_parameters_path="$OUT/converted/params" tokenizer_path="$OUT/converted/tokenizer.json" \
  dataset_path="$OUT/chat.jsonl"
python3 end_to_end/assert_metrics.py "$OUT/sft/metrics.jsonl" --steps 200 --max_final_loss 0.05 --keys loss
# The prompt as the chat template renders it; `read -d ''` keeps its final newline, which $(...) would drop.
IFS= read -r -d '' PROMPT < <(python3 -m MaxText.data.chat_prompt "$OUT/converted" "What is the capital of Japan?") || true
python3 MaxText/decode.py "$OUT/converted/config.yml" load_parameters_path="$OUT/sft/checkpoints/200/state" \
  prompt="$PROMPT" add_bos=false max_prefill_predict_length=32 max_target_length=64 | tee "$OUT/decode.log"
grep -q "Output: 'Tokyo.'" "$OUT/decode.log"
python3 -m MaxText.convert.maxtext_to_hf "$OUT/converted/config.yml" \
  load_parameters_path="$OUT/sft/checkpoints/200/state" --output "$OUT/hf_sft"
cp "$OUT"/converted/tokenizer*.json "$OUT/hf_sft/"  # the export writes weights and config.json only
# Without torch: the export holds the tensors of the Hugging Face model it came from, by name, shape and dtype.
python3 end_to_end/cpu/same_tensors.py "$OUT/hf" "$OUT/hf_sft"
if ! python3 -c "import torch, transformers" 2>/dev/null; then
  echo "transformers: generation skipped (no torch and transformers here: TORCH=1 bash setup.sh installs them)"
  echo "OK sft: converted, fine-tuned, decoded and exported"
  exit 0
fi
python3 - "$OUT/hf_sft" <<'PY' | tee "$OUT/hf_generate.log"
import sys

import transformers

tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
chat = [{"role": "user", "content": "What is the capital of Peru?"}]
ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**ids, max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id)
print("transformers:", tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
PY
grep -q "transformers: Lima." "$OUT/hf_generate.log"
echo "OK sft: converted, fine-tuned, decoded and exported"
