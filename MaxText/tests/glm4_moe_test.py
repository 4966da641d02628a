"""GLM-4.5 (glm4_moe) features against Hugging Face transformers: the converted tiny model of helpers.FAMILIES
matches (families_test); each feature switched off in our model alone breaks the match; bad input fails in one
line before any compile; the checkpoint's MTP layer matches a PyTorch reference; layouts, LoRA and SFT train."""

import json
import os
import shutil

import numpy as np
import pytest

from MaxText import config, planner, train
from MaxText.convert import hf_to_maxtext
from MaxText.errors import ConfigError
from MaxText.tests.helpers import (
  TOKENS,
  assert_export_is_exact,
  hf_config,
  hf_keys,
  hf_model,
  make_tokenizer,
  maxtext_logits,
  write_jsonl,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(HF logits on tokens, tokens, the converted directory, the HF directory)."""
  tmp = tmp_path_factory.mktemp("glm4_moe")
  reference, hf_path = hf_model("glm4_moe", tmp)
  tokens, ref = TOKENS, reference.logits
  out = os.path.join(tmp, "mt")
  hf_to_maxtext.convert(hf_path, out)
  return ref, tokens, out, hf_path


# Each override turns one feature off (the parameters it drops are left unread): the logits must then differ.
FEATURES = {
  "partial_rope": ["partial_rotary_factor=1.0"],
  "qkv_biases": ["attention_bias=false"],
  "qk_norm": ["use_qk_norm=false"],
  "correction_bias": ["routed_bias=false"],
  "routed_scaling": ["routed_scaling_factor=1.0"],
  "expert_groups": ["n_routing_groups=1", "topk_routing_group=1"],
  "shared_expert": ["shared_experts=0"],
}


# ~10 s each on 2 busy cores: partial RoPE in the default tier, the rest slow.
@pytest.mark.parametrize(
  "feature", [f if f == "partial_rope" else pytest.param(f, marks=pytest.mark.slow) for f in sorted(FEATURES)]
)
def test_each_feature_switched_off_breaks_the_match(converted, feature):
  ref, tokens, out, _ = converted
  got = maxtext_logits(out, tokens, *FEATURES[feature])
  assert not np.allclose(got, ref, rtol=1e-4, atol=1e-4), feature


def test_bad_input_fails_in_one_line(converted, tmp_path):
  _, _, out, hf_path = converted
  hf = json.load(open(os.path.join(hf_path, "config.json")))
  with pytest.raises(ConfigError, match="partial_rotary_factor=0.625 with head_dim=8 does not give an even"):
    hf_keys({**hf, "partial_rotary_factor": 0.625, "rope_parameters": {"rope_theta": 10000.0}})
  # The GLM-4.5 checkpoint under DeepSeek V3's config, and a DeepSeek V3 checkpoint under GLM-4.5's.
  cases = (
    ("deepseek_v3", "attention_bias=true is not supported for deepseek_v3"),
    ("glm4_moe", "kv_a_layernorm.weight .and 17 more. does not fit"),
  )
  for model_type, error in cases:
    source = hf_path if model_type == "deepseek_v3" else hf_model("deepseek3", tmp_path)[1]
    d = os.path.join(tmp_path, model_type)
    os.makedirs(d)
    shutil.copyfile(os.path.join(source, "model.safetensors"), os.path.join(d, "model.safetensors"))
    conf = json.load(open(os.path.join(source, "config.json")))
    json.dump({**conf, "model_type": model_type}, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError, match=error) as e:
      hf_to_maxtext.convert(d, os.path.join(tmp_path, f"{model_type}_out"))
    assert "\n" not in str(e.value)
  with pytest.raises(ConfigError, match="partial_rotary_factor=0.625 must rotate an even number of head_dim=8 dims"):
    planner.build(config.load([os.path.join(out, "config.yml"), "run_name=t", "partial_rotary_factor=0.625"], {}))
  c = config.load([os.path.join(out, "config.yml"), "run_name=t", "routed_score_func=softmax"], {})
  with pytest.raises(ConfigError, match="glm4_moe exports with"):
    hf_config(c, "float32")


MTP_ONLY = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")


def mtp_reference(hf_path, tensors, tokens, tmp_path):
  """Depth-1 MTP logits [B, T, V] in PyTorch, as GLM-4.5's MTP layer computes them (DeepSeek V3's scheme):
  transformers' own Glm4Moe decoder layer (index 3, MoE) on eh_proj([enorm(embedding of token i+1),
  hnorm(main hidden state before the final norm)]), then shared_head.norm and the head."""
  import importlib

  import torch
  import transformers
  from safetensors import torch as safetensors_torch

  model = transformers.AutoModelForCausalLM.from_pretrained(hf_path, attn_implementation="eager").float().eval()
  module = importlib.import_module(type(model).__module__)
  four = os.path.join(tmp_path, "four_layers")  # the MTP layer's decoder layer as a 4th layer
  transformers.Glm4MoeConfig(**{**model.config.to_dict(), "num_hidden_layers": 4}).save_pretrained(four)
  kept = {k: v for k, v in tensors.items() if not (k.startswith("model.layers.3.") and k.split(".")[3] in MTP_ONLY)}
  safetensors_torch.save_file(kept, os.path.join(four, "model.safetensors"))
  layer = transformers.AutoModelForCausalLM.from_pretrained(four, attn_implementation="eager").float().eval()
  layer = layer.model.layers[3]
  d, eps = model.config.hidden_size, model.config.rms_norm_eps
  norms = {n: module.Glm4MoeRMSNorm(d, eps=eps) for n in ("enorm", "hnorm", "shared_head.norm")}
  for n, norm in norms.items():
    norm.weight.data = tensors[f"model.layers.3.{n}.weight"]
  captured = {}
  hook = model.model.norm.register_forward_hook(lambda mod, args, out: captured.setdefault("h", args[0]))
  ids = torch.tensor(tokens)
  b, t = tokens.shape
  with torch.no_grad():
    model(ids)
    hook.remove()
    ahead = torch.nn.functional.pad(ids[:, 1:], (0, 1))
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
@pytest.mark.slow  # two conversions, a PyTorch reference and the MTP forward: ~60 s on 2 busy cores
def test_the_checkpoint_mtp_layer_matches_pytorch_and_is_written_back_exactly(converted, tmp_path):
  """GLM-4.5 ships one multi-token-prediction layer after the decoder's (model.layers.3 here) in DeepSeek V3's
  layout; transformers skips it. The import reads it into our MTP module (mtp_num_layers=1), whose logits match
  a PyTorch reference built from transformers' decoder layer; the export writes every tensor back bit for bit."""
  import jax.numpy as jnp
  import torch
  from flax import nnx
  from safetensors import torch as safetensors_torch

  from MaxText import checkpointing
  from MaxText import state as state_lib

  _, tokens, _, hf_path = converted
  state = safetensors_torch.load_file(os.path.join(hf_path, "model.safetensors"))
  torch.manual_seed(1)
  layer = {k.replace("layers.2.", "layers.3."): torch.randn_like(v) * 0.3 for k, v in state.items() if "layers.2." in k}
  d = state["model.norm.weight"].shape[0]
  layer |= {f"model.layers.3.{n}.weight": torch.randn(d) * 0.5 + 1.0 for n in ("enorm", "hnorm", "shared_head.norm")}
  layer["model.layers.3.eh_proj.weight"] = torch.randn(d, 2 * d) * 0.2
  layer["model.layers.3.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
  layer["model.layers.3.shared_head.head.weight"] = state["lm_head.weight"].clone()
  tensors = {**state, **layer}
  src = os.path.join(tmp_path, "hf")
  os.makedirs(src)
  safetensors_torch.save_file(tensors, os.path.join(src, "model.safetensors"))
  json.dump(json.load(open(os.path.join(hf_path, "config.json"))), open(os.path.join(src, "config.json"), "w"))
  out = os.path.join(tmp_path, "mt")
  hf_to_maxtext.convert(src, out)
  c = config.load(
    [os.path.join(out, "config.yml"), "run_name=t", "dtype=float32", f"load_parameters_path={out}/params"], {}
  )
  assert c.mtp_num_layers == 1
  spec = state_lib.param_spec(c)
  m = nnx.merge(spec.graphdef, checkpointing.load_params(c.load_parameters_path, spec.abstract))
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  hidden = m.forward(jnp.asarray(tokens), positions, jnp.ones((b, t), jnp.int32), mtp=True).mtp[0]
  want = mtp_reference(src, tensors, tokens, tmp_path)
  np.testing.assert_allclose(np.asarray(m.logits(hidden)), want, atol=1e-4)
  assert_export_is_exact(c, src, os.path.join(tmp_path, "back"))


def train_losses(tmp_path, out, name, *overrides):
  """Losses of 2 steps of training the converted model (8 CPU devices, float32, synthetic data)."""
  c = config.load(
    [os.path.join(out, "config.yml"), f"run_name={name}", f"base_output_directory={tmp_path}"]
    + [f"load_parameters_path={out}/params", "dataset_type=synthetic", "steps=2", "max_target_length=16"]
    + ["per_device_batch_size=1", "enable_checkpointing=false", "enable_tensorboard=false", "log_config=false"]
    + ["log_period=1", "dtype=float32", *overrides],
    {},
  )
  train.run(c)
  return [json.loads(line)["loss"] for line in open(c.metrics_file)]


# The family's sharding: experts over `expert` (all-to-all dispatch), heads over `tensor`, against fsdp over all 8;
# the three axes at once, then the experts over more devices with no fsdp.
LAYOUTS = {
  "ep2-tp2-fsdp2": ["ici_expert_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2"],
  "ep4-tp2": ["ici_expert_parallelism=4", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=1"],
}


@pytest.mark.slow  # 3 compiled training runs: ~30 s on 2 cores
def test_losses_are_equal_across_layouts(converted, tmp_path):
  _, _, out, _ = converted
  want = train_losses(tmp_path, out, "fsdp8")
  assert len(want) == 2 and np.all(np.isfinite(want))
  for name, layout in LAYOUTS.items():
    np.testing.assert_allclose(train_losses(tmp_path, out, name, *layout), want, rtol=1e-5, err_msg=name)


@pytest.mark.nightly  # a converted checkpoint trains: conftest.NIGHTLY
@pytest.mark.slow  # one compiled training run: ~40 s on 2 busy cores
def test_sft_with_lora_trains_the_converted_model(tmp_path):
  """Chat SFT (use_sft) with LoRA adapters on a converted GLM-4.5 whose vocabulary holds the chat tokenizer's."""
  _, hf_path = hf_model("glm4_moe", tmp_path, vocab_size=320)
  out = os.path.join(tmp_path, "mt")
  hf_to_maxtext.convert(hf_path, out)
  tok = make_tokenizer(str(tmp_path / "tok"))
  data = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": f"Question {i}?", "completion": "Paris."} for i in range(8)])
  losses = train_losses(
    tmp_path, out, "sft", "use_sft=true", "dataset_type=text", f"dataset_path={data}", "eval_fraction=0",
    "tokenizer_type=huggingface", f"tokenizer_path={tok.path}", "lora_rank=4", "max_target_length=32",
  )  # fmt: skip
  assert len(losses) == 2 and np.all(np.isfinite(losses))
