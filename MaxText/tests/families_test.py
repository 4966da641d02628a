"""Every family against Hugging Face transformers: the committed tiny random models (norms randomised too;
hf_references/, written with transformers on CPU) converted to MaxText give their committed float32 logits;
scan true/false agree; the way back to Hugging Face is bit-exact; converted models train. The tests marked
`torch` read transformers' own configs and RoPE code live."""

import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import numpy as safetensors_numpy

from MaxText import checkpointing, config, models, planner, saved_config, train
from MaxText.convert import hf_to_maxtext, maxtext_to_hf
from MaxText.errors import ConfigError
from MaxText.layers import attention_mla, embeddings
from MaxText.layers.model_config import ModelConfig
from MaxText.tests.conftest import family_tiers
from MaxText.tests.helpers import (
  FAMILIES,
  TOKENS,
  assert_export_is_exact,
  exported_tensors,
  hf_config,
  hf_keys,
  hf_model,
  maxtext_logits,
)

# Architecture fields of the published config.json files (DeepSeek-V2-Lite; DeepSeek-V3 and Kimi-K2-Instruct
# without their FP8 quantization_config), legacy rope_scaling with "type" included.
GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
PUBLISHED = {
  name: os.path.join(GOLDEN, f"{name}.config.json") for name in ("deepseek2-16b", "deepseek3-671b", "kimi-k2-1t")
}
LOADS_AS = {"kimi_k2": "deepseek_v3"}  # Kimi K2's model_type names a remote-code copy of transformers' DeepSeek V3


# The fast tier: llama3.1 (RoPE scaling; also quick), deepseek3 (MLA and routed MoE), gemma3 (local/global cycles
# with a remainder), mixtral (MoE with GQA); the slow tier every family.
LOGITS_FAST = ("llama3.1", "deepseek3", "gemma3", "mixtral")


@pytest.mark.parametrize("family", family_tiers(sorted(FAMILIES), LOGITS_FAST, quick="llama3.1"))
def test_logits_match_hugging_face_and_round_trip_is_exact(family, tmp_path):
  reference, hf_path = hf_model(family, tmp_path)
  tokens, ref = TOKENS, reference.logits
  scanned, unrolled = os.path.join(tmp_path, "scan"), os.path.join(tmp_path, "unrolled")
  hf_to_maxtext.convert(hf_path, scanned, scan_layers=True)
  hf_to_maxtext.convert(hf_path, unrolled, scan_layers=False)
  got = maxtext_logits(scanned, tokens)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  for path, other in ((scanned, "scan_layers=false"), (unrolled, "scan_layers=true"), (unrolled, "scan_layers=false")):
    np.testing.assert_allclose(maxtext_logits(path, tokens, other), got, rtol=1e-6, atol=1e-6)  # fusion order only

  back = os.path.join(tmp_path, "back")
  c = config.load([os.path.join(scanned, "config.yml"), "run_name=t", f"load_parameters_path={scanned}/params"], {})
  assert_export_is_exact(c, hf_path, back)  # hf_references_test reloads exports in transformers (torch tier)
  original, exported = (hf_keys(json.load(open(os.path.join(d, "config.json")))) for d in (hf_path, back))
  shared = original.keys() & exported.keys()  # the export may spell out defaults or leave out unused sizes
  assert {k: exported[k] for k in shared} == {k: original[k] for k in shared} and len(shared) > 10


def test_deepseek32_parity_needs_the_indexer_selection(tmp_path):
  """Training in query blocks of 4 (one block's index scores at a time) gives transformers' logits; with
  index_topk >= T (every query attends all its keys, as without the indexer) ours leave transformers'
  DeepseekV32, whose indexer keeps 4 of up to 12 keys; bad indexer keys fail in one line."""
  reference, hf_path = hf_model("deepseek32", tmp_path)
  tokens, ref = TOKENS, reference.logits
  out = os.path.join(tmp_path, "mt")
  hf_to_maxtext.convert(hf_path, out)
  np.testing.assert_allclose(maxtext_logits(out, tokens, "attention_query_chunk=4"), ref, rtol=1e-5, atol=1e-5)
  dense = maxtext_logits(out, tokens, f"index_topk={tokens.shape[1]}")
  assert np.abs(dense - ref).max() > 1e-3
  np.testing.assert_allclose(dense[:, :4], ref[:, :4], rtol=1e-5, atol=1e-5)  # up to 4 keys: no selection
  base = [os.path.join(out, "config.yml"), "run_name=t"]
  with pytest.raises(ConfigError, match="q_lora_rank > 0"):
    config.load([*base, "q_lora_rank=0"], {})
  with pytest.raises(ConfigError, match="index_topk > 0"):
    config.load([*base, "index_topk=0"], {})
  with pytest.raises(ConfigError, match="context parallelism"):
    config.load([*base, "ici_context_parallelism=2"], {})
  v3 = config.load([*base, "index_n_heads=0", f"load_parameters_path={out}/params"], {})  # a V3 config
  with pytest.raises(ConfigError, match="index_n_heads: 16 -> 0"):
    saved_config.check(v3)


MOE_FAMILIES = ("mixtral", "qwen3-moe", "deepseek3", "deepseek2", "llama4", "glm4_moe", "minimax-m2")
MOE_FAMILIES += ("deepseek32",)
TRAINED = ("llama2", "llama-bias", "mistral", "qwen3", "gemma", "gemma2", "gemma3", "gpt3", *MOE_FAMILIES)
TRAINED += ("gemma4-ple",)
MOE_FAMILIES += ("gemma4-moe",)
TRAINED += ("gemma4-moe",)
# The train step's compile grows with the distinct layers in it (a scanned cycle's layers are all compiled):
# gemma3's 7 (a 6-layer cycle and a remainder) and gemma4-ple's 6 (a cycle, then the 4-layer kv-sharing block)
# take ~90 and ~120 CPU-s against ~6 for llama2, ~15 for gemma2, ~40 for gemma4-moe (2026-11-27; gemma3 on one
# device instead of 8: the same, remat_policy=none or scan_layers=false: a fifth less). They run in the nightly
# tier with the other families; the fast tier (and so the whole suite) trains a dense model, GQA MoE, MLA MoE and a
# local/global cycle. Each family's forward is checked against Hugging Face in the whole suite (above), and so are
# the gradients of the families with a module of their own across layouts (equal to one device's).
TRAIN_FAST = ("llama2", "mixtral", "deepseek3", "gemma2")


@pytest.mark.parametrize("family", family_tiers(TRAINED, TRAIN_FAST, reference=False))
def test_converted_model_trains(family, tmp_path):
  """Every family (one model per decoder_block and MoE router) trains from its converted checkpoint."""
  _, hf_path = hf_model(family, tmp_path)
  out = os.path.join(tmp_path, "mt")
  hf_to_maxtext.convert(hf_path, out)
  c = config.load(
    [os.path.join(out, "config.yml"), "run_name=train", f"base_output_directory={tmp_path}"]
    + [f"load_parameters_path={out}/params", "dataset_type=synthetic", "steps=2", "max_target_length=16"]
    + ["per_device_batch_size=1", "enable_checkpointing=false", "enable_tensorboard=false", "log_config=false"]
    + ["log_period=1", "dtype=float32", "load_balance_loss_weight=0.01"]
    + (["attention_query_chunk=8"] if family == "deepseek32" else []),  # the indexer's blocked training path
    {},
  )
  train.run(c)
  rows = [json.loads(line) for line in open(c.metrics_file)]
  assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
  if family in MOE_FAMILIES:  # the loss is averaged over all layers; half of llama4's are dense
    assert all(r["moe_load_balance_loss"] > (0.25 if family == "llama4" else 0.5) for r in rows)
  else:  # dense models do not report an MoE loss
    assert all("moe_load_balance_loss" not in r for r in rows)


def test_errors_name_the_tensor(tmp_path):
  _, hf_path = hf_model("llama2", tmp_path)
  cfg = json.load(open(os.path.join(hf_path, "config.json")))
  state = safetensors_numpy.load_file(os.path.join(hf_path, "model.safetensors"))

  def save(tensors, conf):
    d = os.path.join(tmp_path, f"case{len(os.listdir(tmp_path))}")
    os.makedirs(d)
    safetensors_numpy.save_file(tensors, os.path.join(d, "model.safetensors"))
    json.dump(conf, open(os.path.join(d, "config.json"), "w"))
    return d

  missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
  with pytest.raises(ConfigError, match=r"Missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
    hf_to_maxtext.convert(save(missing, cfg), os.path.join(tmp_path, "o1"))
  wrong = {**state, "model.layers.0.self_attn.q_proj.weight": np.zeros((8, 32), np.float32)}
  with pytest.raises(ConfigError, match=r"q_proj\.weight has shape \(8, 32\); config.json implies \(32, 32\)"):
    hf_to_maxtext.convert(save(wrong, cfg), os.path.join(tmp_path, "o2"))
  with pytest.raises(ConfigError, match=r"model\.layers\.1\..* does not fit"):
    hf_to_maxtext.convert(save(state, {**cfg, "num_hidden_layers": 1}), os.path.join(tmp_path, "o3"))
  with pytest.raises(ConfigError, match="Unsupported architecture model_type='bert'"):
    hf_to_maxtext.convert(save(state, {**cfg, "model_type": "bert"}), os.path.join(tmp_path, "o4"))
  with pytest.raises(ConfigError, match="model_type='deepseek_v4': DeepSeek V4 is not supported yet"):
    hf_to_maxtext.convert(save(state, {**cfg, "model_type": "deepseek_v4"}), os.path.join(tmp_path, "o6"))
  with pytest.raises(ConfigError, match="attention_bias=true is not supported for mistral"):
    hf_to_maxtext.convert(save(state, {**cfg, "model_type": "mistral", "attention_bias": True}), str(tmp_path / "o5"))


def test_deepseek_mtp_layers_are_skipped_and_quantized_checkpoints_rejected(tmp_path):
  """DeepSeek V3's multi-token-prediction layer (after the last layer) is not part of the model."""
  _, hf_path = hf_model("deepseek2-lite", tmp_path)
  state = safetensors_numpy.load_file(os.path.join(hf_path, "model.safetensors"))
  mtp = {k.replace("layers.2.", "layers.3."): v.copy() for k, v in state.items() if "layers.2." in k}
  safetensors_numpy.save_file({**state, **mtp}, os.path.join(hf_path, "model.safetensors"))
  hf_to_maxtext.convert(hf_path, os.path.join(tmp_path, "mt"), scan_layers=False)
  cfg = json.load(open(os.path.join(hf_path, "config.json")))
  with pytest.raises(ConfigError, match="quantization_config"):
    hf_keys({**cfg, "quantization_config": {"quant_method": "fp8"}})


@pytest.mark.quick
def test_command_lines_and_check_logits(tmp_path):
  """The documented commands: hf_to_maxtext, maxtext_to_hf, check_logits (pass, then fail on bad logits)."""
  from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

  from MaxText import (
    check_logits,  # noqa: PLC0415
    decode,  # noqa: PLC0415
  )

  reference, hf_path = hf_model("qwen3", tmp_path)
  words = ["[UNK]", "I", "love", "to", *[f"w{i}" for i in range(60)]]  # the model's 64 ids
  tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  tokenizer.save(os.path.join(hf_path, "tokenizer.json"))
  out, back = os.path.join(tmp_path, "mt"), os.path.join(tmp_path, "back")
  hf_to_maxtext.main(["hf_to_maxtext.py", "--hf_path", hf_path, "--output", out, "--scan_layers", "false"])
  cfg, params = os.path.join(out, "config.yml"), f"load_parameters_path={out}/params"
  run_dir = [f"base_output_directory={tmp_path}", "run_name=decode", "add_bos=false", "decode_max_new_tokens=3"]
  result = decode.run(config.load([cfg, params, *run_dir], {}))  # the converted tokenizer, no tokenizer flags
  assert all(len(c.tokens) == 3 for c in result.completions)
  maxtext_to_hf.main(["maxtext_to_hf.py", cfg, params, "--output", back])
  original = safetensors_numpy.load_file(os.path.join(hf_path, "model.safetensors"))
  assert sorted(exported_tensors(back)) == sorted(original) and os.path.exists(os.path.join(back, "config.json"))
  tokens, logits = TOKENS, reference.logits
  golden, bad = os.path.join(tmp_path, "golden.jsonl"), os.path.join(tmp_path, "bad.jsonl")
  with open(golden, "w") as g, open(bad, "w") as b:
    for t, lg in zip(tokens, logits):
      g.write(json.dumps({"tokens": t.tolist(), "logits": lg.tolist()}) + "\n")
      b.write(json.dumps({"tokens": t.tolist(), "logits": (lg + 1e-3).tolist()}) + "\n")
  check_logits.main(["check_logits.py", cfg, params, f"golden_logits_path={golden}"])  # within tolerance
  with pytest.raises(SystemExit) as e:
    check_logits.main(["check_logits.py", cfg, params, f"golden_logits_path={bad}", "atol=1e-4", "rtol=0"])
  assert e.value.code == 1


def test_bias_export_needs_a_class_with_that_flag():
  base = os.path.join(config.CONFIG_DIR, "base.yml")
  c = config.load([base, "run_name=t", "decoder_block=mistral", "mlp_bias=true"], {})
  with pytest.raises(ConfigError, match="mlp_bias=true has no Hugging Face export for decoder_block=mistral"):
    hf_config(c, "float32")
  exported = hf_config(c.replace(decoder_block="llama2"), "float32")
  assert exported["mlp_bias"] is True and exported["attention_bias"] is False


@pytest.mark.torch
@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_published_deepseek_configs_map_to_the_presets(preset):
  """config.json -> the preset's keys; RoPE frequencies, cos/sin factor and softmax scale as transformers'."""
  import transformers  # noqa: PLC0415 (the torch tier)

  hf = json.load(open(PUBLISHED[preset]))
  keys = hf_keys(hf)
  c = config.load([os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=t", f"model_name={preset}"], {})
  assert {k: v for k, v in keys.items() if k != "head_dim" and c[k] != v} == {}  # head_dim: unused by MLA
  hf_cfg = transformers.AutoConfig.for_model(**{**hf, "model_type": LOADS_AS.get(hf["model_type"], hf["model_type"])})
  model = getattr(transformers, hf_config(c, "bfloat16")["architectures"][0])
  assert model.config_class is type(hf_cfg)
  mc = ModelConfig.from_config(c)
  inv_freq, attention_factor = transformers.modeling_rope_utils._compute_yarn_parameters(hf_cfg)
  ours = embeddings.scaled_rope_frequencies(mc, c.qk_rope_head_dim, c.rope_max_timescale, c.rope_type)
  np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
  assert embeddings.rope_attention_factor(mc, c.rope_type) == pytest.approx(attention_factor, rel=1e-12)
  module = importlib.import_module(model.__module__)
  softmax_scale = module.yarn_apply_mscale(hf_cfg.rope_parameters, (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5)
  with nnx.use_eager_sharding(False):
    mla = nnx.eval_shape(lambda: attention_mla.MLAttention(mc, rngs=nnx.Rngs(0), plan=planner.build(c)))
  assert mla.query_scale == pytest.approx(softmax_scale, rel=1e-12)


def test_bfloat16_storage_restores_as_rounded_float32(tmp_path):
  """--dtype bfloat16 stores half the bytes; loading (either layer layout) casts back to the run's dtype."""
  _, hf_path = hf_model("llama2", tmp_path)
  full, half = os.path.join(tmp_path, "f32"), os.path.join(tmp_path, "bf16")
  hf_to_maxtext.convert(hf_path, full)
  hf_to_maxtext.main(["hf_to_maxtext.py", "--hf_path", hf_path, "--output", half, "--dtype", "bfloat16"])

  def params(out, *overrides):
    c = config.load([os.path.join(out, "config.yml"), "run_name=t", "dtype=float32", *overrides], {})
    abstract = nnx.state(nnx.eval_shape(lambda: models.build(c, nnx.Rngs(0), planner.build(c))), nnx.Param)
    return nnx.to_pure_dict(checkpointing.load_params(os.path.join(out, "params"), abstract))

  want = params(full)
  for got in (params(half), params(half, "scan_layers=false")):
    if 0 in got["layers"]:  # unrolled: restack to compare
      got = {**got, "layers": jax.tree.map(lambda *xs: np.stack(xs), *[got["layers"][i] for i in range(2)])}
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
      assert g.dtype == np.float32
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w).astype(jnp.bfloat16).astype(np.float32))


@pytest.mark.torch
@pytest.mark.parametrize("preset", ["llama4-17b-16e", "llama4-17b-128e"])
def test_llama4_presets_export_their_config_and_read_it_back(preset):
  """Scout and Maverick presets -> config.json -> the same architecture keys; per-layer lists that do not
  follow the intervals, and a multimodal model_type without its text/vision configs, are refused with the
  field named (llama4_vision_test converts the multimodal model)."""
  import transformers  # noqa: PLC0415 (the torch tier)

  c = config.load([os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=t", f"model_name={preset}"], {})
  hf = hf_config(c, "bfloat16")
  for key, value in hf_keys(hf).items():
    assert c[key] == value, key
  hf_cfg = transformers.Llama4TextConfig(**{k: v for k, v in hf.items() if k not in ("model_type", "architectures")})
  assert hf_keys(hf_cfg.to_dict()) == hf_keys(hf)  # with the derived lists
  with pytest.raises(ConfigError, match="moe_layers"):
    hf_keys({**hf, "moe_layers": [0]})
  with pytest.raises(ConfigError, match="text_config and vision_config"):
    hf_keys({**hf, "model_type": "llama4"})


@pytest.mark.torch
def test_deepseek32_preset_exports_its_config_and_reads_it_back():
  """deepseek32-671b -> a config.json transformers' DeepseekV32Config reads -> the same keys (indexer included);
  the indexer with V2's softmax router has no Hugging Face class; layer patterns we do not represent and a
  missing query latent are one-line errors."""
  import transformers  # noqa: PLC0415 (the torch tier)

  c = config.load([os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=t", "model_name=deepseek32-671b"], {})
  hf = hf_config(c, "bfloat16")
  assert hf["model_type"] == "deepseek_v32" and hf["index_topk"] == 2048
  assert {k: v for k, v in hf_keys(hf).items() if c[k] != v} == {}
  hf_cfg = transformers.DeepseekV32Config(**{k: v for k, v in hf.items() if k not in ("model_type", "architectures")})
  assert hf_keys(hf_cfg.to_dict()) == hf_keys(hf)
  with pytest.raises(ConfigError, match="deepseek_v32"):
    hf_config(c.replace(routed_score_func="softmax", routed_bias=False), "bfloat16")
  with pytest.raises(ConfigError, match="mlp_layer_types"):
    hf_keys({**hf, "mlp_layer_types": ["sparse"] * 61})
  with pytest.raises(ConfigError, match="layer_types"):
    hf_keys({**hf, "layer_types": ["full_attention"] * 61})
  with pytest.raises(ConfigError, match="q_lora_rank"):
    hf_keys({**hf, "q_lora_rank": None})
