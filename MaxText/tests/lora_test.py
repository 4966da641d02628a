"""LoRA (layers/lora.py): only the adapters train and are checkpointed, the base stays bit-identical, the
merged model equals base + adapters, and the compiled step holds less than full fine-tuning."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import check_logits, checkpointing, optimizers, sharding, train, train_compile
from MaxText import state as state_lib
from MaxText import train_step as steps
from MaxText.convert import maxtext_to_hf
from MaxText.errors import ConfigError
from MaxText.inference import engine
from MaxText.layers import lora
from MaxText.tests.conftest import cfg, losses
from MaxText.tests.helpers import LORA, host_tree, leaf_names, learnable_batch, leaves_equal


def _setup(c):
  mesh = sharding.create_mesh(c)
  optimizer = optimizers.build(c)
  with sharding.activate(c, mesh):
    spec = state_lib.state_spec(c, optimizer.tx, mesh)
  return mesh, optimizer, spec


def _train(c, mesh, optimizer, spec, state, n):
  """n steps on the same batch; (state, losses)."""
  step_fn = steps.jit_train_step(c, mesh, optimizer.tx, spec, optimizer.schedule)
  batch = jax.device_put(learnable_batch(c), steps.batch_shardings(c, mesh))
  out = []
  with sharding.activate(c, mesh):
    for i in range(n):
      state, metrics = step_fn(state, batch, jax.random.key(i))
      out.append(float(metrics["loss"]))
  return state, out


def test_only_adapters_train_and_the_base_stays_bit_identical(tmp_path):
  c = cfg(tmp_path, "l", *LORA, "lora_random_base=true")
  mesh, optimizer, spec = _setup(c)
  with sharding.activate(c, mesh):
    state = state_lib.init_state(c, optimizer.tx, spec)
  before = host_tree(spec.partition.split(state.params))
  assert before.trainable and all("_lora_" in n for n in leaf_names(before.trainable))
  assert not any("_lora_" in n for n in leaf_names(before.frozen))
  state, losses = _train(c, mesh, optimizer, spec, state, 6)
  after = host_tree(spec.partition.split(state.params))
  assert losses[-1] < losses[0] - 0.05
  assert all(leaves_equal(before.frozen, after.frozen))
  assert not any(leaves_equal(before.trainable, after.trainable))  # every adapter moved
  # Adam's two moments per adapter, nothing for the base: optimizer state is adapter-shaped and adapter-sized.
  adapter_shapes = {x.shape for x in jax.tree.leaves(after.trainable)}
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
  assert {x.shape for x in moments} == adapter_shapes
  assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(after.trainable))


def test_the_state_spec_owns_the_trainable_split(tmp_path):
  """param_spec decides once what trains (state.Partition, hashable so the jitted step binds it): with LoRA
  the adapters, the base frozen; without, everything, and nothing is split off."""
  lora_spec = state_lib.param_spec(cfg(tmp_path, "p", *LORA))
  plain_spec = state_lib.param_spec(cfg(tmp_path, "q", *LORA, "lora_rank=0"))
  assert lora_spec.partition == state_lib.Partition(nnx.LoRAParam) and lora_spec.partition.freezes
  assert plain_spec.partition == state_lib.TRAIN_ALL and not plain_spec.partition.freezes
  assert hash(lora_spec.partition) == hash(state_lib.Partition(nnx.LoRAParam))
  trainable, frozen = plain_spec.partition.split(plain_spec.abstract)
  assert trainable is plain_spec.abstract and frozen is None
  assert plain_spec.partition.combine(trainable, frozen) is trainable
  adapters, base = lora_spec.partition.split(lora_spec.abstract)
  assert adapters and all("_lora_" in n for n in leaf_names(adapters))
  assert leaf_names(base) == leaf_names(plain_spec.abstract)
  whole = lora_spec.partition.combine(adapters, base)
  assert leaf_names(whole) == leaf_names(lora_spec.abstract)


@pytest.mark.slow  # over 40 s on 2 busy cores (2026-11-27)
def test_checkpoint_holds_adapters_only_and_resumes_onto_the_loaded_base(tmp_path):
  base_config = cfg(tmp_path, "base", "init_weights_seed=7")
  mesh = sharding.create_mesh(base_config)
  with sharding.activate(base_config, mesh):
    base = state_lib.init_params(base_config, state_lib.param_spec(base_config, mesh))
  base_path = os.path.join(tmp_path, "base_params")
  checkpointing.save_params(base_path, base)
  common = [*LORA, f"load_parameters_path={base_path}", "enable_checkpointing=true", "async_checkpointing=false"]
  c = cfg(tmp_path, "lora", *common)
  mesh, optimizer, spec = _setup(c)
  with sharding.activate(c, mesh), pytest.MonkeyPatch.context() as patch:  # no random base made to be replaced
    patch.setattr(state_lib, "init_state", lambda *_: pytest.fail("random init under load_parameters_path"))
    restored = checkpointing.restore_or_init(c, optimizer.tx, spec, None)
  assert restored.source == "load_parameters_path"
  frozen = spec.partition.split(restored.state.params).frozen
  assert all(leaves_equal(host_tree(frozen), host_tree(base)))
  with sharding.activate(c, mesh):
    drawn = state_lib.init_state(c, optimizer.tx, spec)  # the adapters and optimizer state a random start has
  adapters = [host_tree(spec.partition.trainable(s.params)) for s in (restored.state, drawn)]
  assert all(leaves_equal(*adapters)) and all(
    leaves_equal(host_tree(restored.state.opt_state), host_tree(drawn.opt_state))
  )
  state, _ = _train(c, mesh, optimizer, spec, restored.state, 2)
  manager = checkpointing.create_manager(c)
  checkpointing.save(manager, 2, spec.partition.checkpointed(state), {})
  checkpointing.finish(manager)
  saved = checkpointing.saved_tree(os.path.join(c.checkpoint_dir, "2", "state"))
  assert all(n.endswith(("_lora_a']['value']", "_lora_b']['value']")) for n in leaf_names(saved["params"]))
  expected = host_tree(state)
  manager = checkpointing.create_manager(c)
  with sharding.activate(c, mesh):
    resumed = checkpointing.restore_or_init(c, optimizer.tx, spec, manager)
  checkpointing.finish(manager)
  assert resumed.source == "resume from step 2"
  got = host_tree(resumed.state)
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  assert all(leaves_equal(got, expected))


@pytest.mark.slow
def test_train_saves_adapters_and_a_resumed_run_matches_an_uninterrupted_one(tmp_path):
  common = [*LORA, "lora_random_base=true", "enable_checkpointing=true", "async_checkpointing=false"]
  common += ["learning_rate_schedule_steps=4"]
  train.run(cfg(tmp_path, "split", "steps=2", *common))
  split = cfg(tmp_path, "split", "steps=4", *common)
  assert train.run(split)["steps_run"] == 2
  saved = checkpointing.saved_tree(os.path.join(split.checkpoint_dir, "4", "state"))
  assert all("_lora_" in n for n in leaf_names(saved["params"]))
  whole = cfg(tmp_path, "whole", "steps=4", *common)
  train.run(whole)
  assert losses(split) == losses(whole)  # bit-exact: same base, adapters, optimizer state and data order


def _logits(graphdef, params, tokens):
  b, t = tokens.shape
  model = nnx.merge(graphdef, params)
  return np.asarray(model(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), jnp.int32)))


@pytest.mark.parametrize("scan", ["true", pytest.param("false", marks=pytest.mark.slow)])
def test_merged_model_equals_base_plus_adapters(tmp_path, scan):
  c = cfg(tmp_path, "m", *LORA, "lora_random_base=true", f"scan_layers={scan}")
  plain = c.replace(lora_rank=0)
  mesh = sharding.create_mesh(c)
  with sharding.activate(c, mesh):
    spec, plain_spec = state_lib.param_spec(c, mesh), state_lib.param_spec(plain, mesh)
    params = state_lib.init_params(c, spec)
  # Fresh adapters are a no-op (B = 0): give them values so that merging has something to fold in.
  adapters, base = spec.partition.split(params)
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(adapters))))
  adapters = jax.tree.map(lambda x: 0.1 * jax.random.normal(next(keys), x.shape, x.dtype), adapters)
  tokens = jnp.asarray(learnable_batch(c)["inputs"])
  with sharding.activate(c, mesh):
    adapted = _logits(spec.graphdef, spec.partition.combine(adapters, base), tokens)
    merged = _logits(plain_spec.graphdef, lora.merged(c, spec.partition.combine(adapters, base)), tokens)
    base_only = _logits(plain_spec.graphdef, base, tokens)
  np.testing.assert_allclose(merged, adapted, atol=2e-5, rtol=2e-5)
  assert np.abs(adapted - base_only).max() > 1e-2  # the adapters did change the outputs


def test_export_merges_the_adapters_into_the_base(tmp_path):
  """maxtext_to_hf with lora_rank writes what exporting the merged params writes."""
  safetensors = pytest.importorskip("safetensors.numpy")
  c = cfg(tmp_path, "e", *LORA, "lora_random_base=true")
  mesh = sharding.create_mesh(c)
  with sharding.activate(c, mesh):
    spec = state_lib.param_spec(c, mesh)
    params = state_lib.init_params(c, spec)
  adapters, base = spec.partition.split(params)
  adapters = jax.tree.map(lambda x: x + 0.01, adapters)
  paths = {name: os.path.join(tmp_path, name) for name in ("base", "adapters", "merged")}
  checkpointing.save_params(paths["base"], base)
  checkpointing.save_params(paths["adapters"], adapters)
  checkpointing.save_params(paths["merged"], lora.merged(c, spec.partition.combine(adapters, base)))
  exported = c.replace(load_parameters_path=paths["base"], lora_weights_path=paths["adapters"])
  maxtext_to_hf.convert(exported, os.path.join(tmp_path, "hf_lora"))
  maxtext_to_hf.convert(c.replace(lora_rank=0, load_parameters_path=paths["merged"]), os.path.join(tmp_path, "hf"))
  for name in sorted(os.listdir(os.path.join(tmp_path, "hf"))):
    if name.endswith(".safetensors"):
      want, got = (safetensors.load_file(os.path.join(tmp_path, d, name)) for d in ("hf", "hf_lora"))
      assert want.keys() == got.keys()
      for k in want:  # merged on one device here, sharded over eight above: the sums may round differently
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)
  with pytest.raises(ConfigError, match="lora_weights_path"):
    maxtext_to_hf.convert(c.replace(load_parameters_path=paths["base"]), os.path.join(tmp_path, "x"))


def test_other_families_build_with_adapters(tmp_path):
  """Gemma 2's alternating blocks and Mixtral's MoE layers (whose dummy call records a load-balance loss)."""
  moe = ["decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2"]
  for extra, where in ((["decoder_block=gemma2"], "['sublayers'][1]['mlp']"), (moe, "['self_attention']['query']")):
    abstract = state_lib.param_spec(cfg(tmp_path, "f", "lora_rank=4", *extra)).abstract
    assert any(where in n and "kernel_lora_b" in n for n in leaf_names(abstract))


def test_bad_setups_fail_in_one_line(tmp_path):
  with pytest.raises(ConfigError, match="matches no projection of a decoder layer") as e:
    state_lib.param_spec(cfg(tmp_path, "r", "lora_rank=4", "lora_target_modules=attention/q"))
  assert "\n" not in str(e.value) and "self_attention/query" in str(e.value)  # the paths it could have named
  c = cfg(tmp_path, "b", *LORA)
  mesh, optimizer, spec = _setup(c)
  with pytest.raises(ConfigError, match="set load_parameters_path"):
    checkpointing.restore_or_init(c, optimizer.tx, spec, None)
  with pytest.raises(ConfigError, match="lora_alpha"):
    state_lib.param_spec(cfg(tmp_path, "a", "lora_rank=4", "lora_alpha=0"))


@pytest.mark.slow
def test_compiled_step_holds_less_than_full_fine_tuning(tmp_path):
  """The AOT memory report (train_compile) on the local CPU topology: LoRA's state (arguments) is the frozen
  base plus small adapters and their moments, where full fine-tuning carries two moments per parameter."""
  wide = ["base_emb_dim=256", "base_mlp_dim=1024", "base_num_query_heads=8", "base_num_kv_heads=8", "head_dim=32"]
  wide += ["compile_topology=cpu", "per_device_batch_size=1", "dtype=bfloat16"]  # adapters stay float32
  reports = {}
  for name, extra in (("full", []), ("lora", ["lora_rank=4"])):
    c = cfg(tmp_path, name, *wide, *extra)
    _, reports[name], _ = train_compile.compile_train_step(c, train_compile.topology_devices(c))
  full, low = reports["full"], reports["lora"]
  assert low.argument_bytes < 0.5 * full.argument_bytes  # about 1/3: params + 2 moments -> params
  assert low.total_bytes < full.total_bytes


def test_decode_merges_the_adapters_at_load(tmp_path):
  """decode / check_logits with lora_rank and lora_weights_path serve what the merged (exported) params serve
  without LoRA: same greedy tokens and log-probabilities, same logits; the served model has no adapters."""
  c = cfg(tmp_path, "d", *LORA, "lora_random_base=true")
  mesh = sharding.create_mesh(c)
  with sharding.activate(c, mesh):
    spec = state_lib.param_spec(c, mesh)
    params = state_lib.init_params(c, spec)
  adapters, base = spec.partition.split(params)
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(adapters))))
  adapters = jax.tree.map(lambda x: 0.1 * jax.random.normal(next(keys), x.shape, x.dtype), adapters)
  paths = {name: os.path.join(tmp_path, name) for name in ("base", "adapters", "merged")}
  checkpointing.save_params(paths["base"], base)
  checkpointing.save_params(paths["adapters"], adapters)
  checkpointing.save_params(paths["merged"], lora.merged(c, spec.partition.combine(adapters, base)))
  served = c.replace(lora_random_base=False, load_parameters_path=paths["base"], lora_weights_path=paths["adapters"])
  exported = c.replace(lora_rank=0, lora_random_base=False, load_parameters_path=paths["merged"])
  prompt = [3, 1, 4, 1, 5, 9, 2, 6]
  runs = []
  for config in (served, exported):
    graphdef, params, source = engine.load_params(config, mesh)
    assert not any("_lora_" in n for n in leaf_names(params))
    decoder = engine.Engine(config, mesh, graphdef, params, None, source)
    out = decoder.generate([prompt], 8, strategy="greedy", logprobs=True)
    runs.append((out.completions[0], check_logits.model_logits(config)(np.asarray(prompt))))
  (got, got_logits), (want, want_logits) = runs
  assert got.tokens == want.tokens and len(got.tokens) == 8
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
  np.testing.assert_allclose(got_logits, want_logits, atol=1e-5, rtol=1e-5)
  # int8w quantizes the merged kernels: the same int8 weights as quantizing the exported params.
  int8 = [engine.load_params(x.replace(quantization="int8w"), mesh)[1] for x in (served, exported)]
  pairs = list(zip(*(jax.tree.leaves(host_tree(x)) for x in int8), strict=True))
  assert any(w.dtype == np.int8 for w, _ in pairs)
  for got_w, want_w in pairs:  # merged under two shardings: a kernel may round to the neighbouring int8 step
    atol = 1 if want_w.dtype == np.int8 else 1e-8
    np.testing.assert_allclose(got_w.astype(np.float32), want_w.astype(np.float32), rtol=1e-5, atol=atol)
  with pytest.raises(ConfigError, match="set lora_weights_path") as e:
    engine.load_params(served.replace(lora_weights_path=""), mesh)
  assert "\n" not in str(e.value)
