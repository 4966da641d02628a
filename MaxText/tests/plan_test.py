"""The run plan (types: parallel/plan.py, builder: planner.py): built once before tracing, frozen, shown; every
layout error raised while it is built; the model follows the plan it was built with, never the active mesh or
the platform; the plan's types import nothing above them."""

import ast
import dataclasses
import os

import jax
import pytest
from flax import nnx

from MaxText import config, models, planner, sharding, train
from MaxText.errors import ConfigError
from MaxText.objectives import lm
from MaxText.parallel.plan import AttentionPlan, LossPlan
from MaxText.tests.conftest import TINY, cfg
from MaxText.tests.helpers import built

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(config.CONFIG_DIR, "base.yml")


def load(*overrides):
  return config.load([BASE, "run_name=t", *TINY, *overrides], {})


# What only the parallel package may do: read the active mesh or the platform, run per shard, name mesh
# axes, or raise a configuration error in the middle of tracing.
FORBIDDEN = {"get_abstract_mesh", "shard_map", "default_backend", "devices", "PartitionSpec", "ConfigError"}


def forbidden_uses(path: str) -> list[str]:
  tree = ast.parse(open(path).read())
  found = []
  for node in ast.walk(tree):
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    if isinstance(node, ast.alias):
      name = node.name.split(".")[-1]
    if name in FORBIDDEN:
      found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {name}")
  return found


def test_layers_and_models_read_no_mesh_platform_or_config():
  files = [
    os.path.join(d, f)
    for d in (os.path.join(ROOT, "layers"), os.path.join(ROOT, "models"))
    for f in sorted(os.listdir(d))
    if f.endswith(".py")
  ]
  assert len(files) > 20
  found = [use for f in files for use in forbidden_uses(f)]
  assert not found, "\n".join(found)


def test_plan_is_frozen_hashable_and_names_its_decisions():
  c = load("ici_context_parallelism=2", "ici_fsdp_parallelism=4", "num_experts=4", "num_experts_per_tok=2")
  plan = planner.build(c, sharding.create_mesh(c))
  assert hash(plan) == hash(planner.build(c, sharding.create_mesh(c)))
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.remat_policy = "none"
  a = plan.attention
  assert (a.kernel, a.context_shards, a.load_balanced, a.platform) == ("dot_product", 2, True, "cpu")
  assert plan.axes.length == ("context",) and "expert" not in plan.axes.experts
  assert plan.moe.ragged is False and plan.pipeline is None and plan.keep_lanes is False
  assert plan.data_shards == 4  # fsdp 4; context is not a batch axis
  lines = planner.describe(plan, c)
  assert lines[0] == "attention: dot_product, because autoselected: context parallelism over 2 shards runs dot_product"
  assert any(line.startswith("context parallelism: sequence in 2 shards") for line in lines)
  assert any(line.startswith("moe: dropless, no expert axis") for line in lines)


def test_pipeline_schedule_is_planned_per_stack():
  c = load("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "base_num_decoder_layers=6")
  c = c.replace(pipeline_parallel_layers=4, num_pipeline_microbatches=4)
  plan = planner.build(c, sharding.create_mesh(c))
  assert plan.pipeline.schedule == (2, 4, 1) and plan.pipeline.units == (("layers", 4),)
  assert plan.axes.stage == ("stage",)
  assert any("bubble 20.0%" in line for line in planner.describe(plan, c))


@pytest.mark.parametrize(
  "overrides, message",
  [
    (["ici_pipeline_parallelism=4", "base_num_decoder_layers=6"], "do not split into 4 stages"),
    (["ici_context_parallelism=4", "ici_fsdp_parallelism=2", "max_target_length=36"], "must be a multiple of 8"),
    (["attention=cudnn_flash_te"], "needs NVIDIA GPUs"),
    (["attention=flash", "max_target_length=200"], "multiple of 128; got 200"),
    (["lora_rank=4", "lora_random_base=true", "lora_target_modules=nothing/here"], "matches no projection"),
    (["decoder_block=gemma", "mtp_num_layers=1"], "not available for decoder_block=gemma"),
    (["decoder_block=gpt3", "trainable_position_size=0"], "needs trainable_position_size > 0"),
    (["ici_tensor_parallelism=-1", "ici_fsdp_parallelism=1"], "tensor"),  # -1 is 8 only once the mesh exists
    (["flash_pieces=2"], "attention runs dot_product"),
    (["attention=flash", "max_target_length=128", "per_device_batch_size=2", "flash_pieces=4"], "must divide the"),
    (["mlp_pieces=5"], "must divide max_target_length=32"),
    (["mlp_pieces=2", "ici_context_parallelism=4", "ici_fsdp_parallelism=2"], "context parallelism or the pipeline"),
    (  # Decoder.forward refused this while tracing; the plan refuses it before compiling
      ["decoder_block=gemma3", "use_multimodal=true", "image_size_for_vit=16", "ici_context_parallelism=2"],
      "images with load-balanced context parallelism are not supported",
    ),
  ],
)
def test_layout_errors_are_raised_when_the_plan_is_built(overrides, message):
  c = load(*overrides)
  with pytest.raises(ConfigError, match=message):
    planner.build(c, sharding.create_mesh(c))


def test_the_model_follows_its_plan_not_the_active_mesh():
  """The same MoE model traced under an active 8-device mesh: built with the one-device plan it runs no
  shard_map; built with the mesh's plan it dispatches per batch shard."""
  c = load("num_experts=4", "num_experts_per_tok=2", "ici_fsdp_parallelism=8")
  mesh = sharding.create_mesh(c)
  tokens = jax.numpy.ones((8, c.max_target_length), jax.numpy.int32)

  def jaxpr(plan):
    model = nnx.eval_shape(lambda: models.build(c, nnx.Rngs(params=0), plan))
    graphdef, params = nnx.split(model)
    with sharding.activate(c, mesh):
      return str(jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(tokens, tokens, tokens))(params))

  assert "shard_map" not in jaxpr(planner.build(c))
  assert "shard_map" in jaxpr(planner.build(c, mesh))


def test_the_run_header_and_decode_show_the_plan(tmp_path, capsys):
  c = cfg(tmp_path, "plan", "steps=1", "per_device_batch_size=1", "remat_policy=minimal")
  train.run(c)
  out = capsys.readouterr().out
  assert "  plan     attention: dot_product, because autoselected: no fused kernel on cpu" in out
  assert "remat: minimal" in out


def test_decoding_plans_no_training_kernel():
  """Decoding attends over the KV cache: a training-only kernel setting is neither chosen nor refused."""
  plan = planner.build(load("attention=cudnn_flash_te"), decoding=True)
  assert plan.attention.kernel == "dot_product" and plan.pipeline is None
  lines = planner.describe(plan, load())
  assert lines[0] == "attention: dot_product, because decoding attends over the KV cache"
  assert not any("remat" in line or "pipeline" in line for line in lines)


def test_base_yml_documents_every_kernel_and_remat_policy():
  """The names are declared once (parallel/kernels.py, parallel/remat.py); base.yml's comments list them all."""
  from MaxText.parallel import kernels, remat

  lines = {line.split(":")[0]: line for line in open(BASE) if not line.startswith((" ", "#"))}
  for key, names in (("attention", kernels.KINDS), ("remat_policy", remat.NAMES)):
    assert config.CHOICES[key] == names
    missing = [n for n in names if n not in lines[key].split("#", 1)[1]]
    assert not missing, (key, missing)


@pytest.mark.parametrize("batch, pieces", [(4, (1, 1)), (16, (4, 16))])
def test_activation_pieces_are_made_only_for_large_per_device_workspaces(batch, pieces):
  """llama2-7b on v5e-256 (fsdp 256): at 4 x 2048 per chip both workspaces are small and stay whole; at 16
  the lane-padded log-sum-exp (512 MiB) goes in 4 flash calls and the MLP hidden (688 MiB) in 16 parts of
  128 tokens (12.99 -> 11.50 GiB per chip; benchmarks/README.md)."""
  from MaxText import train_compile

  c = config.load([BASE, "model_name=llama2-7b", "compile_topology=v5e-256", f"per_device_batch_size={batch}"], {})
  plan = planner.build(c, sharding.create_mesh(c, train_compile.topology_devices(c)))
  assert (plan.attention.batch_pieces, plan.mlp_pieces) == pieces
  shown = [line for line in planner.describe(plan, c) if line.startswith("pieces:")]
  assert shown == ([] if pieces == (1, 1) else ["pieces: flash call in 4 batch parts, dense MLP in 16 sequence parts"])


@pytest.mark.parametrize("key", ["flash_pieces=0", "mlp_pieces=-2"])
def test_pieces_take_auto_or_a_positive_count(key):
  with pytest.raises(ConfigError, match="must be -1 \\(auto\\) or a positive number of parts"):
    load(key)


def build(c):
  return built(c, planner.build(c))


def loss_and_grads(c, graphdef, params):
  """The summed loss and its gradients for a fixed batch of the tiny model, in one jitted program."""
  b, t = int(c.per_device_batch_size), c.max_target_length
  tokens = jax.random.randint(jax.random.key(1), (b, t + 1), 0, c.vocab_size)
  ones = jax.numpy.ones((b, t), jax.numpy.int32)
  positions = jax.numpy.broadcast_to(jax.numpy.arange(t), (b, t))
  batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], inputs_position=positions)
  batch |= dict(inputs_segmentation=ones, targets_segmentation=ones)
  return jax.jit(jax.value_and_grad(lambda p: lm.loss_sums(graphdef, c, p, batch, None)[0]))(params)


@pytest.mark.parametrize(
  "pieces, whole",
  [
    (["mlp_pieces=4"], ["mlp_pieces=1"]),
    (["attention=flash", "max_target_length=128", "flash_pieces=2"], ["attention=flash", "max_target_length=128"]),
  ],
)
def test_activation_pieces_give_the_whole_computation_s_loss_and_gradients(pieces, whole):
  """Each token's MLP and each row's attention are computed as whole: pieces change when, not what."""
  common = ["per_device_batch_size=4", "remat_policy=full"]
  cut, full = (load(*common, *words) for words in (pieces, whole))
  assert (planner.build(cut).mlp_pieces, planner.build(cut).attention.batch_pieces) != (1, 1)
  # The same parameters for both, made in one jitted program (op by op, the init took 20 s on 2 busy cores).
  params = jax.jit(lambda: nnx.state(build(full)))()
  cut_def, full_def = (nnx.graphdef(nnx.eval_shape(lambda c=c: build(c))) for c in (cut, full))
  loss_cut, grads_cut = loss_and_grads(cut, cut_def, params)
  loss_full, grads_full = loss_and_grads(full, full_def, params)
  assert abs(float(loss_cut) - float(loss_full)) <= 1e-5 * abs(float(loss_full))
  for a, b in zip(jax.tree.leaves(grads_cut), jax.tree.leaves(grads_full)):
    assert jax.numpy.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_loss_vocab_tiling_is_planned_per_shape():
  """num_vocab_tiling=-1: the fewest sequence pieces whose float32 logits take at most 256 MiB per device."""

  def tiles(vocab, batch, length, shards=1, requested=-1):
    return LossPlan(0, batch, length, requested, vocab, shards).tiles_for(batch, length)

  assert tiles(256, 2, 32) == 1  # tiny models: no extra matmul
  assert tiles(32000, 4, 2048) == 4  # llama2-7b per device: 1000 MiB of logits
  assert tiles(128256, 2, 4096) == 16  # llama3.1-70b: 3.9 GiB
  assert tiles(32000, 4, 2048, requested=2) == 2  # explicit wins
  assert tiles(32000, 32, 2048, shards=8) == 4  # the batch split over the data shards
  c = load("vocab_size=32000", "max_target_length=2048", "per_device_batch_size=4", "ici_fsdp_parallelism=8")
  plan = planner.build(c, sharding.create_mesh(c))
  assert (plan.loss.rows, plan.loss.tiles, plan.data_shards) == (32, 4, 8)
  assert "loss: vocab tiling 4 for 32 x 2048 (auto, by logits bytes per device)" in planner.describe(plan, c)[-1]
  # A forward pass of gradient accumulation takes half the rows; eval and scoring ask for their own shape.
  accumulated = planner.build(c.replace(gradient_accumulation_steps=2), sharding.create_mesh(c)).loss
  assert (accumulated.rows, accumulated.tiles, accumulated.tiles_for(32, 2048)) == (16, 2, 4)
  with pytest.raises(ConfigError, match="num_vocab_tiling=3"):
    load("num_vocab_tiling=3")


def test_other_lengths_and_rows_with_images_get_the_plan_s_kernel():
  """The kernel for another length (a caller scoring other lengths) and the dot_product of rows with images
  (Gemma 3's bidirectional image blocks) are the plan's answers, decided from its fields."""
  from MaxText import train_compile

  c = config.load([BASE, "model_name=llama2-7b", "compile_topology=v5e-8", "max_target_length=2048"], {})
  a = planner.build(c, sharding.create_mesh(c, train_compile.topology_devices(c))).attention
  assert (a.kernel, a.length, a.kernel_for(2048), a.kernel_for(200), a.kernel_for(4096)) == (
    "flash", 2048, "flash", "dot_product", "flash",
  )  # fmt: skip
  assert planner.build(c, decoding=True).attention.kernel_for(4096) == "dot_product"
  assert (a.query_chunk, a.image_chunk, a.image_chunk_for(2048), a.image_chunk_for(1000)) == (512, 512, 512, 0)
  whole = dataclasses.replace(a, query_chunk=0, image_chunk=0)
  assert (whole.image_chunk_for(2048), whole.image_chunk_for(4096)) == (0, 0)
  assert isinstance(a, AttentionPlan)
  mm = load("decoder_block=gemma3", "use_multimodal=true", "image_size_for_vit=16", "attention_query_chunk=8")
  assert "rows with images: dot_product in query blocks of 8 (each image's tokens attend both ways)" in (
    planner.describe(planner.build(mm), mm)
  )


def _imports(path: str) -> set[str]:
  """The MaxText modules a source file imports, TYPE_CHECKING imports included."""
  found = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("MaxText"):
      found |= {f"{node.module}.{a.name}" for a in node.names}
    elif isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith("MaxText")}
  return found


def test_the_plan_s_types_and_wrappers_import_nothing_above_them():
  """parallel/plan.py names only parallel/ (the builder, planner.py, sits above the families); the shard_map
  wrappers (parallel/ops.py) import no layer."""
  plan = _imports(os.path.join(ROOT, "parallel", "plan.py"))
  assert plan and all(name.startswith("MaxText.parallel.") for name in plan), plan
  ops = _imports(os.path.join(ROOT, "parallel", "ops.py"))
  assert not any(name.startswith(("MaxText.layers", "MaxText.models", "MaxText.planner")) for name in ops), ops


def test_the_source_has_no_import_cycle():
  """No module of MaxText (tests apart) reaches itself through its imports, TYPE_CHECKING imports included."""
  modules = {}
  for d, _, names in os.walk(ROOT):
    for f in names:
      rel = os.path.relpath(os.path.join(d, f), os.path.dirname(ROOT))
      if f.endswith(".py") and "tests" not in rel.split(os.sep):
        modules[rel[:-3].replace(os.sep, ".").removesuffix(".__init__")] = os.path.join(d, f)

  def resolve(name):
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name

  graph = {m: {resolve(n) for n in _imports(path)} - {m, ""} for m, path in modules.items()}
  done, cycles = set(), []

  def visit(m, path):
    if m in path:
      cycles.append(path[path.index(m) :] + [m])
    elif m not in done:
      for n in sorted(graph[m]):
        visit(n, path + [m])
      done.add(m)

  for m in sorted(graph):
    visit(m, [])
  assert not cycles, "\n".join(" -> ".join(c) for c in cycles[:5])
