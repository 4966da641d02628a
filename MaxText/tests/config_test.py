"""Config loading: layering, types, unknown keys, presets, derived values, immutability."""

import glob
import importlib
import os

import pytest
import yaml

from MaxText import config
from MaxText.errors import ConfigError

pytestmark = pytest.mark.quick  # the whole module is in the quick tier

BASE = os.path.join(config.CONFIG_DIR, "base.yml")


def load(*overrides, environ=None):
  return config.load([BASE, "run_name=t", *overrides], environ or {})


def test_overrides_are_parsed_to_the_default_type():
  c = load("steps=7", "learning_rate=1e-3", "scan_layers=false", "dtype=float32", "per_device_batch_size=2")
  assert (c.steps, c.learning_rate, c.scan_layers, c.dtype) == (7, 1e-3, False, "float32")
  assert isinstance(c.per_device_batch_size, float)


@pytest.mark.parametrize("arg", ["steps=abc", "scan_layers=maybe", "learning_rate=fast", "mlp_activations=silu"])
def test_bad_types_fail(arg):
  with pytest.raises(ConfigError, match=arg.split("=")[0]):
    load(arg)


def test_unknown_key_suggests_the_right_one():
  with pytest.raises(ConfigError, match="did you mean 'ici_fsdp_parallelism'"):
    load("ici_fsdp_parallelizm=2")


def test_bad_choice_lists_the_choices():
  with pytest.raises(ConfigError, match="remat_policy='fast' is not one of"):
    load("remat_policy=fast")


def test_environment_overrides_after_command_line():
  c = load("steps=5", environ={"M_STEPS": "9", "M_UNRELATED_THING": "x"})
  assert c.steps == 9


def test_model_preset_and_conflicts():
  c = load("model_name=llama2-70b")
  assert (c.emb_dim, c.num_kv_heads, c.num_decoder_layers) == (8192, 8, 80)
  with pytest.raises(ConfigError, match="override_model_config=true"):
    load("model_name=llama2-7b", "base_emb_dim=1024")
  assert load("model_name=llama2-7b", "base_emb_dim=1024", "override_model_config=true").emb_dim == 1024
  assert load("model_name=llama2-7b", "base_emb_dim=4096").emb_dim == 4096  # same value: no conflict
  with pytest.raises(ConfigError, match="llama2-7b"):
    load("model_name=llama2-7c")


def test_global_parameter_scale_derives_dims():
  c = load("global_parameter_scale=16")
  assert (c.emb_dim, c.num_query_heads, c.mlp_dim, c.num_decoder_layers) == (4096, 64, 28672, 32)
  with pytest.raises(ConfigError, match="power of 2"):
    load("global_parameter_scale=3")
  with pytest.raises(ConfigError, match="derived"):
    load("emb_dim=3")


def test_output_paths_are_derived(tmp_path):
  c = load(f"base_output_directory={tmp_path}")
  assert c.run_dir == os.path.join(str(tmp_path), "t")
  assert c.metrics_file == os.path.join(c.run_dir, "metrics.jsonl")
  assert c.checkpoint_dir == os.path.join(c.run_dir, "checkpoints")
  assert not os.path.exists(c.run_dir), "loading a config must not create directories"


def test_config_is_frozen_and_replace_recomputes():
  c = load()
  with pytest.raises(AttributeError, match="frozen"):
    c.steps = 3
  d = c.replace(base_emb_dim=512)
  assert (c.emb_dim, d.emb_dim) == (2048, 512)


def test_base_config_inheritance(tmp_path):
  child = tmp_path / "child.yml"
  child.write_text("base_config: base.yml\nsteps: 11\n")  # not next to the file: found in configs/
  assert config.load([str(child)], {}).steps == 11
  (tmp_path / "mid.yml").write_text("base_config: base.yml\nsteps: 12\nlog_period: 3\n")
  (tmp_path / "leaf.yml").write_text("base_config: mid.yml\nsteps: 13\n")  # relative to the file
  c = config.load([str(tmp_path / "leaf.yml")], {})
  assert (c.steps, c.log_period) == (13, 3)


def test_missing_paths_fail_early(tmp_path):
  with pytest.raises(ConfigError, match="load_parameters_path"):
    load(f"load_parameters_path={tmp_path}/nope")
  with pytest.raises(ConfigError, match="does not exist"):
    config.load([str(tmp_path / "missing.yml")], {})


# Recipes whose header says which paths to give on the command line: they load once those are given (files
# named here are created empty in tmp_path; loading checks that they exist, not what they hold).
RECIPE_FILES = {
  "cpu/sft.yml": {"dataset_path": "chat.jsonl", "tokenizer_path": "tokenizer.json"},
  "cpu/dpo.yml": {"dataset_path": "prefs.jsonl", "tokenizer_path": "tokenizer.json"},
}


YAMLS = sorted(glob.glob(os.path.join(config.CONFIG_DIR, "**", "*.yml"), recursive=True))


@pytest.mark.parametrize("path", YAMLS + sorted(config.presets().values()))
def test_every_yaml_loads(path, tmp_path):
  if os.path.dirname(path).endswith("presets"):
    c = load(f"model_name={os.path.basename(path)[:-4]}")
  else:
    files = RECIPE_FILES.get(os.path.relpath(path, config.CONFIG_DIR), {})
    for name in files.values():
      (tmp_path / name).touch()
    c = config.load([path, *(f"{key}={tmp_path / name}" for key, name in files.items())], {})
  assert c.emb_dim > 0


def test_choice_sets_agree_with_the_registries_that_implement_them():
  """config.CHOICES is checked at load; each set must be exactly what the code behind it accepts."""
  from MaxText import models
  from MaxText.data import tokenizer
  from MaxText.inference import sampling
  from MaxText.layers import kv_cache, moe, quantization

  implemented = {
    "tokenizer_type": set(tokenizer.LOADERS),
    "decode_sampling_strategy": set(sampling.STRATEGIES),
    "capacity_group": set(moe.CAPACITY_GROUPS),
    "quantization": set(quantization.MODES),
    "kv_quant_dtype": set(kv_cache.QUANT_DTYPES),
  }
  for key, names in implemented.items():
    assert set(config.CHOICES[key]) == names, key
  # dataset_type is declared once, with its backends (config.DATASET_BACKENDS); each module reads its type
  for name, module in config.DATASET_BACKENDS.items():
    assert callable(importlib.import_module(module).make_iterators), name
  blocks = {config.load([BASE, f"model_name={name}"]).decoder_block for name in config.presets()}
  assert blocks <= set(models.REGISTRY), blocks - set(models.REGISTRY)


def test_serving_config_is_the_plain_model_of_a_lora_fine_tune():
  c = load("lora_rank=4", "lora_weights_path=/a")
  served = config.serving_config(c)
  assert (served.lora_rank, served.lora_weights_path) == (0, "")
  changed = {k for k, v in served.to_dict().items() if c.to_dict()[k] != v}
  assert changed == {"lora_rank", "lora_weights_path"}


def _saved(tmp_path, c):
  """c written as train.py writes a run's config.yml: every resolved key, derived ones included."""
  path = tmp_path / "config.yml"
  path.write_text(yaml.safe_dump(c.to_dict(), sort_keys=True))
  return str(path)


def test_a_runs_saved_config_loads_back_as_the_same_config(tmp_path):
  c = load(f"base_output_directory={tmp_path}", "model_name=qwen3-0.6b", "steps=7", "learning_rate=1e-3")
  assert config.load([_saved(tmp_path, c)], {}).to_dict() == c.to_dict()


def test_a_saved_config_keeps_what_override_model_config_changed(tmp_path):
  c = load("model_name=llama2-7b", "base_num_decoder_layers=2", "override_model_config=true")
  again = config.load([_saved(tmp_path, c)], {})
  assert (again.num_decoder_layers, again.emb_dim) == (2, 4096)  # the preset is not applied over the run's values
  with pytest.raises(ConfigError, match="override_model_config"):  # a preset's key still needs the flag
    config.load([_saved(tmp_path, load("model_name=llama2-7b")), "base_emb_dim=64"], {})


def test_a_saved_config_recomputes_its_derived_keys_from_the_command_line(tmp_path):
  c = load(f"base_output_directory={tmp_path}", "run_name=first")
  again = config.load([_saved(tmp_path, c), "run_name=second", "base_emb_dim=64"], {})
  assert again.run_dir == str(tmp_path / "second") and again.metrics_file == str(tmp_path / "second/metrics.jsonl")
  assert again.emb_dim == 64
  own = load(f"base_output_directory={tmp_path}", "metrics_file=/elsewhere/m.jsonl")
  assert config.load([_saved(tmp_path, own), "run_name=x"], {}).metrics_file == "/elsewhere/m.jsonl"


def test_derived_keys_stay_errors_on_the_command_line(tmp_path):
  with pytest.raises(ConfigError, match="checkpoint_dir is derived"):
    load(f"checkpoint_dir={tmp_path}")


@pytest.mark.parametrize(
  "arg, match",
  [
    ("images_per_row=0", "images_per_row >= 1"),
    ("image_tiles_per_row=-1", "image_tiles_per_row >= 0"),
    ("max_image_tiles=0", "max_image_tiles=0: an image needs at least one tile"),
  ],
)
def test_bad_image_keys_fail_at_load_with_use_multimodal(arg, match):
  with pytest.raises(ConfigError, match=match):
    load("model_name=llama4-17b-16e", "use_multimodal=true", arg)
  load("model_name=llama4-17b-16e", arg)  # text only: the image keys are not read


def test_multimodal_sft_needs_an_images_column(tmp_path):
  (tmp_path / "tokenizer.json").write_text("{}")
  sft = ["use_sft=true", f"dataset_path={tmp_path}/*.jsonl", "tokenizer_type=huggingface"]
  sft.append(f"tokenizer_path={tmp_path}/tokenizer.json")
  with pytest.raises(ConfigError, match="needs sft_images_column"):
    load("model_name=gemma3-4b", "use_multimodal=true", "sft_images_column=", *sft)


@pytest.mark.parametrize(
  "args, match",
  [
    (["global_head_dim=-1"], "global_head_dim must be >= 0"),
    (["global_num_kv_heads=-2"], "global_num_kv_heads must be >= 0"),
    (["global_num_kv_heads=3"], r"multiple of global_num_kv_heads \(3\)"),
    (["num_kv_shared_layers=-1"], "num_kv_shared_layers must be >= 0"),
    (["hidden_size_per_layer_input=-3"], "hidden_size_per_layer_input must be >= 0"),
    (["hidden_size_per_layer_input=4", "vocab_size_per_layer_input=0"], "vocab_size_per_layer_input must be > 0"),
  ],
)
def test_gemma4_keys_refuse_bad_values_in_one_line(args, match):
  with pytest.raises(ConfigError, match=match):
    load("decoder_block=gemma4", *args)
