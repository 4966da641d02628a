"""Qwen3.5-MoE beyond families_test's logits and round trip (helpers.FAMILIES "qwen3.5-moe"): the separate
DeltaNet projections are Qwen3-Next's maths in another layout; the releases' image-text checkpoints import their
text model; greedy decoding against transformers with and without the cache; each distinctive config value
switched off in our model only breaks parity; LoRA SFT of the converted model; expert/tensor/FSDP layouts on 8
devices; FLOPs of the 35B preset; bad input. Dense Qwen3.5 (helpers.FAMILIES "qwen3.5", num_experts 1): its
config both ways, its image-text checkpoint, LoRA SFT, a dense/MoE mix-up."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import config, flops, models, planner, sharding, train
from MaxText.convert import hf_to_maxtext
from MaxText.errors import ConfigError
from MaxText.inference import Engine
from MaxText.layers import gated_deltanet
from MaxText.layers.model_config import ModelConfig
from MaxText.tests.helpers import (
  PARITY_NEW,
  PROMPTS,
  QWEN35,
  QWEN35_DENSE,
  SMALL,
  TOKENS,
  assert_live_model_converts,
  built,
  hf_config,
  hf_keys,
  hf_model,
  make_tokenizer,
  maxtext_logits,
  write_jsonl,
)

BASE = os.path.join(config.CONFIG_DIR, "base.yml")
LAYER = ["base_emb_dim=32", "linear_num_key_heads=2", "linear_num_value_heads=4", "linear_key_head_dim=8"]
LAYER += ["linear_value_head_dim=6", "linear_chunk_size=4", "dtype=float32", "run_name=t"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(the tiny HF model's reference outputs, its directory, the converted MaxText directory)."""
  tmp = tmp_path_factory.mktemp("qwen35")
  reference, hf_path = hf_model("qwen3.5-moe", tmp)
  out = os.path.join(tmp, "mt")
  hf_to_maxtext.convert(hf_path, out)
  return reference, hf_path, out


def test_split_projections_are_the_fused_layer_regrouped():
  """Qwen3-Next's fused in_proj_qkvz/in_proj_ba (grouped per key head) regrouped into Qwen3.5's in_proj_qkv
  (all q, all k, all v), in_proj_z, in_proj_b, in_proj_a give the same outputs."""
  layers = {}
  for block, cls in (("qwen3next", gated_deltanet.GatedDeltaNet), ("qwen3_5", gated_deltanet.SplitGatedDeltaNet)):
    c = config.load([BASE, f"decoder_block={block}", *LAYER], {})
    with nnx.use_eager_sharding(False):
      layers[block] = cls(ModelConfig.from_config(c), rngs=nnx.Rngs(0), plan=planner.build(c))
  fused, split = layers["qwen3next"], layers["qwen3_5"]
  d, hk, hv, dk, dv = 32, 2, 4, 8, 6
  qkvz, ba = fused.in_proj_qkvz.kernel[...], fused.in_proj_ba.kernel[...]  # [D, Hk, G], [D, Hk, 2r]
  q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + 2 * dv], axis=-1)
  split.in_proj_qkv.kernel[...] = jnp.concatenate([a.reshape(d, -1) for a in (q, k, v)], axis=-1)
  split.in_proj_z.kernel[...] = z.reshape(d, hv, dv)
  split.in_proj_b.kernel[...], split.in_proj_a.kernel[...] = (u.reshape(d, hv) for u in jnp.split(ba, 2, axis=-1))
  for name in ("conv1d", "dt_bias", "A_log"):
    getattr(split, name)[...] = getattr(fused, name)[...]
  split.norm.scale[...], split.out.kernel[...] = fused.norm.scale[...], fused.out.kernel[...]
  assert hk * 2 == hv
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 9, d)), jnp.float32)
  positions, segments = jnp.broadcast_to(jnp.arange(9), (2, 9)), jnp.ones((2, 9), jnp.int32)
  run = nnx.jit(lambda m, *args: m(*args)[0])
  want = run(fused, x, positions, segments)
  np.testing.assert_allclose(run(split, x, positions, segments), want, rtol=1e-6, atol=1e-6)


@pytest.mark.torch
@pytest.mark.slow  # 26 s at load average 9 on the 2 shared cores
@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_image_text_checkpoint_imports_its_text_model(tmp_path, moe):
  """The releases are Qwen3_5MoeForConditionalGeneration and Qwen3_5ForConditionalGeneration (text model under
  model.language_model., a vision tower under model.visual.): the text model converts, with the logits of that
  model on text."""
  import torch
  import transformers

  text = {**SMALL, **QWEN35} if moe else {**SMALL, **QWEN35_DENSE}
  text = {k: v for k, v in text.items() if not (moe and k == "intermediate_size")}
  vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4)
  prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
  vision |= {"num_position_embeddings": 16}
  cfg = getattr(transformers, f"{prefix}Config")(text_config=text, vision_config=vision)
  torch.manual_seed(0)
  assert_live_model_converts(getattr(transformers, f"{prefix}ForConditionalGeneration")(cfg).float().eval(), tmp_path)


@pytest.mark.slow  # two engine compiles and three forward compiles on the 2 shared cores
def test_greedy_tokens_equal_hugging_face_with_and_without_cache(converted):
  """Batched prompts of 3, 9 and 6 tokens (right-padded here, left-padded by HF): 16 greedy tokens with the
  recurrent state and KV caches equal HF's, and re-running the whole sequence each step picks the same."""
  reference, _, out = converted
  c = config.load(
    [os.path.join(out, "config.yml"), "run_name=t", "dtype=float32", f"load_parameters_path={out}/params"]
    + ["max_target_length=32", "max_prefill_predict_length=16", "ici_fsdp_parallelism=1", "ici_data_parallelism=-1"],
    {},
  )
  got = Engine.load(c).generate(PROMPTS, PARITY_NEW, strategy="greedy", stop_tokens=[])
  want = reference.greedy
  for row, completion in enumerate(got.completions):
    np.testing.assert_array_equal(completion.tokens, want[row], err_msg=f"prompt {row}")
  for row, prompt in enumerate(PROMPTS):
    seq = np.array([prompt + list(got.completions[row].tokens)])
    logits = maxtext_logits(out, seq)[0]
    np.testing.assert_array_equal(logits[len(prompt) - 1 : -1].argmax(-1), got.completions[row].tokens)


@pytest.mark.slow  # one forward compile per case
@pytest.mark.parametrize(
  "off",
  [
    "partial_rotary_factor=1.0",  # RoPE over the whole head instead of its first half
    "norm_topk_prob=false",  # the chosen experts' softmax weights not renormalised
    "shared_expert_gate=false",  # the shared expert's output not scaled by its sigmoid gate (the gate then unused)
  ],
)
def test_each_feature_switched_off_breaks_parity(converted, off):
  """The converted model with one feature's key changed in ours only no longer matches transformers (the same
  model unchanged does: families_test)."""
  reference, _, out = converted
  assert np.max(np.abs(maxtext_logits(out, TOKENS, off) - reference.logits)) > 1e-3


LORA_LR = {"qwen3.5-moe": 3e-2, "qwen3.5": 1e-2}  # the dense reference model's loss jumps about at 3e-2


@pytest.mark.nightly  # a converted checkpoint trains: conftest.NIGHTLY
@pytest.mark.slow  # one training compile
@pytest.mark.parametrize("family", sorted(LORA_LR))
def test_lora_sft_of_the_converted_model_trains(tmp_path, family):
  """SFT with LoRA adapters on the DeltaNet's and the attention's projections of a converted model (its vocab the
  tokenizer's), MoE and dense: the loss falls."""
  _, hf_path = hf_model(family, tmp_path, vocab_size=320)
  out = os.path.join(tmp_path, "mt")
  hf_to_maxtext.convert(hf_path, out)
  tok = make_tokenizer(os.path.join(tmp_path, "tok"))
  data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "What is the capital of France?", "completion": "Paris."}] * 8)
  targets = ".*self_attention/(query|key|value|out|in_proj_qkv|in_proj_z)"
  c = config.load(
    [os.path.join(out, "config.yml"), "run_name=lora", f"base_output_directory={tmp_path}"]
    + [f"load_parameters_path={out}/params", "dataset_type=text", "use_sft=true", f"dataset_path={data}"]
    + ["tokenizer_type=huggingface", f"tokenizer_path={tok.path}", "eval_fraction=0", "steps=6", "log_period=1"]
    + ["max_target_length=32", "per_device_batch_size=1", "enable_checkpointing=false", "dtype=float32"]
    + ["lora_rank=4", "lora_alpha=8", f"lora_target_modules={targets}", f"learning_rate={LORA_LR[family]}"]
    + ["log_config=false"],
    {},
  )
  train.run(c)
  rows = [json.loads(line) for line in open(c.metrics_file)]
  assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"]


TINY35 = ["decoder_block=qwen3_5", "base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=8"]
TINY35 += ["base_num_decoder_layers=4", "num_experts=8", "num_experts_per_tok=2", "base_moe_mlp_dim=16"]
TINY35 += ["shared_experts=1", "shared_expert_gate=true", "partial_rotary_factor=0.5", "use_qk_norm=true", *LAYER[1:]]
TINY35 += ["vocab_size=64", "weight_dtype=float32"]


def loss35(graphdef, params):
  """The next-token loss of TINY35 (its graph `graphdef`) on a fixed batch of 8 x 16 tokens."""
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (8, 17)), jnp.int32)
  positions, segments = jnp.broadcast_to(jnp.arange(16), (8, 16)), jnp.ones((8, 16), jnp.int32)
  logits = nnx.merge(graphdef, params)(tokens[:, :-1], positions, segments)
  return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0])


@pytest.fixture(scope="module")
def unsharded35():
  """(TINY35's parameters (seed 0), their loss on one device): one build and compile for all layouts."""
  c = config.load([BASE, *TINY35], {})
  graphdef, params = nnx.split(built(c, planner.build(c)), nnx.Param)
  return params, float(jax.jit(functools.partial(loss35, graphdef))(params))


@pytest.mark.slow  # one compile per layout: the three axes at once, and the experts over all 8 devices
@pytest.mark.parametrize(
  "layout",
  [["ici_expert_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2"]]
  + [["ici_expert_parallelism=8", "ici_fsdp_parallelism=1"]],
)
def test_layouts_on_8_devices_give_the_single_device_loss(unsharded35, layout):
  """Expert, tensor and FSDP parallel over the 8 CPU devices: the loss of a 4-layer Qwen3.5-MoE (3 split DeltaNet
  layers, 1 gated attention, 8 experts) equals the unsharded one."""
  params, expected = unsharded35
  c = config.load([BASE, *TINY35, *layout], {})
  mesh = sharding.create_mesh(c)
  sharded = nnx.split(models.build(c, nnx.Rngs(params=0), planner.build(c, mesh)), nnx.Param)[0]
  with sharding.activate(c, mesh):
    placed = jax.device_put(
      params, sharding.logical_to_mesh(nnx.get_partition_spec(params), mesh, sharding.axis_rules(c))
    )
    got = jax.jit(functools.partial(loss35, sharded))(placed)
  np.testing.assert_allclose(float(got), expected, rtol=1e-6)


def test_flops_count_linear_attention_layers_as_such():
  """qwen3.5-35b-a3b: 30 DeltaNet layers whose cost does not grow with the length, 10 causal attention layers;
  the matmuls are 6 x the active parameters (8 of 256 experts + the shared one) but the embedding and head."""
  base = [BASE, "run_name=t", "model_name=qwen3.5-35b-a3b"]
  count = lambda t: flops.training_flops_per_token(config.load([*base, f"max_target_length={t}"], {}))  # noqa: E731
  short, long = count(2048), count(4096)
  full = lambda t: 2.0 * t / 2 * 16 * (256 + 256)  # noqa: E731  causal: T / 2 keys per query
  np.testing.assert_allclose(long.attention - short.attention, 3 * 10 * (full(4096) - full(2048)), rtol=1e-6)
  d, e = 2048, 3 * 2048 * 512  # one expert's (or the shared one's) parameters
  deltanet = d * (2 * 16 * 128 + 32 * 128) + d * 32 * 128 + 2 * d * 32 + 32 * 128 * d
  attention = d * 16 * 256 * 2 + 2 * d * 2 * 256 + 16 * 256 * d
  per_layer = 9 * e + d * 256 + d  # routed and shared experts, router, shared expert gate
  active = 30 * deltanet + 10 * attention + 40 * per_layer
  np.testing.assert_allclose(short.matmul, 6 * active, rtol=1e-6)


def test_other_families_checkpoints_and_unsupported_configs_are_one_line_errors(tmp_path):
  """A Qwen3.5 checkpoint named Qwen3-Next (its separate DeltaNet tensors are not Qwen3-Next's fused ones),
  an image-text config without text_config, a layer pattern that is not periodic, no experts: ConfigErrors
  before any compile."""
  _, hf_path = hf_model("qwen3.5-moe", tmp_path)
  path = os.path.join(hf_path, "config.json")
  cfg = json.load(open(path))

  def convert(**changes):
    json.dump({**cfg, **changes}, open(path, "w"))
    hf_to_maxtext.convert(hf_path, os.path.join(tmp_path, "out"))

  with pytest.raises(ConfigError, match=r"Tensor model\.layers\.0\.linear_attn\.in_proj_.* does not fit config"):
    convert(model_type="qwen3_next", intermediate_size=48)
  with pytest.raises(ConfigError, match="needs a text_config object"):
    convert(model_type="qwen3_5_moe")
  with pytest.raises(ConfigError, match="is not every 4th layer full attention"):
    convert(layer_types=["linear_attention"] * 3 + ["full_attention", "full_attention"])
  with pytest.raises(ConfigError, match="needs num_experts"):
    convert(num_experts=0)
  jax.clear_caches()


def test_dense_config_imports_an_mlp_and_exports_the_dense_class(tmp_path):
  """Qwen3_5TextConfig (qwen3_5_text): the same stack with num_experts 1 (a gated MLP of intermediate_size in every
  layer, no MoE keys); exported back as Qwen3_5ForCausalLM without the MoE fields."""
  _, hf_path = hf_model("qwen3.5", tmp_path)
  hf = json.load(open(os.path.join(hf_path, "config.json")))
  keys = hf_keys(hf)
  assert keys["num_experts"] == 1 and keys["base_mlp_dim"] == 48 and keys["full_attention_interval"] == 4
  assert "shared_expert_gate" not in keys and "norm_topk_prob" not in keys
  (tmp_path / "c.yml").write_text(json.dumps(keys))  # YAML reads JSON
  c = config.load([str(tmp_path / "c.yml"), "run_name=t"], {})
  back = hf_config(c, "float32")
  assert (back["model_type"], back["architectures"]) == ("qwen3_5_text", ["Qwen3_5ForCausalLM"])
  assert back["intermediate_size"] == 48 and back["layer_types"] == hf["layer_types"]
  assert not {"num_experts", "moe_intermediate_size", "shared_expert_intermediate_size"} & set(back)
  _, moe_path = hf_model("qwen3.5-moe", tmp_path / "moe")
  moe = hf_keys(json.load(open(os.path.join(moe_path, "config.json"))))
  assert moe["num_experts"] == 4 and moe["shared_expert_gate"]


def test_dense_checkpoint_as_moe_and_moe_checkpoint_as_dense_are_one_line_errors(tmp_path):
  """A dense config without intermediate_size, a dense checkpoint named MoE, a MoE checkpoint named dense:
  ConfigErrors before any compile."""
  _, hf_path = hf_model("qwen3.5", tmp_path)
  path = os.path.join(hf_path, "config.json")
  cfg = json.load(open(path))

  def convert(**changes):
    json.dump({k: v for k, v in {**cfg, **changes}.items() if v is not None}, open(path, "w"))
    hf_to_maxtext.convert(hf_path, os.path.join(tmp_path, "out"))

  with pytest.raises(ConfigError, match="qwen3_5_text config.json needs intermediate_size"):
    convert(intermediate_size=None)
  with pytest.raises(ConfigError, match="qwen3_5_moe_text config.json needs num_experts"):
    convert(model_type="qwen3_5_moe_text")
  moe_dir = tmp_path / "moe"
  _, moe_path = hf_model("qwen3.5-moe", moe_dir)
  moe_cfg = json.load(open(os.path.join(moe_path, "config.json")))
  json.dump({**moe_cfg, "model_type": "qwen3_5_text", "intermediate_size": 48}, open(f"{moe_path}/config.json", "w"))
  with pytest.raises(ConfigError, match=r"\(dense\) config.json has MoE fields num_experts, moe_intermediate_size"):
    hf_to_maxtext.convert(moe_path, os.path.join(moe_dir, "out"))
