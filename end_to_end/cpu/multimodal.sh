#!/usr/bin/env bash
# The docs/multimodal.md walk-through on a tiny model: make a random Hugging Face Gemma3ForConditionalGeneration
# (SigLIP tower + Gemma 3 text model) with a chat tokenizer, three solid-colour PNGs and a chat .jsonl asking for
# their colour; convert it, fine-tune it with the vision tower trained (use_sft, loss on the replies only), decode
# with image_path, and export it back to Hugging Face. Asserts the loss falls and the colours are named. Needs only
# `bash setup.sh` (the export is also loaded with transformers where torch and transformers are: TORCH=1).
#   bash end_to_end/cpu/multimodal.sh [OUTPUT_DIR]
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-$(mktemp -d)}"
python3 end_to_end/cpu/make_tiny_vision_model.py "$OUT"
python3 -m MaxText.convert.hf_to_maxtext --hf_path "$OUT/hf" --output "$OUT/converted"
python3 MaxText/train.py "$OUT/converted/config.yml" run_name=mm base_output_directory="$OUT" log_config=false \
  load_parameters_path="$OUT/converted/params" use_sft=true dataset_type=text dataset_path="$OUT/chat.jsonl" \
  eval_fraction=0 max_target_length=48 per_device_batch_size=4 steps=150 learning_rate=3e-3 \
  freeze_vision_encoder=false checkpoint_period=150
python3 end_to_end/assert_metrics.py "$OUT/mm/metrics.jsonl" --steps 150 --max_final_loss 0.1 --keys loss
# <start_of_image> where the image goes, in the chat template's prompt; `read -d ''` keeps its final newline
IFS= read -r -d '' PROMPT < <(python3 -m MaxText.data.chat_prompt "$OUT/converted" "<start_of_image>What colour is this?") || true
for colour in red green blue; do
  python3 MaxText/decode.py "$OUT/converted/config.yml" load_parameters_path="$OUT/mm/checkpoints/150/state" \
    image_path="$OUT/$colour.png" prompt="$PROMPT" add_bos=false max_prefill_predict_length=40 max_target_length=56 \
    | tee "$OUT/decode_$colour.log"
  grep -qi "Output: '$colour.'" "$OUT/decode_$colour.log"
done
python3 -m MaxText.convert.maxtext_to_hf "$OUT/converted/config.yml" \
  load_parameters_path="$OUT/mm/checkpoints/150/state" --output "$OUT/hf_mm"
# Without torch: the export holds the tensors of the Hugging Face model it came from, by name, shape and dtype.
python3 end_to_end/cpu/same_tensors.py "$OUT/hf" "$OUT/hf_mm"
if python3 -c "import torch, transformers" 2>/dev/null; then
  python3 -c "import sys, transformers; transformers.Gemma3ForConditionalGeneration.from_pretrained(sys.argv[1])" "$OUT/hf_mm"
fi
echo "OK multimodal: converted, fine-tuned with images, decoded with image_path and exported"
