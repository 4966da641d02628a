"""Pipeline parallelism (layers/pipeline.py): the pipelined step computes the unpipelined step's losses
and gradients, with the same parameters, on 8 CPU devices; bad pipeline settings fail with ConfigError."""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import config, planner, sharding, state, train
from MaxText.errors import ConfigError
from MaxText.objectives import lm
from MaxText.parallel import plan as plan_lib
from MaxText.tests.conftest import FULLSIZE, cfg, cpu_subprocess_env, family_tiers, free_port, losses, reduced_tpu_model
from MaxText.tests.helpers import compile_command, reported_gib

BASE = os.path.join(config.CONFIG_DIR, "base.yml")
TINY = [
  "base_emb_dim=32",
  "base_num_query_heads=4",
  "base_num_kv_heads=2",
  "base_mlp_dim=48",
  "head_dim=8",
  "vocab_size=128",
  "dtype=float32",
  "max_target_length=16",
  "dataset_type=synthetic",
]


def load(*overrides):
  return config.load([BASE, "run_name=t", *TINY, *overrides], {})


def batch(rows: int, length: int, vocab: int, seed: int = 0) -> dict:
  """Random tokens in two packed documents per row, with some padding, so segment ids matter."""
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(1, vocab, (rows, length)), jnp.int32)
  cut = length // 2
  segments = np.ones((rows, length), np.int32)
  segments[:, cut:] = 2
  segments[::3, -3:] = 0  # padding
  positions = np.concatenate([np.arange(cut), np.arange(length - cut)])
  out = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
  out["inputs_segmentation"] = out["targets_segmentation"] = jnp.asarray(segments)
  out["inputs_position"] = jnp.asarray(np.broadcast_to(positions, (rows, length)))
  return out


def loss_and_grads(c, params, data, devices=None):
  """Summed loss and its gradients under c's mesh (over the first `devices` devices; default all), with params
  placed in c's shardings."""
  mesh = sharding.create_mesh(c, jax.devices()[:devices])
  spec = state.param_spec(c, mesh)
  with sharding.activate(c, mesh):
    placed = jax.device_put(params, spec.shardings)
    fn = jax.jit(jax.value_and_grad(lambda p, b: lm.loss_sums(spec.graphdef, c, p, b, None)[0]))
    return fn(placed, data)


@functools.cache
def unpipelined(reference: tuple, rows: int, layers: int, extra: tuple, devices: int | None = None):
  """The reference config's parameters (on the host), batch, loss and gradients; computed once per module for
  the cases that share them (several schedules pipeline the same 4- and 8-layer stacks)."""
  base = load(f"base_num_decoder_layers={layers}", *extra, *reference)
  mesh = sharding.create_mesh(base, jax.devices()[:devices])
  params = jax.device_get(state.init_params(base, state.param_spec(base, mesh)))
  data = batch(rows, base.max_target_length, base.vocab_size)
  want_loss, want_grads = loss_and_grads(base, params, data, devices)
  return params, data, float(want_loss), jax.device_get(want_grads)


def check_same(reference, *overrides, rows=8, layers=4, extra=(), keep=True, devices=(None, None)):
  """The loss and gradients of the pipelined config (overrides) equal the unpipelined one's. keep=False: not
  cached for later cases (a large model's host copies would stay in the worker's memory to its end). devices:
  how many devices the reference and the pipelined meshes take (None: all 8)."""
  compute = unpipelined if keep else unpipelined.__wrapped__
  params, data, want_loss, want_grads = compute(tuple(reference), rows, layers, tuple(extra), devices[0])
  piped = load(f"base_num_decoder_layers={layers}", *extra, *overrides)
  got_loss, got_grads = loss_and_grads(piped, params, data, devices[1])
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
  for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    # Summed (not averaged) gradients: float32 noise from another reduction order scales with their size.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize(
  "stages, micro, repeats",
  [(2, 2, 1), (2, 4, 2), (4, 4, 1), (4, 8, 2), (2, 8, 1)],
)
def test_pipelined_loss_and_grads_equal_unpipelined(stages, micro, repeats):
  layers = stages * repeats * (1 if stages == 4 else 2)
  check_same(
    ["ici_fsdp_parallelism=-1"],
    f"ici_pipeline_parallelism={stages}",
    "ici_fsdp_parallelism=-1",
    f"num_pipeline_microbatches={micro}",
    f"num_pipeline_repeats={repeats}",
    layers=layers,
  )


def test_schedule_and_bubble():
  c = load("ici_pipeline_parallelism=4", "num_pipeline_microbatches=8", "num_pipeline_repeats=2")
  sched = planner.schedule(c)
  assert sched == plan_lib.Schedule(stages=4, microbatches=8, repeats=2)
  assert sched.iterations == 19 and sched.bubble == pytest.approx(3 / 19)
  assert any("bubble 15.8%" in line for line in planner.describe(planner.build(c), c))
  assert planner.schedule(load()) is None and planner.build(load()).pipeline is None
  assert not any("pipeline" in line for line in planner.describe(planner.build(load()), load()))
  assert planner.schedule(load("ici_pipeline_parallelism=2")).microbatches == 2  # -1: one per stage


def test_bad_pipeline_settings_raise_config_error():
  with pytest.raises(ConfigError, match="do not split into 4 stages"):
    planner.build(load("ici_pipeline_parallelism=4", "base_num_decoder_layers=6"))
  with pytest.raises(ConfigError, match="scan_layers=true"):
    load("ici_pipeline_parallelism=2", "scan_layers=false")
  with pytest.raises(ConfigError, match="microbatches >= the 4 stages"):
    load("ici_pipeline_parallelism=4", "num_pipeline_microbatches=2", "num_pipeline_repeats=2")
  with pytest.raises(ConfigError, match="pipeline_parallel_layers"):
    load("ici_pipeline_parallelism=2", "pipeline_parallel_layers=40")
  with pytest.raises(ConfigError, match="not -1"):
    load("ici_pipeline_parallelism=-1")


def test_moe_stack_pipelines():
  """Dropless MoE (the shard_map dispatch runs vmapped over stages) with expert and data sharding."""
  moe = ["num_experts=4", "num_experts_per_tok=2"]  # the balance loss is per microbatch: not equal
  check_same(
    ["ici_fsdp_parallelism=-1"],
    "ici_pipeline_parallelism=2",
    "ici_fsdp_parallelism=-1",
    "num_pipeline_microbatches=4",
    extra=moe,
  )


def run_losses(tmp_path, name, *overrides):
  c = cfg(tmp_path, name, "steps=3", "per_device_batch_size=2", *overrides)
  train.run(c)
  return losses(c)


PP2 = ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=-1"]


@pytest.mark.slow
def test_train_losses_with_remat_accumulation_and_sharding_inside_stages(tmp_path):
  """The real train loop, pipelined over 2 stages, against data/fsdp parallelism: per-step float32
  losses equal within 1e-5 under remat policies, gradient accumulation and fsdp/tensor in a stage. Each remat
  policy rides on a run that checks something else too (a run is a compile: ~6 CPU-seconds), as in train_test."""
  ref = run_losses(tmp_path, "ref", "ici_fsdp_parallelism=8")
  variants = {
    "pp2_minimal": [*PP2, "num_pipeline_microbatches=4", "remat_policy=minimal"],
    "pp2_tp2_save_dot_except_mlp": ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"]
    + ["remat_policy=save_dot_except_mlp"],
    "pp2_accum_none": [*PP2, "gradient_accumulation_steps=2", "remat_policy=none"],
    "pp2_offloaded": [*PP2, "remat_policy=minimal_offloaded"],
    # remat_policy=full (base.yml's) pipelined: test_checkpoints_move_between_pipelined_and_unpipelined_runs
  }
  for name, overrides in variants.items():
    np.testing.assert_allclose(run_losses(tmp_path, name, *overrides), ref, rtol=1e-5, err_msg=name)


@pytest.mark.slow
def test_checkpoints_move_between_pipelined_and_unpipelined_runs(tmp_path):
  """The parameter layout is the same with and without pipelining: a run checkpointed pipelined resumes
  unpipelined and the other way round, with the losses of an uninterrupted run."""
  common = ["enable_checkpointing=true", "checkpoint_period=2", "async_checkpointing=false"]
  common += ["learning_rate_schedule_steps=4"]
  ref = run_losses(tmp_path, "ref", "steps=4", "ici_fsdp_parallelism=8", *common)
  for name, first, second in (("to_flat", PP2, ["ici_fsdp_parallelism=8"]), ("to_pp", ["ici_fsdp_parallelism=8"], PP2)):
    run_losses(tmp_path, name, "steps=2", *first, *common)
    resumed = run_losses(tmp_path, name, "steps=4", *second, *common)  # metrics.jsonl gains steps 3-4
    np.testing.assert_allclose(resumed, ref, rtol=1e-5, err_msg=name)


# The reference tiny configs (vocabulary cut to 1024 and sequences to 16 tokens: neither plays a part in
# pipelining; at 64 tokens a pipelined step of the llama2 one ran 7 s on 2 CPU cores), with a second layer where
# they have one, so that two stages hold a layer each. Their loss and gradients over 2 stages (2 devices) equal one
# device's, as in check_same. Not over all 8: on fake CPU devices fsdp's all-gathers and reduce-scatters of their
# 78M parameters are copies of the whole model per device, and were most of these tests' time (11 CPU-s per loss
# and gradients over fsdp 8, 3 on one device). Sharding inside stages and the real train loop pipelined
# (optimizer, remat, accumulation) are test_train_losses_with_remat_accumulation_and_sharding_inside_stages's.
REFERENCE = {
  "llama2": ["decoder_block=llama2", "base_emb_dim=1024", "base_num_query_heads=8", "base_num_kv_heads=8"]
  + ["base_mlp_dim=11008", "base_num_decoder_layers=2", "head_dim=128"],
  "mixtral": ["decoder_block=mistral", "base_emb_dim=1024", "base_num_query_heads=2", "base_num_kv_heads=2"]
  + ["base_mlp_dim=896", "base_num_decoder_layers=2", "head_dim=16", "num_experts=8", "num_experts_per_tok=2"],
  "mistral": ["decoder_block=mistral", "base_emb_dim=2048", "base_num_query_heads=1", "base_num_kv_heads=1"]
  + ["base_mlp_dim=896", "base_num_decoder_layers=2", "head_dim=8"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_reference_tiny_configs_pipelined(name):
  # Through the train loop (2 steps, fsdp then pipelined) the three took 131 CPU-s; over fsdp 8 70 (alone, 2026-11-28).
  extra = [*REFERENCE[name], "vocab_size=1024"]
  check_same(["ici_fsdp_parallelism=1"], *PP2, rows=8, layers=2, extra=extra, keep=False, devices=(1, 2))


MLA = ["q_lora_rank=0", "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=8", "v_head_dim=8"]
FAMILIES = {
  # gemma2: 2 units of (local, global); gemma3: 2 units of (5 local, 1 global); deepseek: 2 dense + 2 MoE.
  "gemma2": (4, ["decoder_block=gemma2", "sliding_window_size=4"]),
  "gemma3": (12, ["decoder_block=gemma3", "sliding_window_size=4"]),
  "deepseek": (4, ["decoder_block=deepseek", "num_experts=4", "num_experts_per_tok=2", "first_num_dense_layers=2"]),
  # 5 layers: the 2 whole (local, global) units are pipelined, the remainder layer runs after them.
  "gemma2_partial": (5, ["decoder_block=gemma2", "sliding_window_size=4", "pipeline_parallel_layers=4"]),
}


# The fast tier (and so the whole suite): whole units with a remainder after them (gemma2_partial) and two stacks
# (deepseek); the nightly tier the others.
@pytest.mark.parametrize("family", family_tiers(sorted(FAMILIES), ("deepseek", "gemma2_partial"), reference=False))
def test_family_stacks_pipeline(family):
  layers, extra = FAMILIES[family]
  extra = [*extra, *MLA] if "deepseek" in family else extra
  check_same(["ici_fsdp_parallelism=-1"], *PP2, layers=layers, extra=extra)


def test_launcher_arguments_load(tmp_path):
  """end_to_end/gpu/pipeline.sh turns its flags into keys that load as a pipelined config."""
  script = os.path.join(os.path.dirname(config.CONFIG_DIR), "..", "end_to_end", "gpu", "pipeline.sh")
  flags = ["--dp", "2", "--pp", "4", "--mp", "1", "--batch_size_per_device", "2", "--num_pipeline_microbatches", "8"]
  out = subprocess.run(
    ["bash", script, *flags, "--config", BASE, "run_name=t", f"base_output_directory={tmp_path}"],
    env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True, check=True,
  )  # fmt: skip
  c = config.load(out.stdout.split(), {})
  assert (c.ici_data_parallelism, c.ici_pipeline_parallelism, c.ici_tensor_parallelism) == (2, 4, 1)
  assert planner.schedule(c) == plan_lib.Schedule(4, 8, 1) and c.per_device_batch_size == 2


# The JaxPP fork's documented launcher lines (NVIDIA/maxtext-jaxpp README: tiny llama2, mixtral, mistral).
JAXPP_FLAGS = "--max_target_length=64 --model=default --dp=1 --pp=1 --mp=1 --batch_size_per_device=1"
JAXPP_FLAGS += " --num_pipeline_microbatches=1 jaxpp_remote=false"
JAXPP_TAIL = "vocab_size=32000 enable_dropout=false logits_via_embedding=false normalization_layer_epsilon=1.0e-5"
JAXPP_LINES = {
  "llama2": "base_emb_dim=1024 base_num_query_heads=8 base_num_kv_heads=8 base_mlp_dim=11008 "
  f"base_num_decoder_layers=1 head_dim=128 {JAXPP_TAIL} decoder_block=llama2",
  "mixtral": "base_emb_dim=1024 base_num_query_heads=2 base_num_kv_heads=2 base_mlp_dim=896 "
  f"base_num_decoder_layers=2 head_dim=16 {JAXPP_TAIL} num_experts=8 num_experts_per_tok=2 decoder_block=mistral",
  "mistral": "base_emb_dim=2048 base_num_query_heads=1 base_num_kv_heads=1 base_mlp_dim=896 "
  f"base_num_decoder_layers=1 head_dim=8 {JAXPP_TAIL} decoder_block=mistral",
}
JAXPP_SCRIPT = os.path.join(os.path.dirname(config.CONFIG_DIR), "..", "scripts", "multigpu_jaxpp.sh")


def run_jaxpp_line(words: list[str], env: dict[str, str], timeout: int = 60) -> subprocess.CompletedProcess:
  return subprocess.run(
    ["bash", JAXPP_SCRIPT, *words], env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout
  )


@pytest.mark.parametrize("name", sorted(JAXPP_LINES))
def test_jaxpp_fork_lines_map_onto_pipeline_keys(name):
  """scripts/multigpu_jaxpp.sh takes the fork's lines as written: flags -> our keys, jaxpp_remote noted."""
  out = run_jaxpp_line([*JAXPP_FLAGS.split(), *JAXPP_LINES[name].split()], {"DRY_RUN": "1"})
  assert out.returncode == 0, out.stderr
  assert "jaxpp_remote=false ignored" in out.stderr
  c = config.load(out.stdout.split(), {})
  assert (c.ici_data_parallelism, c.ici_pipeline_parallelism, c.ici_tensor_parallelism) == (1, 1, 1)
  assert (c.per_device_batch_size, c.num_pipeline_microbatches, c.max_target_length) == (1, 1, 64)
  assert (c.model_name, c.dataset_type, c.steps, c.enable_checkpointing) == ("default", "synthetic", 30, False)
  assert c.vocab_size == 32000 and c.num_experts == (8 if name == "mixtral" else 1)


def test_pipeline_launcher_rejects_unknown_flags():
  out = run_jaxpp_line(["--dp=1", "--tp=2"], {"DRY_RUN": "1"})
  assert out.returncode == 2 and "unknown flag --tp" in out.stderr and "--pp" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name,pp", [("llama2", 1), ("mixtral", 2), ("mistral", 1)])
def test_jaxpp_fork_lines_train_on_cpu(tmp_path, name, pp):
  """Each reference line runs through the script (pipeline.sh, launch.sh, train.py) on CPU: as written, then
  tiny widths, 2 steps and hardware=cpu appended (later words win); mixtral with 2 stages."""
  words = [*JAXPP_FLAGS.split(), *JAXPP_LINES[name].split(), f"--pp={pp}", f"--num_pipeline_microbatches={pp}"]
  words += ["base_emb_dim=32", "base_mlp_dim=64", "vocab_size=128", "steps=2", "hardware=cpu"]
  words += [f"base_output_directory={tmp_path}", "run_name=jaxpp"]
  path = {"PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
  env = {**cpu_subprocess_env(pp, base=path), "XLA_RECIPE": "none", "JAX_COORDINATOR_PORT": str(free_port())}
  out = run_jaxpp_line(words, env, timeout=300)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  lines = (tmp_path / "jaxpp" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == [1, 2]
  assert f"pipeline: {pp} stages" in out.stdout if pp > 1 else "pipeline:" not in out.stdout


def test_stacked_layers_live_only_on_their_stage_devices():
  """Under the active rules (as train.py and train_compile build the state), every stacked weight's
  `layers` dim is split over `stage`: a device holds its stage's layers only."""
  c = load("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=-1", "base_num_decoder_layers=4")
  mesh = sharding.create_mesh(c)
  with sharding.activate(c, mesh):
    spec = state.param_spec(c, mesh)
  stacked = [(p, s) for p, s in jax.tree_util.tree_flatten_with_path(spec.shardings)[0] if "layers" in str(p[0])]
  assert stacked
  for path, named in stacked:
    assert named.spec[0] == "stage", jax.tree_util.keystr(path)


@pytest.mark.slow
@pytest.mark.parametrize("size", [pytest.param("full", marks=FULLSIZE), "reduced"])
def test_llama2_70b_pipelined_over_two_v5e_256_slices_compiles_and_fits(size):
  """AOT for TPUs on the CPU (docs/pipeline_parallelism.md): 12.21 GiB per device when recorded, 150 CPU-seconds of
  compile (the `nightly` tier); the whole suite compiles the same schedule and mesh on 4 reduced layers in 9."""
  overrides = ["model_name=llama2-70b", "compile_topology=v5e-256", "compile_topology_num_slices=2"]
  overrides += ["dcn_pipeline_parallelism=2", "dcn_data_parallelism=1", "per_device_batch_size=2"]
  overrides += [] if size == "full" else reduced_tpu_model(256, layers=4)
  result = compile_command("num_pipeline_microbatches=4", *overrides, timeout=1200)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  assert "compiled for 512 x TPU v5 lite" in result.stdout
  assert "'stage': 2" in result.stdout and "'fsdp': 256" in result.stdout and "bubble 20.0%" in result.stdout
  assert reported_gib(result.stdout, "total") <= (12.5 if size == "full" else 0.05)
