"""The vision towers at scale (Gemma 3's SigLIP, layers/vision.py; Llama 4's, models/llama4/vision.py): their
weights carry the text layers' logical axes, so base.yml's rules shard them over fsdp / tensor on a real mesh
(8 host CPU devices: fsdp 4 x tensor 2); under scan_layers the encoder layers are one stacked, scanned module,
which computes what the unrolled layers compute (values and gradients, remat on), and the Hugging Face
mapping addresses both layouts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import config, models, sharding, state, train_compile
from MaxText import flops as flops_lib
from MaxText.convert import mappings
from MaxText.convert.hf_to_maxtext import get, to_maxtext
from MaxText.convert.maxtext_to_hf import to_hf
from MaxText.layers import vision
from MaxText.layers.model_config import ModelConfig
from MaxText.tests.conftest import BASE, SIZES

# Tiny towers of 2 encoder layers: width 16 (2 heads of 8), MLP 32, 16 x 16 images of 4 x 4 patches.
TOWER = ["use_multimodal=true", "image_size_for_vit=16", "patch_size_for_vit=4", "hidden_size_for_vit=16"]
TOWER += ["intermediate_size_for_vit=32", "num_hidden_layers_for_vit=2", "num_attention_heads_for_vit=2"]
TOWERS = {
  "gemma3": ["decoder_block=gemma3", "mm_tokens_per_image=4", "image_token_id=300"],
  "llama4": ["decoder_block=llama4", "num_experts=4", "projector_input_dim_for_vit=24"]
  + ["projector_output_dim_for_vit=24", "image_token_id=300"],
}
MESH = ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]
LAYERS = 2
FAST = state.INIT_COMPILER_OPTIONS["cpu"]  # XLA:CPU's quick optimisation level: compiles take most of these tests


def load(tower: str, *overrides: str) -> config.Config:
  args = [BASE, "run_name=v", *SIZES, "dtype=float32", "remat_policy=full", *TOWER, *TOWERS[tower], *MESH]
  return config.load([*args, *overrides], {})


def flat(tree) -> dict[str, object]:
  """{'a/b/c': leaf} of an nnx.State of Params (or of their shardings)."""
  leaves = jax.tree.leaves_with_path(tree)
  return {"/".join(str(getattr(k, "key", k)) for k in path[:-1]): leaf for path, leaf in leaves}


def mesh_axes(entry) -> tuple[str, ...]:
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


@pytest.mark.parametrize("tower", sorted(TOWERS))
def test_tower_weights_are_sharded_over_fsdp_and_tensor(tower):
  c = load(tower)
  mesh = sharding.create_mesh(c)
  spec = state.param_spec(c, mesh)
  shardings = {k: v for k, v in flat(spec.shardings).items() if k.startswith("vision_encoder/")}
  shapes = {k: v.shape for k, v in flat(spec.abstract).items() if k.startswith("vision_encoder/")}
  # One stack of layers: every encoder weight has a leading axis of the 3 layers.
  assert {shapes[k][0] for k in shapes if k.startswith("vision_encoder/layers/")} == {LAYERS}
  query = shardings["vision_encoder/layers/query/kernel"]  # [L, D, N, H]
  assert "fsdp" in mesh_axes(query.spec[1]) and "tensor" in mesh_axes(query.spec[2])
  assert query.shard_shape(shapes["vision_encoder/layers/query/kernel"]) == (LAYERS, 16 // 4, 2 // 2, 8)
  fc1 = shardings["vision_encoder/layers/fc1/kernel"]  # [L, D, F]: D over fsdp, F over tensor
  assert fc1.shard_shape(shapes["vision_encoder/layers/fc1/kernel"]) == (LAYERS, 4, 16)
  # Every weight matrix and embedding of the tower and projector is split over fsdp (no whole copy per chip).
  for name, s in shardings.items():
    if name.endswith(("kernel", "embedding")):
      assert "fsdp" in {a for entry in s.spec for a in mesh_axes(entry)}, name
  projector = "mm_input_projection" if tower == "gemma3" else "projector"
  out = shardings[f"vision_encoder/{projector}/kernel"]  # [vision width, emb_dim]: emb_dim like the embeddings
  assert out.shard_shape(shapes[f"vision_encoder/{projector}/kernel"])[1] == 64 // 4


@functools.cache
def tower_params(tower: str, scan: bool) -> tuple[nnx.GraphDef, nnx.State]:
  """The tower alone, as the Decoder builds it (seed 0; scan_layers=`scan`), split into graphdef and params:
  the stacked and the unrolled layouts are one model."""
  c = load(tower, f"scan_layers={str(scan).lower()}")
  make = models.family(c).vision or vision.VisionEncoder
  build = lambda: make(ModelConfig.from_config(c), rngs=nnx.Rngs(0), remat_policy=c.remat_policy)  # noqa: E731
  with nnx.use_eager_sharding(False):
    graphdef, _ = nnx.split(nnx.eval_shape(build))
    return graphdef, jax.jit(lambda: nnx.split(build())[1], compiler_options=FAST)()  # one compile, not op by op


def tower_run(tower: str, scan: bool, images: jax.Array):
  """The tower's soft tokens and the gradient of their sum of squares with respect to its params, compiled
  for the 8-device mesh with the params placed as the train state places them (remat_policy=full)."""
  c = load(tower, f"scan_layers={str(scan).lower()}")
  mesh = sharding.create_mesh(c)
  graphdef, params = tower_params(tower, scan)
  placed = jax.tree.leaves(state.param_spec(c, mesh).shardings["vision_encoder"])
  leaves, treedef = jax.tree.flatten(params)
  params = jax.tree.unflatten(treedef, [jax.device_put(x, s) for x, s in zip(leaves, placed, strict=True)])

  def loss(params, images):
    soft = nnx.merge(graphdef, params)(images)
    return jnp.sum(soft.astype(jnp.float32) ** 2), soft

  with sharding.activate(c, mesh):
    (_, soft), grads = jax.jit(jax.value_and_grad(loss, has_aux=True), compiler_options=FAST)(params, images)
  return np.asarray(soft), {k: np.asarray(v) for k, v in flat(grads).items()}


@pytest.mark.parametrize("tower", sorted(TOWERS))
def test_scanned_and_unrolled_towers_agree(tower):
  images = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (4, 2, 16, 16, 3)), jnp.float32)
  scanned, scanned_grads = tower_run(tower, True, images)
  unrolled, unrolled_grads = tower_run(tower, False, images)
  assert scanned.shape[:2] == (4, 2 * 4) and np.abs(scanned).max() > 0
  np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-5)
  # The unrolled layers' gradients, stacked, are the scanned stack's.
  for name, grad in scanned_grads.items():
    if name.startswith("layers/"):
      rest = name.removeprefix("layers/")
      expected = np.stack([unrolled_grads[f"layers/{i}/{rest}"] for i in range(LAYERS)])
    else:
      expected = unrolled_grads[name]
    assert np.abs(grad).max() > 0, name
    np.testing.assert_allclose(grad, expected, rtol=1e-3, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("tower", sorted(TOWERS))
def test_hugging_face_mapping_covers_both_layouts(tower):
  """The tower exported from unrolled layers and imported into the stacked ones is the scanned model of the
  same seed, tensor for tensor: every HF name is produced once and lands on its layer's slice."""

  def tower_rules(scan: bool):
    c = load(tower, f"scan_layers={str(scan).lower()}")
    abstract = nnx.to_pure_dict(state.param_spec(c).abstract)  # the text stacks' layout, for rules()
    model = ModelConfig.from_config(c)
    rules = mappings.of_block(c.decoder_block).rules(c, models.family(model).stacks(model), abstract)
    tower_dict = nnx.to_pure_dict(tower_params(tower, scan)[1])
    return [r for r in rules if r.path[0] == "vision_encoder"], {"vision_encoder": tower_dict}

  unrolled_rules, unrolled = tower_rules(False)
  scanned_rules, scanned = tower_rules(True)
  hf = {r.hf_name: to_hf(np.asarray(get(unrolled, r.path))[r.index], r) for r in unrolled_rules}
  assert len(hf) == len(unrolled_rules) == len(scanned_rules)
  rebuilt: dict[tuple, np.ndarray] = {}
  for r in scanned_rules:
    target = np.asarray(get(scanned, r.path))
    rebuilt.setdefault(r.path, np.full(target.shape, np.nan, target.dtype))[r.index] = to_maxtext(
      hf[r.hf_name], target.shape[len(r.index) :], r
    )
  assert len(rebuilt) == len(jax.tree.leaves(scanned["vision_encoder"]))
  for path, array in rebuilt.items():
    np.testing.assert_array_equal(array, get(scanned, path), err_msg="/".join(map(str, path)))


def test_train_compile_builds_the_images_and_counts_the_tower():
  """train_compile's abstract batch carries images_per_row images per row, sharded like the tokens; the step
  compiles with them on the 8-device mesh (scanned tower) and its model FLOPs include the tower's."""
  c = load("gemma3", "images_per_row=2", "max_target_length=32", "per_device_batch_size=1")
  mesh = sharding.create_mesh(c)
  batch, _ = train_compile.shaped_inputs(c, mesh)
  assert batch["images"].shape == (8, 2, 16, 16, 3) and batch["images"].dtype == jnp.float32
  assert batch["images"].sharding.spec[0] == batch["inputs"].sharding.spec[0]
  _, report, _ = train_compile.compile_train_step(c, jax.devices())
  per_token = flops_lib.training_flops_per_token(c)
  assert per_token.vision > 0 and report.model_flops == pytest.approx(per_token.total * 8 * 32 / 8)
