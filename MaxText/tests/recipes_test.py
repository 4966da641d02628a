"""Named experiments: `train.py quickstart`, `train.py v5e/16b` resolve in configs/ from any directory; every
shipped recipe loads, its mesh and batch fit its target topology, and (slow tier) its train step compiles
ahead of time for that topology in a reduced form: the recipe's batch, remat, attention and parallelism
with a one-layer, narrow model on 128-token sequences, so each compile takes seconds rather than minutes."""

import os

import pytest

from MaxText import config, sharding, train_compile
from MaxText.errors import ConfigError
from MaxText.tests.conftest import reduced_tpu_model

# recipe -> (compile_topology, compile_topology_num_slices) it is published for
TPU_RECIPES = {
  "v5e/16b": ("v5e-256", 2),
  "v5e/llama2-7b": ("v5e-256", 1),
  "v5p/32b": ("v5p-128", 1),
  "v5p/llama2-7b": ("v5p-512", 1),
  "v6e/llama2-7b": ("v6e-256", 1),
}
OTHER_RECIPES = ("quickstart", "cpu/smoke", "gpu/a3mega-llama2-7b")
# conftest.reduced_tpu_model: the recipe's own step (batch per chip, remat, attention, parallelism, dtypes) on a
# one-layer D=256 model (the narrowest the recipes' fsdp 256 divides) over 128-token sequences. The five compiles took
# 234 CPU-seconds at D=512 and 1024 tokens, 57 now (2-core AMD EPYC), a third of it v6e/llama2-7b's (12 rows per chip).
REDUCED = reduced_tpu_model(256)


def load(name, tmp_path, *overrides):
  return config.load([name, f"base_output_directory={tmp_path}", *overrides], {})


def test_the_shipped_recipes_are_listed_by_name():
  assert set(config.recipes()) >= {*TPU_RECIPES, *OTHER_RECIPES}
  assert "base" not in config.recipes() and not any(r.startswith("models/") for r in config.recipes())


def test_a_recipe_name_resolves_in_configs_from_any_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert load("quickstart", tmp_path).run_name == "quickstart"
  assert config.resolve_config_path("v5e/16b") == os.path.join(config.CONFIG_DIR, "v5e", "16b.yml")
  assert config.resolve_config_path("v5e/16b.yml") == os.path.join(config.CONFIG_DIR, "v5e", "16b.yml")
  path = tmp_path / "mine.yml"
  path.write_text("steps: 3\n")
  assert load(str(path), tmp_path).steps == 3  # a file path wins over a recipe name


def test_an_unknown_name_lists_the_recipes_and_suggests_one(tmp_path):
  with pytest.raises(ConfigError, match=r"does not exist.*did you mean 'quickstart'\?.*v5e/16b"):
    load("quickstrat", tmp_path)


@pytest.mark.parametrize("name", OTHER_RECIPES)
def test_other_recipes_load(tmp_path, name):
  load(name, tmp_path)


def test_a3mega_recipe_keeps_maxtexts_gpu_settings(tmp_path):
  c = load("gpu/a3mega-llama2-7b", tmp_path)
  assert (c.remat_policy, c.attention, c.hardware, c.scan_layers) == ("minimal_flash", "cudnn_flash_te", "gpu", False)
  # MaxText's reference command line for the same run loads as it is written (the tokenizer is unused on
  # synthetic data, so MaxText's assets/tokenizer.llama2 path need not exist).
  c = config.load([
    "MaxText/configs/base.yml", "model_name=llama2-7b", "hardware=gpu", "steps=30", "per_device_batch_size=4",
    "max_target_length=4096", "attention=cudnn_flash_te", "remat_policy=minimal_flash", "use_iota_embed=true",
    "scan_layers=false", "dataset_type=synthetic", "enable_checkpointing=false", "async_checkpointing=false",
    "tokenizer_path=assets/tokenizer.llama2", f"base_output_directory={tmp_path}", "run_name=a3",
  ], {})  # fmt: skip
  assert c.remat_policy == "minimal_flash"


@pytest.mark.parametrize("name", sorted(TPU_RECIPES))
def test_tpu_recipes_fit_their_topology_mesh_and_batch(tmp_path, name):
  topology, slices = TPU_RECIPES[name]
  c = load(name, tmp_path, f"compile_topology={topology}", f"compile_topology_num_slices={slices}")
  devices = train_compile.topology_devices(c)
  mesh = sharding.create_mesh(c, devices)
  assert sharding.global_batch_size(c, mesh) == int(c.per_device_batch_size * len(devices))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TPU_RECIPES))
def test_tpu_recipes_compile_ahead_of_time_in_reduced_form(tmp_path, name):
  """In this process (libtpu compiles for the topology; nothing runs), which spares each case a fresh
  interpreter and libtpu start-up."""
  topology, slices = TPU_RECIPES[name]
  c = load(name, tmp_path, f"compile_topology={topology}", f"compile_topology_num_slices={slices}", *REDUCED)
  devices = train_compile.topology_devices(c)
  _, report, mesh = train_compile.compile_train_step(c, devices)
  assert mesh.devices.size == len(devices)
  assert slices == 1 or mesh.shape["data"] == slices  # data parallel over the slices (DCN), fsdp within each
  assert any(line.startswith("attention: flash") for line in report.plan), report.plan  # kept at 128 tokens
  train_compile.check_fits(c, report, devices[0].platform)  # raises OutOfMemoryError when it does not fit


def test_a_missing_tokenizer_on_real_data_points_to_conversion_or_training(tmp_path):
  with pytest.raises(ConfigError, match=r"assets/tokenizer.llama2.*hf_to_maxtext.*train_tokenizer"):
    load("quickstart", tmp_path, "tokenizer_path=assets/tokenizer.llama2")
