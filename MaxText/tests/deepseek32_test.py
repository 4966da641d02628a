"""DeepSeek V3.2's lightning indexer in training (all slow): fsdp x expert and data x fsdp x tensor layouts
on 8 CPU devices give one device's loss and gradients, with the whole-sequence selection and in query blocks; a
converted tiny DeepseekV32 fine-tunes with LoRA on chat data."""

import os

import jax
import numpy as np
import pytest

from MaxText import config, train
from MaxText.tests.conftest import losses
from MaxText.tests.helpers import (
  DECODE_FAMILIES,
  DECODE_TINY,
  converted_lora_chat_sft,
  layout_loss_and_grads,
)

# Both layouts shard over fsdp too (2 devices): plain fsdp over 8 would add a compile and check nothing new.
LAYOUTS = [
  ["ici_fsdp_parallelism=2", "ici_expert_parallelism=4"],
  ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"],
]


# A tiny DeepSeek V3.2: the indexer keeps 3 of up to 16 keys.
TINY32 = [os.path.join(config.CONFIG_DIR, "base.yml"), *DECODE_TINY, *DECODE_FAMILIES["deepseek32"]]


# The query blocks are an attention branch: data x fsdp x tensor shards both of its axes (the batch, the index
# heads); fsdp x expert shards only the batch (the expert axis splits the MoE layer, not the indexer), which the
# whole-sequence case covers under both.
CHUNKS = {"attention_query_chunk=0": LAYOUTS, "attention_query_chunk=8": LAYOUTS[1:]}


@pytest.mark.slow  # one device, then 2 layouts (1 in query blocks) on 8
@pytest.mark.parametrize("chunk", sorted(CHUNKS))
def test_layouts_give_the_single_device_loss_and_gradients(chunk):
  want_loss, want_grads = layout_loss_and_grads(TINY32, chunk)
  for layout in CHUNKS[chunk]:
    got_loss, got_grads = layout_loss_and_grads(TINY32, chunk, *layout, devices=8)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, err_msg=str(layout))
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6, err_msg=str(layout))


@pytest.mark.nightly  # a converted checkpoint trains: conftest.NIGHTLY
@pytest.mark.slow
def test_lora_sft_on_the_converted_model_trains(tmp_path):
  """A converted tiny DeepSeek V3.2 (vocab widened to the chat tokenizer's; the indexer keeps 4 of up to 32 keys)
  fine-tunes with LoRA on chat data: the loss falls."""
  c = converted_lora_chat_sft("deepseek32", tmp_path)
  train.run(c, jax.devices()[:1])
  got = losses(c)
  assert len(got) == 4 and all(np.isfinite(got)) and got[-1] < got[0], got
