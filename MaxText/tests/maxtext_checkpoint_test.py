"""Upstream MaxText's own checkpoints (fixtures/maxtext, written by its train.py and generate_param_only_checkpoint;
end_to_end/cpu/make_maxtext_fixtures.py) load here as load_parameters_path / load_full_state_path, scanned or
not, give upstream's logits, continue training, and export back to upstream's layout. Upstream MaxText itself
is not needed: its logits for the fixed prompt are saved beside each checkpoint."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from MaxText import check_logits, checkpointing, optimizers, sharding, train
from MaxText import config as config_lib
from MaxText import state as state_lib
from MaxText.convert import to_upstream, upstream
from MaxText.errors import ConfigError
from MaxText.tests.conftest import BASE, family_tiers, losses

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "maxtext")
with open(os.path.join(FIXTURES, "fixtures.json")) as f:
  INDEX = json.load(f)
NAMES = sorted(INDEX["fixtures"])
FULL = [n for n in NAMES if INDEX["fixtures"][n]["kind"] == "full"]  # upstream train states
PARAMS = [n for n in NAMES if INDEX["fixtures"][n]["kind"] == "params"]  # upstream params-only checkpoints
LLAMA = "llama2_scanned_full"  # the one the single-fixture tests use
# The per-fixture matrices run these models' fixtures in the fast tier (dense, tied with a scaled embedding,
# local/global cycles with a remainder, MoE, MLA MoE) and every fixture in the slow tier.
FAST_MODELS = {"llama2", "gemma", "gemma3", "mixtral", "deepseek3"}


def layout_cases(relation: str) -> list[tuple[str, bool]]:
  """(fixture, our scan_layers) pairs. A family with fixtures in both of upstream's layouts loads each into our
  other layout (`relation="cross"`: scanned -> unrolled and unrolled -> scanned) or our same one ("same"), so
  each of our layouts is checked once per family; a family with one fixture loads it into both of ours."""
  layouts = {}
  for name in NAMES:
    layouts.setdefault(INDEX["fixtures"][name]["model"], set()).add(INDEX["fixtures"][name]["scan_layers"])
  cases = []
  for name in NAMES:
    scanned = INDEX["fixtures"][name]["scan_layers"]
    both = len(layouts[INDEX["fixtures"][name]["model"]]) == 2
    ours = [scanned != (relation == "cross")] if both else [True, False]
    marks = [] if INDEX["fixtures"][name]["model"] in FAST_MODELS else [pytest.mark.slow]
    cases += [pytest.param(name, scan, id=f"{name}-{'scan' if scan else 'unrolled'}", marks=marks) for scan in ours]
  return cases


def fast_fixtures(names, slow=()) -> list[str]:
  """Those of the fixtures `names` that run in the fast tier (FAST_MODELS', unless in `slow`): family_tiers' `fast`."""
  return [n for n in names if INDEX["fixtures"][n]["model"] in FAST_MODELS and n not in slow]


def fixture(name: str) -> str:
  return os.path.join(FIXTURES, name)


def model_argv(name: str) -> list[str]:
  """Our keys for the fixture's model: the same values upstream trained it with."""
  model = INDEX["fixtures"][name]["model"]
  keys = {**INDEX["models"][model], **INDEX.get("ours", {}).get(model, {})}  # upstream's, and ours where they differ
  return ["override_model_config=true", "dtype=float32", *(f"{k}={v}" for k, v in keys.items())]


def load(tmp_path, name: str, *overrides: str) -> config_lib.Config:
  argv = [BASE, "run_name=t", f"base_output_directory={tmp_path}", *model_argv(name), "log_config=false", *overrides]
  return config_lib.load(argv, {})


def saved_arrays(path: str) -> dict:
  """Every array of an orbax checkpoint as host numpy, straight from disk."""
  tree = checkpointing.saved_tree(path)
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  return ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(restore_args=args))


def saved_tree(name: str):
  return checkpointing.saved_tree(fixture(name))


def full_state(tmp_path, name: str, *overrides: str) -> checkpointing.Restored:
  """What train.py starts from with load_full_state_path=<fixture> (and `overrides`)."""
  c = load(tmp_path, name, f"load_full_state_path={fixture(name)}", *overrides)
  tx = optimizers.build(c).tx
  spec = state_lib.state_spec(c, tx, sharding.create_mesh(c))
  with pytest.MonkeyPatch.context() as patch:  # the restored params are not first made at random
    patch.setattr(state_lib, "init_state", lambda *_: pytest.fail("random init under load_full_state_path"))
    return checkpointing.restore_or_init(c, tx, spec, None)


def adam(opt_state) -> optax.ScaleByAdamState:
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
  return next(x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x))


@pytest.mark.parametrize("name", NAMES)
def test_fixture_layouts_are_detected(name):
  kind = upstream.layout(saved_tree(name))
  assert kind == ("linen" if INDEX["fixtures"][name]["kind"] == "full" else "nnx")


def logits_as_upstream(c: config_lib.Config, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(our logits, our hidden states through our head with the table rounded as upstream's attend_on_embedding
  rounds it: its own table, ours / embed_factor, in bfloat16, and the bound on what that rounding moves a logit:
  |h| . |table - rounded|; tanh's soft cap can only shrink it)."""
  spec = state_lib.param_spec(state_lib.for_inference(c))
  model = nnx.merge(spec.graphdef, checkpointing.load_params(c.load_parameters_path, spec.abstract, c))
  t = len(tokens)
  args = (jnp.asarray(tokens)[None], jnp.arange(t)[None], jnp.ones((1, t), jnp.int32))
  ours = np.asarray(model(*args)[0])
  hidden = model.forward(*args, hidden_only=True).logits
  table, factor = np.asarray(model.token_embedder.embedding[...]), upstream.family(c).embed_factor
  rounded = (table / factor).astype(jnp.bfloat16).astype(np.float32) * np.float32(factor)
  model.token_embedder.embedding[...] = jnp.asarray(rounded)
  bound = np.abs(np.asarray(hidden[0])) @ np.abs(table - rounded).T
  return ours, np.asarray(model.logits(hidden)[0]), bound


@pytest.mark.parametrize("name,scan", layout_cases("cross"))
def test_logits_match_upstream(tmp_path, name, scan):
  """Each layer layout of ours, from the other of upstream's where the family has both (test_export_round_trips
  checks the same-layout loads: their export gives back upstream's own arrays): upstream's own logits up to
  float32 noise. From a tied family's float32 train state, upstream's head rounds the table to bf16: ours, with
  the table so rounded, gives its logits to float32 noise, and our own logits are within that rounding's bound of
  them."""
  c = load(tmp_path, name, f"load_parameters_path={fixture(name)}", f"scan_layers={str(scan).lower()}")
  golden = np.load(fixture(name) + ".logits.npy")
  if INDEX["fixtures"][name]["kind"] != "full" or not c.logits_via_embedding:  # the table as upstream's head uses it
    ours = check_logits.model_logits(c)(np.array(INDEX["prompt"]))
    np.testing.assert_allclose(ours, golden, atol=2e-5, rtol=1e-5)
    return
  ours, rounded, bound = logits_as_upstream(c, np.array(INDEX["prompt"]))
  np.testing.assert_allclose(rounded, golden, atol=2e-5, rtol=1e-5)
  assert np.all(np.abs(ours - golden) <= bound + 2e-5)


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("name", family_tiers(FULL, fast_fixtures(FULL)))
def test_full_state_brings_step_and_adam_moments(tmp_path, name, scan):
  raw = saved_arrays(fixture(name))
  restored = full_state(tmp_path, name, f"scan_layers={str(scan).lower()}")
  assert restored.source == "load_full_state_path"
  assert int(restored.state.step) == int(raw["step"]) == INDEX["fixtures"][name]["step"] + 1
  moments = adam(restored.state.opt_state)
  count, mu, nu = upstream.adam_of(raw["opt_state"])
  assert int(moments.count) == int(count) == int(raw["step"])
  embedding = moments.mu["token_embedder"]["embedding"].value
  np.testing.assert_array_equal(embedding, mu["params"]["token_embedder"]["embedding"])
  # the last stack's layer 0 moment, where each side keeps it (ours: <stack>[0] or the stack's row 0, in a block
  # family its sublayer 0; upstream: <stack>_0 or its stack's axis 1, in a scanned block family layers/layers_0);
  # deepseek's stacks are dense_layers, moe_layers
  stack = "moe_layers" if "moe_layers" in moments.nu else "layers"
  layer = moments.nu[stack] if scan else moments.nu[stack][0]
  layer = layer["sublayers"][0] if "sublayers" in layer else layer
  ours = layer["self_attention"]["out"]["kernel"].value
  decoder = nu["params"]["decoder"]
  if f"{stack}_0" in decoder:
    theirs = decoder[f"{stack}_0"]
  else:
    theirs = jax.tree.map(lambda a: a[:, 0], decoder[stack].get("layers_0", decoder[stack]))
  # upstream's attention module: gpt-oss's own name; gemma2's layer holds sublayer 0 as *_local
  attention = next(theirs[k] for k in ("self_attention", "GptOssAttention", "self_attention_local") if k in theirs)
  np.testing.assert_array_equal(np.asarray(ours[0] if scan else ours), attention["out"]["kernel"])


# over 30 s each on 2 cores (the compile of 8 unrolled gemma3 layers, the scanned MoE blocks): the nightly tier, with
# the other fixtures not in the fast one (each fixture's logits against upstream's run in the whole suite)
SLOW_TO_TRAIN = {"gemma3_unrolled_full", "llama4_scanned_full", "gpt-oss_scanned_full"}


@pytest.mark.parametrize("name", family_tiers(FULL, fast_fixtures(FULL, slow=SLOW_TO_TRAIN), reference=False))
def test_training_continues_from_an_upstream_full_state(tmp_path, name):
  start = INDEX["fixtures"][name]["step"] + 1  # optimizer steps upstream took
  c = load(
    tmp_path,
    name,
    f"load_full_state_path={fixture(name)}",
    f"steps={start + 3}",
    "dataset_type=synthetic",
    "per_device_batch_size=1",
    "log_period=1",
    "learning_rate=1e-2",
    "enable_checkpointing=false",
    "enable_tensorboard=false",
  )
  assert train.run(c)["steps_run"] == 3  # continues at upstream's step
  seen = losses(c)
  assert len(seen) == 3 and all(np.isfinite(seen))
  with open(c.metrics_file) as f:
    assert json.loads(f.readline())["step"] == start + 1  # the first step run here is upstream's next one


@pytest.mark.parametrize("name", PARAMS)
def test_params_only_checkpoint_is_not_a_full_state(tmp_path, name):
  with pytest.raises(ConfigError, match="params-only checkpoint; pass it as load_parameters_path"):
    full_state(tmp_path, name)


def test_another_architecture_names_the_parameter(tmp_path):
  name = LLAMA
  c = load(tmp_path, name, f"load_parameters_path={fixture(name)}", "base_mlp_dim=48")
  # the first parameter that does not fit, by its path (ours: layer stack first)
  wanted = r"does not map onto this model: layers/mlp/wi/0/kernel: shape \(2, 16, 32\) != \(2, 16, 48\)"
  with pytest.raises(ConfigError, match=wanted):
    check_logits.model_logits(c)


def test_upstream_step_directory_names_its_items(tmp_path):
  (tmp_path / "2" / "items").mkdir(parents=True)
  c = load(tmp_path, LLAMA, f"load_parameters_path={tmp_path / '2'}")
  with pytest.raises(ConfigError, match=r"is a checkpoint step directory; set load_parameters_path=.*2/items"):
    check_logits.model_logits(c)


@pytest.mark.parametrize("name,scan", layout_cases("same"))
def test_export_round_trips(tmp_path, name, scan):
  """Ours -> upstream's Linen params tree (in the fixture's dtype): reads back here to the same parameters,
  and equals upstream's own arrays where upstream wrote the same layer layout (bf16 exactly; float32 up
  to the query kernels' rescaling): each family's fixtures in their own layout, a family with one fixture in
  both of ours."""
  theirs = upstream.unwrap(upstream.params_of(saved_arrays(fixture(name)), upstream.layout(saved_tree(name))))
  dtype = str(theirs["token_embedder"]["embedding"].dtype)
  c = load(tmp_path, name, f"load_parameters_path={fixture(name)}", f"scan_layers={str(scan).lower()}")
  out = str(tmp_path / "exported")
  to_upstream.export(c, out, dtype)
  assert upstream.layout(checkpointing.saved_tree(out)) == "linen"
  abstract = state_lib.param_spec(c).abstract
  again, first = checkpointing.load_params(out, abstract, c), checkpointing.load_params(fixture(name), abstract, c)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), again, first)
  if scan == INDEX["fixtures"][name]["scan_layers"]:
    ours = saved_arrays(out)["params"]["params"]
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    same = lambda a, b: np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-6)  # noqa: E731
    jax.tree.map(same, ours, theirs)


def test_gemma3_layers_past_the_last_cycle_are_our_remainder_stack(tmp_path):
  """Upstream's scanned gemma3 keeps whole 6-layer cycles in layers/layers_<k> and the rest (2 of the fixture's 8)
  unstacked in layers_remainder; either layout of it is our layers (sublayers 0-5) plus remainder_layers."""
  for name in ("gemma3_scanned_params", "gemma3_unrolled_params"):
    c = load(tmp_path, name)
    theirs = upstream.unwrap(upstream.params_of(saved_arrays(fixture(name)), upstream.layout(saved_tree(name))))
    ours = upstream.to_ours(theirs, upstream.family(c))
    assert sorted(ours) == ["decoder_norm", "layers", upstream.REMAINDER, "token_embedder"]
    assert sorted(ours[upstream.REMAINDER]["0"]["sublayers"]) == ["0", "1"]
    cycle = ours["layers"] if "sublayers" in ours["layers"] else ours["layers"]["0"]
    assert sorted(cycle["sublayers"], key=int) == [str(k) for k in range(6)]
  decoder = upstream.unwrap(saved_arrays(fixture("gemma3_scanned_params")))["decoder"]
  assert sorted(decoder["layers_remainder"]) == ["layers_0", "layers_1"]


def test_an_upstream_scan_needs_whole_cycles(tmp_path):
  """Upstream scans llama4 and gpt-oss in whole cycles only (no remainder module): a scanned export of a model
  with a partial cycle is refused in one line before anything is read."""
  name = "gpt-oss_unrolled_params"
  c = load(tmp_path, name, "base_num_decoder_layers=3", "scan_layers=true", f"load_parameters_path={fixture(name)}")
  with pytest.raises(ConfigError, match="whole cycles of 2 layers only.*pass scan_layers=false"):
    to_upstream.export(c, str(tmp_path / "out"))


def test_deepseek_routing_bias_comes_from_the_train_state_and_goes_back(tmp_path):
  """Upstream's train keeps deepseek V3's routing bias out of the params (in nnx_aux; zero in the fixture): a
  train state's is our gate_bias, either way it is loaded; a non-zero one exports as gate/bias (where upstream's
  converters put it)."""
  name = "deepseek3_unrolled_full"
  raw = saved_arrays(fixture(name))
  bias = np.arange(4, dtype=np.float32) / 10
  raw["nnx_aux"]["model"]["decoder"]["moe_layers_0"]["DeepSeekMoeBlock_0"]["MoeBlock_0"]["gate"]["bias"] = bias
  path = str(tmp_path / "biased")
  ocp.PyTreeCheckpointer().save(path, raw)
  restored = full_state(tmp_path, name, f"load_full_state_path={path}", "scan_layers=false")
  np.testing.assert_array_equal(restored.state.params["moe_layers"][0]["mlp"]["gate_bias"].value, bias)
  c = load(tmp_path, name, f"load_parameters_path={path}", "scan_layers=true")
  params = checkpointing.load_params(path, state_lib.param_spec(c).abstract, c)
  np.testing.assert_array_equal(params["moe_layers"]["mlp"]["gate_bias"].value, bias[None])
  to_upstream.export(c, str(tmp_path / "out"), "float32")
  decoder = saved_arrays(str(tmp_path / "out"))["params"]["params"]["decoder"]
  np.testing.assert_array_equal(
    decoder["moe_layers"]["DeepSeekMoeBlock_0"]["MoeBlock_0"]["gate"]["bias"], bias[:, None]
  )


def test_export_command_as_documented(tmp_path, capsys):
  """docs/checkpoints.md's to_upstream command line; a missing load_parameters_path is one line."""
  name = LLAMA
  argv = ["to_upstream.py", BASE, "run_name=t", f"base_output_directory={tmp_path}", *model_argv(name)]
  to_upstream.main([*argv, f"load_parameters_path={fixture(name)}", "--output", str(tmp_path / "out")])
  assert "Wrote" in capsys.readouterr().out and upstream.layout(checkpointing.saved_tree(str(tmp_path / "out")))
  with pytest.raises(SystemExit, match="needs load_parameters_path"):
    to_upstream.main([*argv, "--output", str(tmp_path / "none")])
  with pytest.raises(SystemExit) as e:
    to_upstream.main(["to_upstream.py", "--help"])
  assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: python3 -m MaxText.convert.to_upstream")


@pytest.mark.parametrize(
  "tree, kind",
  [
    ({"params": {"params": {"decoder": {}, "token_embedder": {}}}, "opt_state": [], "step": 0}, "linen"),
    ({"params": {"params": {"decoder": {}, "token_embedder": {}}}}, "linen"),
    ({"decoder": {"layers": {}}, "token_embedder": {"embedding": {"value": 0}}}, "nnx"),
    ({"params": {"layers": {}, "token_embedder": {}}, "opt_state": [], "step": 0}, None),  # ours
    ({"params": {"layers": {}, "token_embedder": {}}}, None),  # our params-only
  ],
)
def test_layout_is_read_from_the_tree(tree, kind):
  assert upstream.layout(tree) == kind


def test_upstream_state_of_another_optimizer_says_to_load_params(tmp_path):
  """An upstream train state whose optimizer kept no AdamW moments (e.g. opt_type=sgd): one line, what to do."""
  name = FULL[0]
  raw = saved_arrays(fixture(name))
  path = str(tmp_path / "sgd")
  ocp.PyTreeCheckpointer().save(path, {"params": raw["params"], "opt_state": [{"count": raw["step"]}], "step": 3})
  with pytest.raises(ConfigError, match="no AdamW moments .* load its parameters with load_parameters_path"):
    full_state(tmp_path, name, f"load_full_state_path={path}")


UNMAPPED = ["qwen3-next-80b-a3b", "gpt3-175b"]  # families upstream ships whose trees are not mapped (yet)


@pytest.mark.parametrize("model_name", UNMAPPED)
def test_an_unmapped_family_is_refused_by_name(tmp_path, model_name):
  """load_parameters_path / load_full_state_path / to_upstream, for a family with no mapping: one ConfigError
  naming it and the mapped ones (before any array is read)."""
  c = load(tmp_path, LLAMA, f"model_name={model_name}", f"load_parameters_path={fixture(LLAMA)}")
  wanted = rf"cannot be mapped onto decoder_block='{c.decoder_block}' \(model_name='{model_name}'\): .* llama2"
  with pytest.raises(ConfigError, match=wanted):
    checkpointing.load_params(c.load_parameters_path, state_lib.param_spec(c).abstract, c)
  with pytest.raises(ConfigError, match=wanted):
    to_upstream.export(c, str(tmp_path / "out"))


@pytest.mark.parametrize(
  "entry", [pytest.param("MaxText.train", marks=pytest.mark.slow), "MaxText.decode", "MaxText.check_logits"]
)
def test_every_entry_point_refuses_an_unmapped_family_in_one_line(tmp_path, entry):
  """The command lines: exit 1 with one line naming the family, no traceback."""
  name = FULL[0]
  argv = [sys.executable, "-m", entry, BASE, "run_name=t", f"base_output_directory={tmp_path}", "log_config=false"]
  argv += [*model_argv(name), f"model_name={UNMAPPED[0]}", "steps=1", "dataset_type=synthetic"]
  argv += [f"load_parameters_path={fixture(name)}", "enable_checkpointing=false"]
  if entry == "MaxText.check_logits":
    argv.append(f"golden_logits_path={tmp_path / 'none.jsonl'}")
  if entry == "MaxText.decode":
    argv += ["prompt=1 2 3", "max_prefill_predict_length=4", "max_target_length=8"]
  done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 1, done.stderr[-3000:]
  assert "Traceback" not in done.stderr, done.stderr[-3000:]
  assert "cannot be mapped onto decoder_block='qwen3next'" in done.stderr.strip().splitlines()[-1]
