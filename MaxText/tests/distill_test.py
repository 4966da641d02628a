"""objective=distill (objectives/distill.py, teacher.py): the divergences against a numpy hand computation, the
teacher's config and params kept apart from the student's (no optimizer state, not in checkpoints), bad input in
one line, and one jitted step that logs the KL, the hard-label loss and the teacher's own loss."""

import json

import jax
import numpy as np
import optax
import pytest

from MaxText import checkpointing, distill_topk, optimizers, sharding, teacher, train_compile
from MaxText import state as state_lib
from MaxText import train_step as steps
from MaxText.errors import ConfigError
from MaxText.objectives import distill
from MaxText.tests.conftest import cfg
from MaxText.tests.helpers import learnable_batch

# The teacher: the tiny model's vocabulary and length, wider and deeper (a config file of model keys).
TEACHER_YML = "base_emb_dim: 96\nbase_num_query_heads: 4\nbase_num_kv_heads: 2\nbase_mlp_dim: 192\n"
TEACHER_YML += "base_num_decoder_layers: 3\nhead_dim: 16\nvocab_size: 256\n"


@pytest.fixture(scope="module")
def teacher_files(tmp_path_factory):
  """(teacher.yml, its random params saved as a params checkpoint)."""
  root = tmp_path_factory.mktemp("teacher")
  (root / "teacher.yml").write_text(TEACHER_YML)
  c = distill_config(root, str(root / "teacher.yml"), "")
  t = teacher.config_of(c)
  checkpointing.save_params(str(root / "params"), state_lib.init_params(t, state_lib.param_spec(t)))
  return str(root / "teacher.yml"), str(root / "params")


def distill_config(tmp_path, yml, params, *overrides):
  keys = ["objective=distill", f"teacher_config={yml}", f"teacher_load_parameters_path={params}"]
  return cfg(tmp_path, "d", *keys, "per_device_batch_size=1", *overrides)


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_the_divergences_match_a_hand_computation():
  rng = np.random.default_rng(0)
  s, t = rng.normal(size=(2, 3, 7)) * 3, rng.normal(size=(2, 3, 7)) * 3
  temp = 2.0
  ls, lt = _log_softmax(s / temp), _log_softmax(t / temp)
  forward = (np.exp(lt) * (lt - ls)).sum(-1)
  reverse = (np.exp(ls) * (ls - lt)).sum(-1)
  np.testing.assert_allclose(distill.kl(s, t, temp, "forward_kl", 0.0), forward, rtol=1e-5)
  np.testing.assert_allclose(distill.kl(s, t, temp, "reverse_kl", 0.0), reverse, rtol=1e-5)
  np.testing.assert_allclose(distill.kl(s, t, temp, "mix", 0.3), 0.3 * forward + 0.7 * reverse, rtol=1e-5)
  np.testing.assert_allclose(distill.kl(t, t, temp, "forward_kl", 0.0), 0.0, atol=1e-6)  # same model: no KL
  assert (forward > 0).all() and not np.allclose(forward, reverse)


def test_the_teacher_keeps_its_model_and_takes_the_students_run_keys(tmp_path, teacher_files):
  c = distill_config(tmp_path, *teacher_files, "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
  t = teacher.config_of(c)
  assert (t.emb_dim, t.num_decoder_layers, t.objective) == (96, 3, "lm")
  assert (t.max_target_length, t.dtype, t.ici_tensor_parallelism, t.per_device_batch_size) == (32, "float32", 2, 1)
  assert (c.emb_dim, c.num_decoder_layers) == (64, 2)


def test_bad_teachers_are_one_line(tmp_path, teacher_files):
  yml, params = teacher_files
  (tmp_path / "wide_vocab.yml").write_text(TEACHER_YML.replace("vocab_size: 256", "vocab_size: 512"))
  cases = [
    (distill_config(tmp_path, str(tmp_path / "wide_vocab.yml"), params), "teacher's vocab_size=512 differs"),
    (distill_config(tmp_path, yml, str(tmp_path / "none")), "needs teacher_load_parameters_path"),
    (distill_config(tmp_path, "", params), "needs teacher_config"),
    (distill_config(tmp_path, "no-such-model", params), "teacher_config='no-such-model'"),
    (distill_config(tmp_path, yml, params, "distill_alpha=1.5"), "distill_alpha=1.5"),
    (distill_config(tmp_path, yml, params, "distill_alpha_end=2"), r"distill_alpha_end=2.0 is the KL's weight at"),
  ]
  for c, message in cases:
    with pytest.raises(ConfigError, match=message) as e:
      distill.OBJECTIVE.check(c, 8)
    assert "\n" not in str(e.value)


def test_a_teacher_checkpoint_of_another_model_is_one_line(tmp_path, teacher_files):
  yml, params = teacher_files
  (tmp_path / "deeper.yml").write_text(TEACHER_YML.replace("layers: 3", "layers: 4"))
  c = distill_config(tmp_path, str(tmp_path / "deeper.yml"), params)
  mesh = sharding.create_mesh(c)
  tx = optimizers.build(c).tx
  with sharding.activate(c, mesh):
    spec = state_lib.state_spec(c, tx, mesh)
    with pytest.raises(ConfigError, match="teacher_load_parameters_path, read with the model of teacher_config"):
      checkpointing.restore_or_init(c, tx, spec, None)


def test_one_step_trains_the_student_only_and_logs_the_teacher(tmp_path, teacher_files):
  # The KL's weight goes from 0.5 at step 0 to 1.0 at the last step (2): 0.75 at the second.
  c = distill_config(tmp_path, *teacher_files, "distill_temperature=2.0", "distill_alpha_end=1.0", "steps=3")
  mesh = sharding.create_mesh(c)
  optimizer = optimizers.build(c)
  with sharding.activate(c, mesh):
    spec = state_lib.state_spec(c, optimizer.tx, mesh)
    # The optimizer keeps state for the student's params only; the reference slot holds the teacher's.
    assert jax.tree.structure(spec.abstract.opt_state) == jax.tree.structure(
      jax.eval_shape(optimizer.tx.init, spec.abstract.params)
    )
    teacher_size = sum(x.size for x in jax.tree.leaves(spec.abstract.reference))
    assert teacher_size > 2 * spec.num_params and spec.teacher.path == teacher_files[1]
    state = checkpointing.restore_or_init(c, optimizer.tx, spec, None).state
    before = jax.device_get(state.reference)
    assert spec.partition.checkpointed(state).reference is None  # checkpoints never hold the teacher
    step = steps.jit_train_step(c, mesh, optimizer.tx, spec, optimizer.schedule)
    batch = jax.device_put(learnable_batch(c), steps.batch_shardings(c, mesh))
    state, metrics = step(state, batch, jax.random.key(0))
    metrics = jax.device_get(metrics)
    before_second = jax.device_get(state.reference)
    state, second = step(state, batch, jax.random.key(1))
    second = jax.device_get(second)
  for key in ("distill_kl", "distill_nll", "teacher_loss"):
    assert np.isfinite(metrics[key]) and metrics[key] > 0, key
  for m, alpha in ((metrics, 0.5), (second, 0.75)):
    np.testing.assert_allclose(m["distill_alpha"], alpha, rtol=1e-6)
    expected = alpha * 4.0 * m["distill_kl"] + (1 - alpha) * m["distill_nll"]
    np.testing.assert_allclose(m["loss"], expected, rtol=1e-5)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(before_second)))
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.reference)))
  assert optax.global_norm(jax.device_get(state.params)) > 0 and int(state.step) == 2


@pytest.mark.slow  # a second compile of the step (~20 s on 2 busy cores)
def test_aot_reports_the_teacher_params(tmp_path, teacher_files):
  c = distill_config(tmp_path, *teacher_files, "compile_topology=cpu")
  _, report, _ = train_compile.compile_train_step(c, jax.devices())
  spec_bytes = sum(x.size * 4 for x in jax.tree.leaves(state_lib.param_spec(teacher.config_of(c)).abstract))
  assert spec_bytes // 8 <= report.reference_bytes < spec_bytes // 4  # fsdp over the 8 devices (norms replicated)
  assert report.argument_bytes > report.reference_bytes
  assert "frozen reference/teacher params" in train_compile.format_report(report)


def test_the_top_k_divergence_keeps_the_rest_of_the_teachers_mass_as_one_outcome():
  """Offline: the teacher's exact top-k probabilities plus "any other token", against the student's; with k = V
  it is the full forward KL."""
  rng = np.random.default_rng(1)
  temp, student, teacher_logits = 1.5, rng.normal(size=(2, 9)) * 2, rng.normal(size=(2, 9)) * 2
  ids = np.argsort(-teacher_logits, axis=-1)[:, :3]
  values = np.take_along_axis(teacher_logits, ids, -1)
  log_s, log_full = _log_softmax(student / temp), _log_softmax(teacher_logits / temp)
  lse = (teacher_logits / temp - log_full)[:, 0]
  p_t, p_s = np.exp(np.take_along_axis(log_full, ids, -1)), np.exp(np.take_along_axis(log_s, ids, -1))
  rest_t, rest_s = 1 - p_t.sum(-1), 1 - p_s.sum(-1)
  expected = (p_t * np.log(p_t / p_s)).sum(-1) + rest_t * np.log(rest_t / rest_s)
  got = distill.topk_kl(np.take_along_axis(log_s, ids, -1), values, lse, temp)
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  every = np.argsort(-teacher_logits, axis=-1)
  whole = distill.topk_kl(
    np.take_along_axis(log_s, every, -1), np.take_along_axis(teacher_logits, every, -1), lse, temp
  )
  np.testing.assert_allclose(whole, distill.kl(student, teacher_logits, temp, "forward_kl", 0.0), rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def topk_dir(tmp_path_factory, teacher_files):
  """The teacher's top-4 logits over 3 train and 2 eval batches of synthetic data."""
  root = tmp_path_factory.mktemp("topk")
  c = distill_config(
    root, *teacher_files, f"distill_topk_path={root}/topk", "distill_topk_k=4", "steps=3", "eval_steps=2"
  )
  assert distill_topk.run(c).rows == {"train": 24, "eval": 16}
  return str(root / "topk")


def test_the_stored_top_k_are_the_teachers_and_resume_exactly(tmp_path, teacher_files, topk_dir):
  c = cfg(tmp_path, "off", "objective=distill", f"distill_topk_path={topk_dir}", "per_device_batch_size=1")
  online = distill_config(tmp_path, *teacher_files)
  mesh = sharding.create_mesh(c)
  with sharding.activate(c, mesh):
    train = distill.OBJECTIVE.sources(c, mesh).train
    first = jax.device_get(train.next(None).batch)
    state = train.get_state()
    second = jax.device_get(train.next(None).batch)
    train.set_state(state)
    assert all(np.array_equal(second[k], v) for k, v in jax.device_get(train.next(None).batch).items())
    # The same rows the online run reads, and the teacher's own top-4 of them.
    batch = next(distill.OBJECTIVE.sources(online, mesh).train.iterator)
    spec = state_lib.param_spec(teacher.config_of(online), mesh)
    params = checkpointing.load_params(teacher_files[1], spec.abstract)
    values, ids, _, _ = jax.device_get(distill_topk.teacher_topk(online, 4, params, batch))
  np.testing.assert_array_equal(first["inputs"], jax.device_get(batch["inputs"]))
  np.testing.assert_array_equal(first["topk_ids"], ids)
  np.testing.assert_allclose(first["topk_values"], values, rtol=1e-5)
  assert first["topk_values"].shape == (8, 32, 4) and (np.diff(first["topk_values"], axis=-1) <= 0).all()


def test_bad_top_k_shards_are_one_line(tmp_path, teacher_files, topk_dir):
  def offline(*overrides):
    return cfg(tmp_path, "off", "objective=distill", f"distill_topk_path={topk_dir}", *overrides)

  cases = [
    (offline("max_target_length=64"), "hold rows of 32 tokens; set max_target_length=32"),
    (offline("vocab_size=512"), "come from a vocabulary of 256"),
    (offline("distill_loss=reverse_kl"), "give forward_kl only"),
    (offline("distill_temperature=2.0"), "written at distill_temperature=1.0; train with that temperature"),
    (cfg(tmp_path, "off", "objective=distill", f"distill_topk_path={tmp_path}"), "has no topk.json"),
  ]
  for c, message in cases:
    with pytest.raises(ConfigError, match=message) as e:
      distill.OBJECTIVE.check(c, 8)
    assert "\n" not in str(e.value)
  meta = json.loads(open(f"{topk_dir}/topk.json").read()) | {"tokenizer": "0" * 64}
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "topk.json").write_text(json.dumps(meta))
  (tmp_path / "tokenizer.model").write_bytes(b"another tokenizer")
  other = cfg(tmp_path, "off", "objective=distill", f"distill_topk_path={tmp_path}/other", "dataset_type=text")
  with pytest.raises(ConfigError, match="were tokenized with another tokenizer than tokenizer_path"):
    distill.OBJECTIVE.check(other.replace(tokenizer_path=str(tmp_path / "tokenizer.model")), 8)
  too_many = distill_config(tmp_path, *teacher_files, f"distill_topk_path={tmp_path}/new", "distill_topk_k=300")
  with pytest.raises(ConfigError, match=r"distill_topk_k=300 must be in \[1, vocab_size=256\]"):
    distill_topk.run(too_many)
