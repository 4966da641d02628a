"""Multi-token prediction (DeepSeek V3): the MTP modules train with their own reported loss, leave the main
model and its loss unchanged when off, see no target across a row end or a packed segment, match a PyTorch
reference built from transformers' DeepSeek V3 layer, round-trip through Hugging Face checkpoints and are
dropped for decoding."""

import functools
import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import checkpointing, config, flops, models, planner, saved_config, train
from MaxText import state as state_lib
from MaxText.convert import hf_to_maxtext, mappings, maxtext_to_hf
from MaxText.errors import ConfigError
from MaxText.inference import Engine
from MaxText.layers import mtp
from MaxText.layers.model_config import ModelConfig
from MaxText.objectives import lm
from MaxText.tests.conftest import BASE, cfg
from MaxText.tests.helpers import exported_tensors

SMALL = ["base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=2", "base_mlp_dim=48", "head_dim=8"]
SMALL += ["base_num_decoder_layers=2", "vocab_size=64", "max_target_length=16", "dtype=float32", "run_name=t"]
DEEPSEEK = ["decoder_block=deepseek", "base_num_decoder_layers=3", "first_num_dense_layers=1", "num_experts=4"]
DEEPSEEK += ["num_experts_per_tok=2", "shared_experts=1", "q_lora_rank=12", "kv_lora_rank=8", "qk_nope_head_dim=6"]
DEEPSEEK += ["qk_rope_head_dim=4", "v_head_dim=6", "routed_score_func=sigmoid", "n_routing_groups=2"]
DEEPSEEK += ["routed_bias=true", "load_balance_loss_weight=0", "capacity_factor=0"]
# transformers' DeepseekV3 (no MTP of its own): 3 layers, the first dense; the MTP layer is model.layers.3.
HF_DEEPSEEK = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, vocab_size=64)
HF_DEEPSEEK |= dict(num_key_value_heads=4, first_k_dense_replace=1, moe_intermediate_size=16, n_routed_experts=8)
HF_DEEPSEEK |= dict(num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, q_lora_rank=12)
HF_DEEPSEEK |= dict(kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=6, head_dim=4)
HF_DEEPSEEK |= dict(tie_word_embeddings=False, num_nextn_predict_layers=1)
T = 12


def load(*overrides):
  return config.load([BASE, *SMALL, *overrides], {})


def random_params(c):
  """Random parameters from the shapes (compiling the initialisers would cost more than these tests)."""
  graphdef, abstract = nnx.split(
    nnx.eval_shape(lambda: models.build(c, nnx.Rngs(params=0), planner.build(c))), nnx.Param
  )
  rng = np.random.default_rng(0)
  return graphdef, jax.tree.map(lambda a: jnp.asarray(rng.normal(0.0, 0.3, a.shape), a.dtype), abstract)


def packed_batch(lengths, t=16, seed=0):
  """One row per entry of `lengths`: a tuple of segment lengths packed from position 0, then padding."""
  rng = np.random.default_rng(seed)
  rows = {k: np.zeros((len(lengths), t), np.int32) for k in ("inputs", "targets", "segmentation", "position")}
  for r, segments in enumerate(lengths):
    start = 0
    for s, n in enumerate(segments, 1):
      tokens = rng.integers(1, 64, n + 1)
      rows["inputs"][r, start : start + n], rows["targets"][r, start : start + n] = tokens[:-1], tokens[1:]
      rows["segmentation"][r, start : start + n], rows["position"][r, start : start + n] = s, np.arange(n)
      start += n
  seg = jnp.asarray(rows["segmentation"])
  return {
    "inputs": jnp.asarray(rows["inputs"]),
    "targets": jnp.asarray(rows["targets"]),
    "inputs_segmentation": seg,
    "targets_segmentation": seg,
    "inputs_position": jnp.asarray(rows["position"]),
  }


@pytest.mark.slow  # the real train loop: 30-60 s on 2 busy cores
def test_mtp_trains_and_reports_its_loss(tmp_path):
  c = cfg(tmp_path, "mtp", "steps=12", "per_device_batch_size=2", "gradient_accumulation_steps=2", "vocab_size=16")
  c = c.replace(mtp_num_layers=1)
  train.run(c)
  records = [json.loads(line) for line in open(c.metrics_file)]
  assert all("mtp_loss" in r and np.isfinite(r["mtp_loss"]) for r in records)
  assert records[-1]["mtp_loss"] < records[0]["mtp_loss"] and records[-1]["loss"] < records[0]["loss"]


def init(c):
  """Initialised parameters (pure dict); optimisation level 1 compiles the initialisers ~3x faster (state.py)."""
  build = lambda: nnx.to_pure_dict(nnx.state(models.build(c, nnx.Rngs(params=0), planner.build(c)), nnx.Param))  # noqa: E731
  return jax.jit(build, compiler_options=state_lib.INIT_COMPILER_OPTIONS["cpu"])()


def loss_sums(c, graphdef, params, batch):
  return jax.jit(functools.partial(lm.loss_sums, graphdef, c))(params, batch, None)


def test_mtp_modules_leave_the_main_initialisation_unchanged():
  """The same seed gives the same main parameters with or without MTP (the modules are made last)."""
  main, full = init(load("base_num_decoder_layers=1")), init(load("base_num_decoder_layers=1", "mtp_num_layers=1"))
  assert set(full) - set(main) == {"mtp_modules"} and len(full["mtp_modules"]) == 1
  jax.tree.map(np.testing.assert_array_equal, main, {k: v for k, v in full.items() if k != "mtp_modules"})


def test_without_mtp_the_loss_is_unchanged():
  """The MTP term is the only addition to the objective (DeepSeek, MoE layers); with mtp_num_layers=0 there
  is no MTP parameter, output or metric at all."""
  off, on = load(*DEEPSEEK), load(*DEEPSEEK, "mtp_num_layers=2", "mtp_loss_scaling_factor=0.3")
  graphdef_on, params_on = random_params(on)
  graphdef_off, params_off = nnx.split(
    nnx.eval_shape(lambda: models.build(off, nnx.Rngs(params=0), planner.build(off))), nnx.Param
  )
  pure = nnx.to_pure_dict(params_on)
  del pure["mtp_modules"]
  nnx.replace_by_pure_dict(params_off, pure)
  batch = packed_batch([(16,), (9, 5)])
  objective_off, aux_off = loss_sums(off, graphdef_off, params_off, batch)
  objective_on, aux_on = loss_sums(on, graphdef_on, params_on, batch)
  assert set(aux_off) == {"nll", "z_loss", "load_balance_loss", "tokens"}
  assert aux_on["nll"] == aux_off["nll"] and objective_off == aux_off["nll"]
  assert aux_on["mtp_tokens"] == (15 + 14) + (8 + 4 + 7 + 3)  # per depth k, each segment loses its last k
  np.testing.assert_allclose(objective_on, aux_on["nll"] + 0.3 / 2 * aux_on["mtp_nll"], rtol=1e-6)
  assert set(lm.sum_keys(off)) == set(aux_off) and set(lm.sum_keys(on)) == set(aux_on)


def test_shifted_targets_stop_at_row_ends_padding_and_segment_boundaries():
  targets = jnp.asarray([[10, 11, 12, 20, 21, 0, 0]])
  segments = jnp.asarray([[1, 1, 1, 2, 2, 0, 0]])
  one = mtp.shifted_targets(targets, segments, 1)
  np.testing.assert_array_equal(one.targets, [[11, 12, 20, 21, 0, 0, 0]])
  np.testing.assert_array_equal(one.mask, [[1, 1, 0, 1, 0, 0, 0]])
  np.testing.assert_array_equal(mtp.shifted_targets(targets, segments, 2).mask, [[1, 0, 0, 0, 0, 0, 0]])
  full = mtp.shifted_targets(targets[:, :3], jnp.ones((1, 3), jnp.int32), 1)  # one segment fills the row
  np.testing.assert_array_equal(full.mask, [[1, 1, 0]])


@pytest.mark.parametrize("scan", ["true", "false"])
def test_a_packed_row_gives_the_mtp_loss_of_its_segments_alone(scan):
  """Neither the MTP targets nor its attention cross a packed segment boundary."""
  c = load("mtp_num_layers=2", f"scan_layers={scan}")
  graphdef, params = random_params(c)
  packed, alone = packed_batch([(5, 7)], seed=1), packed_batch([(5,), (7,)], seed=1)
  _, aux_packed = loss_sums(c, graphdef, params, packed)
  _, aux_alone = loss_sums(c, graphdef, params, alone)
  assert aux_packed["mtp_tokens"] == aux_alone["mtp_tokens"] == (4 + 3) + (6 + 5)
  np.testing.assert_allclose(aux_packed["mtp_nll"], aux_alone["mtp_nll"], rtol=1e-5)
  np.testing.assert_allclose(aux_packed["nll"], aux_alone["nll"], rtol=1e-5)


def test_mtp_needs_a_family_with_an_mtp_layer_and_valid_keys():
  c = load("decoder_block=gemma", "mtp_num_layers=1")
  with pytest.raises(ConfigError, match="mtp_num_layers=1 is not available for decoder_block=gemma"):
    nnx.eval_shape(lambda: models.build(c, nnx.Rngs(params=0), planner.build(c)))
  with pytest.raises(ConfigError, match="mtp_num_layers and mtp_loss_scaling_factor must be >= 0"):
    load("mtp_num_layers=-1")
  llama = load("mtp_num_layers=1")
  model = ModelConfig.from_config(llama)
  with pytest.raises(ConfigError, match="decoder_block=deepseek only"):
    abstract = nnx.to_pure_dict(state_lib.param_spec(llama).abstract)
    mappings.of_block("llama2").rules(llama, models.family(model).stacks(model), abstract)
  assert state_lib.for_inference(llama).mtp_num_layers == 0


def _hf_with_mtp(tmp_path):
  """A tiny transformers DeepseekV3 saved with one MTP module (model.layers.3) added: a MoE decoder layer,
  enorm/hnorm/eh_proj/shared_head.norm, and copies of the embedding and head, as DeepSeek V3 ships it."""
  import torch
  import transformers
  from safetensors import torch as safetensors_torch

  torch.manual_seed(0)
  cfg_hf = transformers.DeepseekV3Config(**HF_DEEPSEEK)
  model = transformers.AutoModelForCausalLM.from_config(cfg_hf, attn_implementation="eager").float().eval()
  with torch.no_grad():
    for name, p in model.named_buffers():
      if "bias" in name:
        p.copy_(torch.randn_like(p) * 0.1)
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(torch.randn_like(p) * 0.5 + 1.0)
  path = os.path.join(tmp_path, "hf")
  model.save_pretrained(path)
  state = safetensors_torch.load_file(os.path.join(path, "model.safetensors"))
  layer = {k.replace("layers.2.", "layers.3."): torch.randn_like(v) * 0.3 for k, v in state.items() if "layers.2." in k}
  d = HF_DEEPSEEK["hidden_size"]
  layer |= {f"model.layers.3.{n}.weight": torch.randn(d) * 0.5 + 1.0 for n in ("enorm", "hnorm", "shared_head.norm")}
  layer["model.layers.3.eh_proj.weight"] = torch.randn(d, 2 * d) * 0.2
  layer["model.layers.3.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
  layer["model.layers.3.shared_head.head.weight"] = state["lm_head.weight"].clone()
  safetensors_torch.save_file({**state, **layer}, os.path.join(path, "model.safetensors"))
  return model, path, {**state, **layer}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("mtp_hf")
  model, hf_path, tensors = _hf_with_mtp(tmp_path)
  out = os.path.join(tmp_path, "mt")
  hf_to_maxtext.convert(hf_path, out, scan_layers=True)
  return model, tensors, out


def _reference_mtp_logits(model, tensors, tokens, tmp_path):
  """Depth-1 MTP logits [B, T, V] in PyTorch: transformers' own DeepseekV3 decoder layer (MoE, index 3, loaded
  by transformers from the MTP tensors) on eh_proj([enorm(embedding of token i+1), hnorm(main hidden state
  before the final norm)]), then shared_head.norm and the head."""
  import torch
  import transformers
  from safetensors import torch as safetensors_torch

  module = importlib.import_module(type(model).__module__)
  four = os.path.join(tmp_path, "four_layers")  # the main model plus the MTP layer as a 4th decoder layer
  transformers.DeepseekV3Config(**{**HF_DEEPSEEK, "num_hidden_layers": 4}).save_pretrained(four)
  mtp_only = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
  kept = {k: v for k, v in tensors.items() if not (k.startswith("model.layers.3.") and k.split(".")[3] in mtp_only)}
  safetensors_torch.save_file(kept, os.path.join(four, "model.safetensors"))
  layer = transformers.AutoModelForCausalLM.from_pretrained(four, attn_implementation="eager").float().eval()
  layer = layer.model.layers[3]
  d, eps = model.config.hidden_size, model.config.rms_norm_eps
  norms = {n: module.DeepseekV3RMSNorm(d, eps=eps) for n in ("enorm", "hnorm", "shared_head.norm")}
  for n, norm in norms.items():
    norm.weight.data = tensors[f"model.layers.3.{n}.weight"]
  captured = {}
  hook = model.model.norm.register_forward_hook(lambda mod, args, out: captured.setdefault("h", args[0]))
  tokens_t = torch.tensor(tokens)
  b, t = tokens.shape
  with torch.no_grad():
    model(tokens_t)
    hook.remove()
    ahead = torch.nn.functional.pad(tokens_t[:, 1:], (0, 1))
    x = torch.cat([norms["enorm"](model.model.embed_tokens(ahead)), norms["hnorm"](captured["h"])], dim=-1)
    x = x @ tensors["model.layers.3.eh_proj.weight"].T
    positions = torch.arange(t)[None].expand(b, t)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    out = layer(
      x, attention_mask=mask, position_ids=positions, position_embeddings=model.model.rotary_emb(x, positions)
    )
    out = out[0] if isinstance(out, tuple) else out
    return (norms["shared_head.norm"](out) @ model.lm_head.weight.T).numpy()


@pytest.mark.torch
def test_imported_mtp_matches_a_pytorch_reference_and_exports_back_exactly(converted, tmp_path):
  model, tensors, out = converted
  c = config.load(
    [os.path.join(out, "config.yml"), "run_name=t", "dtype=float32", f"load_parameters_path={out}/params"], {}
  )
  assert c.mtp_num_layers == 1
  spec = state_lib.param_spec(c)
  params = checkpointing.load_params(c.load_parameters_path, spec.abstract)
  tokens = np.random.default_rng(0).integers(0, 64, (2, T))
  m = nnx.merge(spec.graphdef, params)
  positions = jnp.broadcast_to(jnp.arange(T), (2, T))
  hidden = m.forward(jnp.asarray(tokens), positions, jnp.ones((2, T), jnp.int32), mtp=True).mtp[0]
  np.testing.assert_allclose(
    np.asarray(m.logits(hidden)), _reference_mtp_logits(model, tensors, tokens, tmp_path), atol=1e-4
  )

  back = os.path.join(tmp_path, "back")
  maxtext_to_hf.convert(c, back)
  exported = exported_tensors(back)
  assert sorted(exported) == sorted(tensors)
  for name, tensor in tensors.items():
    assert np.array_equal(exported[name], tensor.numpy()), name
  assert json.load(open(os.path.join(back, "config.json")))["num_nextn_predict_layers"] == 1


@pytest.mark.torch
def test_transformers_checkpoints_without_mtp_tensors_import_without_mtp(tmp_path):
  """transformers' DeepseekV3 config says num_nextn_predict_layers=1 but saves no MTP tensors: none imported."""
  import transformers

  model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**HF_DEEPSEEK))
  model.save_pretrained(os.path.join(tmp_path, "hf"))
  hf_to_maxtext.convert(os.path.join(tmp_path, "hf"), os.path.join(tmp_path, "mt"))
  c = config.load([os.path.join(tmp_path, "mt", "config.yml"), "run_name=t"], {})
  assert c.mtp_num_layers == 0


@pytest.mark.torch
@pytest.mark.slow  # compiles DeepSeek prefill and decode steps: 30-40 s on 2 busy cores
def test_decode_drops_the_mtp_modules(converted):
  """A checkpoint with MTP parameters (and mtp_num_layers=1 in its config) decodes as the model without them."""
  _, _, out = converted
  overrides = [f"load_parameters_path={out}/params", "max_prefill_predict_length=8", "max_target_length=16"]
  c = config.load([os.path.join(out, "config.yml"), "run_name=t", *overrides], {})
  assert c.mtp_num_layers == 1
  engine = Engine.load(c)
  assert "mtp_modules" not in nnx.to_pure_dict(engine.params)
  assert len(engine.generate([[1, 2, 3]], 3, strategy="greedy", stop_tokens=[]).completions[0].tokens) == 3


def test_flops_count_each_mtp_module_as_one_more_layer_eh_proj_and_head():
  off, on = load(*DEEPSEEK), load(*DEEPSEEK, "mtp_num_layers=1")
  deeper = load(*DEEPSEEK, "base_num_decoder_layers=4")  # one more MoE layer, as the MTP module has
  f_off, f_on, f_deeper = (flops.training_flops_per_token(c) for c in (off, on, deeper))
  assert f_on.matmul == pytest.approx(f_deeper.matmul + 6 * 2 * on.emb_dim**2)
  assert f_on.attention == pytest.approx(f_deeper.attention) and f_on.embedding == 2 * f_off.embedding


def test_resuming_with_another_mtp_num_layers_is_named_but_a_params_load_is_not():
  c = load("mtp_num_layers=1")
  assert saved_config.differences({"mtp_num_layers": 0}, c, layout=True) == ["mtp_num_layers: 0 -> 1"]
  assert saved_config.differences({"mtp_num_layers": 0}, c, layout=False) == []
