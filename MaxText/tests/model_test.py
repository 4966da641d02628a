"""The llama2 decoder: shapes, logical axes, causality, packing masks, scan vs unrolled; every family starts
near loss ln(vocab)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import config, models, planner
from MaxText.tests.conftest import BASE, TINY, family_tiers
from MaxText.tests.helpers import built, forward

TINY = [*TINY, "vocab_size=128", "max_target_length=16"]  # the shared tiny model, smaller vocabulary and length


def build(*overrides):
  c = config.load([BASE, "run_name=t", *TINY, *overrides], {})
  return c, built(c, planner.build(c))


def tokens(b=2, t=16, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(1, 128, (b, t)), jnp.int32)


@pytest.mark.quick
def test_logits_shape_and_params_carry_logical_axes():
  c, model = build()
  assert forward(model, tokens()).shape == (2, 16, 128)
  specs = jax.tree.leaves(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
  allowed = {"embed", "mlp", "vocab", "q_heads", "heads", "kv_heads", "kv", "norm", "layers"}
  assert specs and all(name in allowed for spec in specs for name in spec)


@pytest.mark.quick
def test_gqa_param_shapes():
  _, model = build()
  attn = nnx.state(model, nnx.Param)["layers"]["self_attention"]
  assert attn["query"]["kernel"].shape == (2, 64, 4, 16)  # [L, D, N, H]
  assert attn["key"]["kernel"].shape == (2, 64, 2, 16)  # [L, D, K, H]


@pytest.mark.quick
def test_causal():
  _, model = build()
  x = tokens()
  y = x.at[:, 10:].set(5)
  np.testing.assert_allclose(forward(model, x)[:, :10], forward(model, y)[:, :10], rtol=1e-6, atol=1e-6)
  assert not np.allclose(forward(model, x)[:, 10:], forward(model, y)[:, 10:])


@pytest.mark.quick
def test_packed_documents_do_not_see_each_other():
  _, model = build()
  a, b = tokens(1, 6, seed=1), tokens(1, 10, seed=2)
  packed = jnp.concatenate([a, b], axis=1)
  segments = jnp.asarray([[1] * 6 + [2] * 10])
  positions = jnp.asarray([list(range(6)) + list(range(10))])
  out = forward(model, packed, segments, positions)
  np.testing.assert_allclose(out[:, :6], forward(model, a), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[:, 6:], forward(model, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra", [["logits_via_embedding=true"], ["logits_dot_in_fp32=true", "dtype=bfloat16"]])
def test_logit_variants(extra):
  _, model = build(*extra)
  assert np.isfinite(np.asarray(forward(model, tokens()), np.float32)).all()


@pytest.mark.quick
def test_scan_and_unrolled_are_the_same_model():
  _, scanned = build("scan_layers=true")
  _, unrolled = build("scan_layers=false")
  np.testing.assert_allclose(forward(scanned, tokens()), forward(unrolled, tokens()), rtol=1e-5, atol=1e-5)


@pytest.mark.quick
def test_unknown_decoder_block():
  with pytest.raises(ValueError, match="llama2"):
    build("decoder_block=llama9")


# Each decoder_block as its preset configures it (tied logits, scaled embeddings, MoE, MLA, ...), shrunk.
MOE = ["num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32"]
MLA = ["q_lora_rank=32", "kv_lora_rank=16", "qk_nope_head_dim=16", "qk_rope_head_dim=8", "v_head_dim=16"]
FAMILY_PRESETS = {
  "default": ["decoder_block=default"],
  "llama2": ["model_name=llama2-7b"],
  "mistral": ["model_name=mistral-7b"],
  "mixtral": ["model_name=mixtral-8x7b", *MOE],
  "qwen3": ["model_name=qwen3-30b-a3b", *MOE],
  "gemma": ["model_name=gemma-2b"],
  "gemma2": ["model_name=gemma2-2b"],
  "gemma3": ["model_name=gemma3-4b", "base_num_decoder_layers=7"],  # one local+global cycle and a remainder
  "deepseek": ["model_name=deepseek3-671b", *MOE, *MLA, "num_experts=8", "n_routing_groups=4", "topk_routing_group=2"]
  + ["first_num_dense_layers=1", "base_num_decoder_layers=3"],
  "gpt3": ["model_name=gpt3-175b"],
  # one 4-layer unit (NoPE last; MoE every 2nd) and a remainder; chunks of 4 within the 16 tokens
  "llama4": ["model_name=llama4-17b-128e", "num_experts=4", "base_moe_mlp_dim=32", "base_num_decoder_layers=6"]
  + ["chunk_attn_window_size=4"],
  # sliding/full alternation with a window of 4 inside the 16 tokens; sinks, router and expert biases
  "gpt_oss": ["model_name=gpt-oss-20b", *MOE, "sliding_window_size=4"],
  # three gated DeltaNet layers and one gated attention layer; chunks of 4
  "qwen3next": ["model_name=qwen3-next-80b-a3b", *MOE, "base_num_decoder_layers=4", "linear_num_key_heads=2"]
  + ["linear_num_value_heads=4", "linear_key_head_dim=16", "linear_value_head_dim=16", "linear_chunk_size=4"],
  # a dense first layer, then MoE with 4 groups of 2 experts, top-2 of 2 groups
  "glm4_moe": ["model_name=glm4.5-355b-a32b", *MOE, "num_experts=8", "n_routing_groups=4", "topk_routing_group=2"]
  + ["first_num_dense_layers=1", "base_num_decoder_layers=3"],
  # one 3 sliding : 1 full cycle and a remainder layer; a window of 4 inside the 16 tokens
  "olmo3": ["model_name=olmo3-7b", "base_num_decoder_layers=5", "sliding_window_size=4"],
  "minimax_m2": ["model_name=minimax-m2-230b", *MOE],  # q/k norms across heads, RoPE on half of each head
  # the same cycle with the DeltaNet's projections separate (Qwen3.5)
  "qwen3_5": ["model_name=qwen3.5-35b-a3b", *MOE, "base_num_decoder_layers=4", "linear_num_key_heads=2"]
  + ["linear_num_value_heads=4", "linear_key_head_dim=16", "linear_value_head_dim=16", "linear_chunk_size=4"],
  # two sliding : full cycles, the second sharing the first's keys and values, with per-layer embeddings (Gemma 4)
  "gemma4": ["model_name=gemma4-e2b", "base_num_decoder_layers=4", "full_attention_interval=2"]
  + ["num_kv_shared_layers=2", "global_head_dim=32", "global_num_kv_heads=2", "sliding_window_size=4"]
  + ["hidden_size_per_layer_input=8", "vocab_size_per_layer_input=512"],
}
FAMILY_TINY = ["base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=128", "head_dim=16"]
FAMILY_TINY += ["base_num_decoder_layers=2", "vocab_size=512", "max_target_length=16", "dtype=float32"]
FAMILY_TINY += ["weight_dtype=float32", "override_model_config=true"]


def test_every_family_has_a_preset_here():
  assert set(FAMILY_PRESETS) == set(models.REGISTRY)


# The fast tier: untied (default), tied with a scaled embedding (gemma), local/global (gemma3), MoE (mixtral) and MLA
# MoE (deepseek); the nightly tier the others.
@pytest.mark.parametrize(
  "block", family_tiers(sorted(FAMILY_PRESETS), ("default", "gemma", "gemma3", "mixtral", "deepseek"), reference=False)
)
def test_fresh_model_starts_near_uniform_loss(block):
  """Random tokens through a freshly initialised model: the loss is within 1 of ln(vocab) (uniform
  predictions), so tied and untied logits, scaled embeddings and MoE start from unit-variance logits."""
  preset = [o for o in FAMILY_PRESETS[block] if o.startswith("model_name=")]
  rest = [o for o in FAMILY_PRESETS[block] if not o.startswith("model_name=")]
  c = config.load([BASE, "run_name=t", *preset, *FAMILY_TINY, *rest], {})
  assert c.decoder_block == block
  model = built(c, planner.build(c))
  ids = jnp.asarray(np.random.default_rng(0).integers(0, c.vocab_size, (4, 17)), jnp.int32)
  logits = forward(model, ids[:, :-1])
  loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, ids[:, 1:, None], -1)[..., 0])
  assert abs(float(loss) - math.log(c.vocab_size)) < 1.0
