"""The model description (layers/model_config.py): typed sections whose leaf fields are base.yml's model keys,
each declared once; its Literal choices checked when made and at load; what the layers read of it."""

import ast
import dataclasses
import os
import typing

import pytest
from flax import nnx

from MaxText import config, models, planner
from MaxText.errors import ConfigError
from MaxText.layers import lora, mlp
from MaxText.layers import model_config as mc
from MaxText.layers.model_config import ModelConfig
from MaxText.tests.conftest import BASE, ROOT, TINY

# Keys of base.yml's model sections that choose or scale the preset rather than describe a layer.
PRESET_KEYS = {"model_name", "override_model_config", "global_parameter_scale"}
# Settings that are the run's, not the model's: training, decoding, LoRA.
RUN_KEYS = {
  "max_target_length", "enable_dropout", "dropout_rate", "quantize_kvcache", "kv_quant_dtype",
  "freeze_vision_encoder", "lora_rank", "lora_alpha", "lora_target_modules", "lora_vision_target_modules",
}  # fmt: skip


def load(*overrides):
  return config.load([BASE, "run_name=t", *TINY, *overrides], {})


def model_sections() -> dict[str, str]:
  """Key -> its line, for every key under a `# ---- model...` header of base.yml."""
  keys, inside = {}, False
  for line in open(BASE):
    if line.startswith("# ----"):
      inside = line.strip("# -\n").startswith("model")
    elif inside and line[:1].isalpha() and ":" in line:
      keys[line.split(":")[0]] = line
  return keys


def test_every_leaf_field_is_a_commented_model_key_of_base_yml():
  """Each field is declared once: as a base.yml key of a model section (the base_* key of a derived size),
  with its comment there."""
  keys = model_sections()
  for field in mc.leaf_keys():
    key = field if field in keys else f"base_{field}"
    assert key in keys, f"{field} is not a key of base.yml's model sections"
    assert "  # " in keys[key], f"{key} has no comment in base.yml"
    assert key == field or field in config.DERIVED


def test_every_model_key_of_base_yml_is_a_field():
  leaves = set(mc.leaf_keys())
  for key in model_sections():
    known = key in leaves or key.removeprefix("base_") in leaves or key in mc.switches() or key in PRESET_KEYS
    assert known, f"base.yml's model key {key} is no ModelConfig field"


def test_run_settings_are_not_in_the_model_description():
  assert not RUN_KEYS & set(mc.leaf_keys())


@pytest.mark.parametrize(
  "section, change, message",
  [
    ("rope", {"rope_type": "ntk"}, "rope_type='ntk' is not one of 'default', 'llama3', 'linear', 'yarn'"),
    ("moe", {"capacity_group": "row"}, "capacity_group='row' is not one of"),
    ("moe", {"routed_score_func": "tanh"}, "routed_score_func='tanh' is not one of"),
    ("moe", {"routed_group_score": "sum"}, "routed_group_score='sum' is not one of"),
    ("mlp", {"mlp_activations": ("silu", "swish")}, "mlp_activations='swish' is not one of"),
    (None, {"decoder_block": "llama9"}, "decoder_block='llama9' is not one of"),
    (None, {"dtype": "int8"}, "dtype='int8' is not one of"),
    (None, {"weight_dtype": "float16"}, "weight_dtype='float16' is not one of"),
  ],
)
def test_choices_are_checked_when_a_section_is_made(section, change, message):
  m = ModelConfig.from_config(load())
  with pytest.raises(ConfigError, match=message):
    if section is None:
      dataclasses.replace(m, **change)
    else:
      dataclasses.replace(getattr(m, section), **change)


def test_config_checks_the_same_choices_at_load():
  """One list per choice: config.CHOICES takes the model keys' from the Literal types."""
  for key, kind in mc.leaf_keys().items():
    if typing.get_origin(kind) is typing.Literal and key != "decoder_block":
      assert config.CHOICES[key] == typing.get_args(kind)
  with pytest.raises(ConfigError, match="rope_type='ntk' is not one of"):
    load("rope_type=ntk")


def test_literal_names_match_the_tables_that_run_them():
  assert set(typing.get_args(mc.DecoderBlock)) == set(models.REGISTRY)
  assert set(typing.get_args(mc.Activation)) == set(mlp.ACTIVATIONS)


def test_vision_section_is_none_without_images():
  assert ModelConfig.from_config(load()).vision is None
  vision = ModelConfig.from_config(load("use_multimodal=true")).vision
  assert vision is not None and vision.llama4.rope_theta_for_vit == load().rope_theta_for_vit


def test_run_settings_reach_the_layers_through_the_plan_and_lora_config():
  assert planner.build(load("dropout_rate=0.25")).dropout_rate == 0.25
  assert planner.build(load("dropout_rate=0.25", "enable_dropout=false")).dropout_rate == 0.0
  assert planner.build(load("quantize_kvcache=true", "kv_quant_dtype=fp8")).kv_cache_quant == "fp8"
  assert planner.build(load()).kv_cache_quant == ""
  assert lora.LoraConfig.from_config(load()) is None
  adapters = lora.LoraConfig.from_config(load("lora_rank=4", "freeze_vision_encoder=false"))
  assert (adapters.rank, adapters.trace_length) == (4, load().max_target_length)
  assert adapters.vision_target_modules == load().lora_vision_target_modules
  assert lora.LoraConfig.from_config(load("lora_rank=4")).vision_target_modules is None  # a frozen tower


def _reads(tree: ast.AST) -> set[tuple[str, ...]]:
  """config.X and config.X.Y chains (config, c, unit_config, self.config, layer.config) read in a module."""
  out = set()
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute):
      continue
    owner = node.value
    is_config = isinstance(owner, ast.Name) and owner.id in ("config", "c", "unit_config")
    is_config |= isinstance(owner, ast.Attribute) and owner.attr == "config"
    if is_config and not node.attr.startswith("_") and node.attr != "from_config":
      out.add((node.attr,))
    elif isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id in ("config", "c"):
      out.add((owner.attr, node.attr))
  return out


def _valid(chain: tuple[str, ...]) -> bool:
  cls = ModelConfig
  for name in chain:
    fields = {f.name: mc._section_type(mc._hints(cls)[f.name]) for f in dataclasses.fields(cls)}
    if name not in fields:
      return False
    cls = fields[name]
    if cls is None:
      return True
  return True


def test_layers_read_only_the_model_config():
  """Every config key a layer or family reads (config.X, config.section.X, self.config.X) is a ModelConfig field,
  and the built model holds a ModelConfig, not the run's Config. quantization.py and lora.py transform the built
  model with the run's Config; models/__init__.py makes the ModelConfig from it."""
  bad = set()
  for d in ("layers", "models"):
    for f in sorted(os.listdir(os.path.join(ROOT, "MaxText", d))):
      if not f.endswith(".py") or f in ("quantization.py", "lora.py", "__init__.py"):
        continue
      bad |= {(f, *r) for r in _reads(ast.parse(open(os.path.join(ROOT, "MaxText", d, f)).read())) if not _valid(r)}
  assert not bad, sorted(bad)
  c = load()
  model = nnx.eval_shape(lambda: models.build(c, nnx.Rngs(params=0), planner.build(c)))
  assert type(model.config) is ModelConfig and model.config == ModelConfig.from_config(c)
