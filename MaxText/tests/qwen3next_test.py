"""Qwen3-Next against Hugging Face transformers (its pure-torch gated DeltaNet path on CPU, committed in
hf_references/qwen3-next): a tiny random model converted both ways (bit-exact back), float32 logits, 16 greedy
tokens for batched prompts of different lengths, decode with the recurrent state equal to full forward passes,
the chunked rule equal to the recurrence, training on the converted model, FLOPs of the preset (its parameter
count: presets_test)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import config, flops, train
from MaxText.convert import hf_to_maxtext
from MaxText.inference import Engine
from MaxText.layers import gated_deltanet
from MaxText.tests.helpers import PROMPTS, TOKENS, assert_export_is_exact, hf_model, maxtext_logits

# helpers.QWEN3NEXT, its committed reference "qwen3-next"; chunks of 4 so T = 12 spans three.
CHUNK = "linear_chunk_size=4"


def test_logits_match_hugging_face_and_round_trip_is_exact(tmp_path):
  reference, hf_path = hf_model("qwen3-next", tmp_path)
  tokens, ref = TOKENS, reference.logits
  scanned, unrolled = os.path.join(tmp_path, "scan"), os.path.join(tmp_path, "unrolled")
  hf_to_maxtext.convert(hf_path, scanned, scan_layers=True)
  hf_to_maxtext.convert(hf_path, unrolled, scan_layers=False)
  got = maxtext_logits(scanned, tokens, CHUNK)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  # One chunk of 64 and the unrolled layout give the same logits.
  np.testing.assert_allclose(maxtext_logits(unrolled, tokens), got, rtol=1e-5, atol=1e-5)

  back = os.path.join(tmp_path, "back")
  c = config.load([os.path.join(scanned, "config.yml"), "run_name=t", f"load_parameters_path={scanned}/params"], {})
  assert_export_is_exact(c, hf_path, back)  # hf_references_test reloads the export in transformers (torch tier)


@pytest.mark.slow  # 153 s at load average 16 on the 2 shared cores
def test_greedy_tokens_equal_hugging_face_and_cache_free_decode(tmp_path):
  """Batched prompts of 3, 9 and 6 tokens (right-padded here, left-padded by HF): the recurrent state and
  KV caches give HF's 16 greedy tokens, and the same tokens as re-running the whole sequence each step."""
  reference, hf_path = hf_model("qwen3-next", tmp_path)
  out = os.path.join(tmp_path, "mt")
  hf_to_maxtext.convert(hf_path, out)
  c = config.load(
    [os.path.join(out, "config.yml"), "run_name=t", "dtype=float32", f"load_parameters_path={out}/params", CHUNK]
    + ["max_target_length=32", "max_prefill_predict_length=16", "ici_fsdp_parallelism=1", "ici_data_parallelism=-1"],
    {},
  )
  got = Engine.load(c).generate(PROMPTS, 16, strategy="greedy", stop_tokens=[])
  want = reference.greedy
  for row, completion in enumerate(got.completions):
    np.testing.assert_array_equal(completion.tokens, want[row], err_msg=f"prompt {row}")
  # Without any cache: the full forward pass over prompt + generated tokens picks the same next tokens.
  for row, prompt in enumerate(PROMPTS):
    seq = np.array([prompt + list(got.completions[row].tokens)])
    logits = maxtext_logits(out, seq, CHUNK)[0]
    np.testing.assert_array_equal(logits[len(prompt) - 1 : -1].argmax(-1), got.completions[row].tokens)


def test_chunked_rule_equals_recurrence_with_state_and_padding():
  rng = np.random.default_rng(0)
  b, t, h, dk, dv = 2, 11, 3, 4, 5
  q, k = (jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32) for _ in range(2))
  q, k = gated_deltanet.l2_normalize(q), gated_deltanet.l2_normalize(k)
  v = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
  g = -jnp.asarray(rng.uniform(0, 2, size=(b, t, h)), jnp.float32)
  beta = jnp.asarray(rng.uniform(size=(b, t, h)), jnp.float32)
  s0 = jnp.asarray(rng.normal(size=(b, h, dk, dv)), jnp.float32)
  # Jitted: op by op, each small op of the two rules compiles alone (~50 s of the test on 2 cores).
  want, want_s = jax.jit(gated_deltanet.recurrent_gated_delta_rule)(q, k, v, g, beta, s0)
  chunked = jax.jit(gated_deltanet.chunked_gated_delta_rule, static_argnums=6)
  for chunk in (3, 4, 16):
    got, got_s = chunked(q, k, v, g, beta, s0, chunk)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got_s, want_s, rtol=2e-5, atol=2e-5)


# From scratch: one scanned block of 3 gated DeltaNet layers + 1 gated attention layer, MoE with a gated shared expert.
TRAIN_KEYS = ["decoder_block=qwen3next", "base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=2"]
TRAIN_KEYS += ["head_dim=8", "base_num_decoder_layers=4", "num_experts=4", "num_experts_per_tok=2", "vocab_size=32"]
TRAIN_KEYS += ["base_moe_mlp_dim=16", "shared_experts=1", "shared_expert_gate=true", "linear_num_key_heads=2"]
TRAIN_KEYS += ["linear_num_value_heads=4", "linear_key_head_dim=8", "linear_value_head_dim=8", "linear_chunk_size=8"]
TRAIN_KEYS += ["partial_rotary_factor=0.5", "use_qk_norm=true"]


@pytest.mark.nightly  # a fresh model of the family trains: conftest.NIGHTLY (its forward is pinned to Hugging Face's)
@pytest.mark.slow  # 25 s on 2 cores
def test_trains_and_loss_falls(tmp_path):
  c = config.load(
    [os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=train", f"base_output_directory={tmp_path}", *TRAIN_KEYS]
    + ["dataset_type=synthetic", "steps=6", "max_target_length=32", "per_device_batch_size=1"]
    + ["enable_checkpointing=false", "enable_tensorboard=false", "log_config=false", "log_period=1"]
    + ["dtype=float32", "learning_rate=1e-2", "load_balance_loss_weight=0.01"],
    {},
  )
  train.run(c)
  rows = [json.loads(line) for line in open(c.metrics_file)]
  assert len(rows) == 6 and all(np.isfinite(r["loss"]) for r in rows)
  assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["moe_load_balance_loss"] > 0


def test_flops_count_linear_attention_layers_as_such():
  """36 DeltaNet layers at a per-token cost that does not grow with the length; 12 causal attention layers."""
  base = [os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=t", "model_name=qwen3-next-80b-a3b"]
  counts = [flops.training_flops_per_token(config.load([*base, f"max_target_length={t}"], {})) for t in (2048, 4096)]
  short, long = counts
  c = config.load(base, {})
  c64, dk, dv, hv = 64, 128, 128, 32
  linear = hv * (4 * c64 * dk + c64 * (dk + dv) + 2 * c64 * dv + 6 * dk * dv) + 2 * 4 * (2 * 16 * dk + hv * dv)
  full = lambda t: 2.0 * t / 2 * 16 * (256 + 256)  # noqa: E731  causal: T / 2 keys per query (flops.attended_keys)
  assert c.num_decoder_layers == 48
  np.testing.assert_allclose(short.attention, 3 * (36 * linear + 12 * full(2048)), rtol=1e-6)
  np.testing.assert_allclose(long.attention - short.attention, 3 * 12 * (full(4096) - full(2048)), rtol=1e-6)


def test_unsupported_settings_are_config_errors():
  from MaxText import planner  # noqa: PLC0415
  from MaxText.errors import ConfigError  # noqa: PLC0415

  base = [os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=t", "decoder_block=qwen3next"]
  with pytest.raises(ConfigError, match="linear_num_value_heads a multiple of linear_num_key_heads"):
    planner.build(config.load([*base, "linear_num_key_heads=3"], {}))
  with pytest.raises(ConfigError, match="set ici/dcn_context_parallelism=1"):
    planner.build(config.load([*base, "ici_context_parallelism=2"], {}))


def test_packed_documents_do_not_see_each_other():
  """A row packing documents of 4 and 6 tokens: the second's DeltaNet output equals that document alone."""
  from flax import nnx  # noqa: PLC0415

  from MaxText import planner  # noqa: PLC0415
  from MaxText.layers.model_config import ModelConfig  # noqa: PLC0415

  c = config.load([os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=t", "dtype=float32", *TRAIN_KEYS], {})
  with nnx.use_eager_sharding(False):
    layer = gated_deltanet.GatedDeltaNet(ModelConfig.from_config(c), rngs=nnx.Rngs(0), plan=planner.build(c))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 10, 32)), jnp.float32)
  segments = jnp.asarray([[1] * 4 + [2] * 6])
  positions = jnp.asarray([list(range(4)) + list(range(6))])
  run = nnx.jit(lambda m, *args: m(*args)[0])
  packed = run(layer, x, positions, segments)
  alone = run(layer, x[:, 4:], positions[:, 4:], jnp.ones((1, 6), jnp.int32))
  np.testing.assert_allclose(packed[:, 4:], alone, rtol=1e-5, atol=1e-6)
