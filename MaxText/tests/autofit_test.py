"""Auto-fit (train_compile.py auto_fit=true): the estimator's shape (monotone in batch, the state divided by
the chips that shard it, remat saving memory and costing time), the MoE dispatch term (its rows against the
traced dispatch's buffers, its totals against mixtral-8x7b's compiles), the search's bisection against a fake
compiler, and (slow tier) the real command on a v5e-8 topology with a small HBM budget: the winner fits when
compiled, and the next larger batch, compiled, does not."""

import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from MaxText import autofit, compiled_step, config, train_compile
from MaxText import autofit_estimate as estimates
from MaxText.layers import moe_dispatch
from MaxText.parallel import remat as remat_lib
from MaxText.tests.conftest import BASE, SIZES

GiB = 2**30


def load(tmp_path, *overrides):
  return config.load([BASE, "run_name=t", f"base_output_directory={tmp_path}", *SIZES, *overrides], {})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  c = load(tmp_path_factory.mktemp("af"), "dtype=bfloat16")
  split = estimates.Split(8, 1, 1)
  return c, autofit.facts(c, split, jax.devices()[:8])


def test_the_estimate_grows_with_the_batch_and_the_kept_activations(tiny):
  c, f = tiny
  d = estimates.dims(c)
  totals = [estimates.estimate(d, f, "full", b).total for b in (1, 2, 4, 8)]
  assert totals == sorted(totals) and len(set(totals)) == 4
  per_policy = [estimates.estimate(d, f, r, 8).activations for r in ("full", "save_qkv_proj", "minimal", "none")]
  assert per_policy == sorted(per_policy) and len(set(per_policy)) == 4
  # Accumulation: the same step's activations in micro-batches, plus an accumulator of the gradients.
  whole, split = estimates.estimate(d, f, "full", 8, 1), estimates.estimate(d, f, "full", 8, 4)
  assert split.activations < whole.activations and split.fixed == whole.fixed + f.param_bytes


def test_sharding_over_more_chips_divides_the_state(tmp_path):
  c = load(tmp_path, "base_emb_dim=256", "base_mlp_dim=512", "vocab_size=1024")
  on8 = autofit.facts(c, estimates.Split(8, 1, 1), jax.devices()[:8])
  on4 = autofit.facts(c, estimates.Split(4, 1, 1), jax.devices()[:4])
  assert on4.state_bytes / on8.state_bytes == pytest.approx(2, rel=0.05)
  tensor = autofit.facts(c, estimates.Split(4, 2, 1), jax.devices()[:8])
  assert tensor.state_bytes == pytest.approx(on8.state_bytes, rel=0.05)  # 8 chips either way
  assert tensor.batch_shards == 4 and on8.batch_shards == 8  # the tensor pair holds the same rows


def test_remat_recompute_costs_time_and_tensor_parallelism_costs_activations(tiny):
  c, f = tiny
  d = estimates.dims(c)
  cand = lambda remat: estimates.Candidate(f.split, remat, 1, 4)  # noqa: E731
  full, minimal = (estimates.step_time(d, f, cand(r), 197e12, 0.5, 200e9) for r in ("full", "minimal"))
  assert full > minimal
  assert estimates.recomputed_share("full", f.matmul_share) == 1.0
  assert estimates.recomputed_share("minimal", f.matmul_share) == 0.0
  wide = f._replace(split=estimates.Split(4, 2, 1), batch_shards=4)
  assert estimates.estimate(d, wide, "full", 4).activations > estimates.estimate(d, f, "full", 4).activations


def test_splits_follow_the_heads_and_experts(tmp_path):
  dense = load(tmp_path)  # 4 query heads, 2 kv heads
  assert autofit.splits(dense, 8) == [estimates.Split(8, 1, 1), estimates.Split(4, 2, 1)]
  moe = load(tmp_path, "num_experts=4", "num_experts_per_tok=2")
  assert estimates.Split(2, 1, 4) in autofit.splits(moe, 8) and estimates.Split(1, 2, 4) in autofit.splits(moe, 8)


def test_the_search_bisects_to_the_largest_fitting_batch_and_writes_a_recipe(tmp_path, capsys):
  """A fake compiler whose memory is linear in the batch: the search ends on the batch under the budget with
  the next one compiled and refused, within its compile budget, and the recipe loads with the winner's keys."""
  out = tmp_path / "auto.yml"
  c = load(tmp_path, "dtype=bfloat16", "auto_fit_hbm_gib=0.01", "auto_fit_compiles=6", f"auto_fit_output={out}")
  budget = 0.9 * 0.01 * GiB
  calls = []

  def fake_compile(cfg):
    calls.append((cfg.per_device_batch_size, cfg.remat_policy, cfg.ici_tensor_parallelism))
    total = 2e6 + 0.4e6 * cfg.per_device_batch_size * cfg.ici_tensor_parallelism
    return None if total > 1.2 * budget else total  # far over: XLA's own out-of-memory error

  argv = [BASE, *SIZES, "dtype=bfloat16", "auto_fit=true", f"auto_fit_output={out}"]
  winner = autofit.run(c, argv, jax.devices()[:8], fake_compile)
  assert winner.batch == 19 and winner.split == estimates.Split(8, 1, 1)
  assert (20.0, winner.remat, 1) in calls and len(calls) <= 6
  printed = capsys.readouterr().out
  assert "the next batch was compiled and does not fit" in printed and f"wrote {out}" in printed
  progress = re.findall(r"auto-fit: compile (\d)/6: .* s; at most (\w+) left", printed)  # progress and an ETA
  assert [int(n) for n, _ in progress] == list(range(1, len(calls) + 1)) and progress[-1][1].endswith("s")
  assert re.search(rf"fsdp 8 +{winner.remat} +1 +19 .* yes", printed), printed
  recipe = config.load([str(out), f"base_output_directory={tmp_path}"], {})
  assert recipe.per_device_batch_size == 19 and recipe.remat_policy == winner.remat and recipe.ici_fsdp_parallelism == 8
  assert recipe.base_emb_dim == 64 and not recipe.auto_fit


def test_the_shipped_auto_recipe_runs_by_name(tmp_path):
  """configs/auto/llama2-7b-v5e-256.yml and mixtral-8x7b-v5p-128.yml, written by the searches in benchmarks/README.md
  ("Auto-fit")."""
  c = config.load(["auto/llama2-7b-v5e-256", f"base_output_directory={tmp_path}"], {})
  searched = (c.model_name, c.per_device_batch_size, c.remat_policy, c.ici_fsdp_parallelism)
  assert searched == ("llama2-7b", 20, "full", 256)
  c = config.load(["auto/mixtral-8x7b-v5p-128", f"base_output_directory={tmp_path}"], {})  # with the MoE term
  searched = (c.model_name, c.per_device_batch_size, c.ici_fsdp_parallelism, c.ici_expert_parallelism)
  assert searched == ("mixtral-8x7b", 32, 64, 1)


# Small per-chip shapes, because XLA:TPU's compile time grows with them (128 tokens: the shortest the flash kernel
# takes). On v5e-8 with remat full XLA's totals are 4.86, 4.91, 6.90 and 7.16 MB at batch 3, 4, 5 and 6; the
# budget (0.9 x 0.006 GiB = 5.80 MB) lies in the gap above batch 4, where the search proves its boundary in 3
# compiles (batch 7 over, 4, 5 over). At D=256, 256 tokens and a budget at batch 26 it took 4 compiles (7, 21, 26,
# 27) of 10x the tokens: 108 CPU-seconds, now 32 (2-core AMD EPYC).
TINY_TPU = (
  "log_config=false", "dataset_type=synthetic", "base_emb_dim=128", "base_mlp_dim=256", "base_num_query_heads=4",
  "base_num_kv_heads=4", "head_dim=64", "base_num_decoder_layers=2", "vocab_size=256", "max_target_length=128",
)  # fmt: skip
HBM_GIB = 0.006


def program(c) -> str:
  """What a train step compiles from: every key but the runtime ones compiled_step ignores when it checks a saved
  step against a run, and auto-fit's own search keys (the recipe drops them)."""
  keys = {k: v for k, v in c.to_dict().items() if k not in compiled_step.RUNTIME_KEYS and not k.startswith("auto_fit")}
  return json.dumps(keys, sort_keys=True, default=str)


@pytest.mark.slow
def test_auto_fit_on_v5e_8_fits_and_the_next_batch_does_not(tmp_path, monkeypatch, capsys):
  """The command's main in this process, its compiles kept (the program each compiled and XLA's total): the
  written recipe loads as the very program the search compiled within the budget, and one more sequence per
  chip as the one XLA refused or put over it (compiling the recipe again repeated those two compiles)."""
  out = tmp_path / "tiny-v5e-8.yml"
  compiled, total_or_none = {}, train_compile._total_or_none

  def kept(c, devices):
    compiled[program(c)] = total_or_none(c, devices)
    return compiled[program(c)]

  monkeypatch.setattr(train_compile, "_total_or_none", kept)
  train_compile.main([
    "train_compile.py", BASE, *TINY_TPU, "compile_topology=v5e-8", "auto_fit=true", f"auto_fit_hbm_gib={HBM_GIB}",
    "auto_fit_max_batch=32", "auto_fit_compiles=6", f"auto_fit_output={out}", f"base_output_directory={tmp_path}",
  ])  # fmt: skip
  assert "the next batch was compiled and does not fit" in capsys.readouterr().out
  recipe = [str(out), f"base_output_directory={tmp_path}", "compile_topology=v5e-8"]
  fits = config.load(recipe, {})
  budget = 0.9 * HBM_GIB * GiB
  assert compiled[program(fits)] <= budget
  over = compiled[program(config.load([*recipe, f"per_device_batch_size={fits.per_device_batch_size + 1}"], {}))]
  assert over is None or over > budget


# MoE: the dispatch buffers' rows (estimates.dispatch_rows) against the traced dispatch, and the estimate against
# mixtral-8x7b's compiles on v5p-128 (benchmarks/README.md, "Auto-fit"), from the facts autofit.facts gave there.
MIXTRAL = estimates.Dims(4096, 6144, 4096, 28672, 32, 32000, 4096, 2, estimates.Moe(8, 2, 14336, 0, 0.0))


def mixtral_facts(fsdp, expert):
  layer = {1: 2902540544.0, 8: 362817568.0}[expert]  # one layer's weights over tensor x expert, bf16
  return estimates.Facts(estimates.Split(fsdp, 1, expert), 64, 8759918604, 2919972864, layer, 64, 7.97e10, {})


def expert_rows(moe, ep, x):
  """Rows of the widest expert matmul output (width F) in one shard's traced dispatch (make_jaxpr: nothing
  compiled), as moe_dispatch sizes its buffers for x tokens per shard."""
  d, f = 8, 48  # F distinct from every other width in the trace
  local = moe.experts // ep
  spec = lambda *shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  glu = lambda gate, up: jax.nn.silu(gate) * up  # noqa: E731
  if moe.capacity_factor:
    fn = functools.partial(moe_dispatch.capacity, groups=1, capacity_factor=moe.capacity_factor)
  else:
    fn = functools.partial(moe_dispatch.dropless, ragged=False)
  fn = functools.partial(fn, num_experts=moe.experts, glu=glu)
  args = (spec(ep * x, d), spec(ep * x, moe.k, dtype=jnp.int32), spec(moe.experts, d, f), spec(moe.experts, d, f))
  args += (spec(moe.experts, f, d),)
  if ep == 1:
    traced = jax.make_jaxpr(lambda *a: fn(*a, ep_axes=(), ep=1))(*args)
  else:
    mesh = Mesh(jax.devices()[:ep], ("expert",))
    per_shard = lambda *a: fn(*a, ep_axes=("expert",), ep=ep)  # noqa: E731
    sharded = jax.shard_map(per_shard, mesh=mesh, in_specs=(P("expert"),) * 5, out_specs=P("expert"))
    traced = jax.make_jaxpr(sharded)(*args)
  assert local * ep == moe.experts
  rows = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      rows.extend(math.prod(v.aval.shape[:-1]) for v in eqn.outvars if getattr(v.aval, "shape", ())[-1:] == (f,))
      for param in eqn.params.values():  # shard_map's body, the sort's comparator, ...
        if isinstance(param, (core.Jaxpr, core.ClosedJaxpr)):
          walk(getattr(param, "jaxpr", param))

  walk(traced.jaxpr)
  return max(rows)


@pytest.mark.parametrize(
  "moe, ep",
  [
    (estimates.Moe(8, 2, 48, 0, 0.0), 1),  # dropless on one shard: the k assignments per token
    (estimates.Moe(8, 2, 48, 0, 0.0), 4),  # over 4 shards of 2 experts: 4 x min(2, 2) rows per token
    (estimates.Moe(8, 2, 48, 0, 0.0), 8),  # mixtral's expert=8: 8 x min(2, 1), 4x the assignments
    (estimates.Moe(4, 1, 48, 0, 0.0), 2),  # k=1: 2 x 1
    (estimates.Moe(8, 2, 48, 0, 1.25), 4),  # capacity: 1.25 x k slots per token wherever the experts live
  ],
)
def test_dispatch_rows_are_the_buffers_the_dispatch_traces(moe, ep):
  x = 32  # tokens per shard
  assert expert_rows(moe, ep, x) == estimates.dispatch_rows(moe, ep) * x


def test_dense_estimate_is_unchanged_and_moe_adds_the_dispatch_buffers(tiny):
  c, f = tiny
  d = estimates.dims(c)
  assert d.moe is None
  assert estimates.workspace_per_token(d, f.split) == 0.4 * estimates.saved_per_token(d, "none", 1)
  ep1, ep8 = (estimates.estimate(MIXTRAL, mixtral_facts(64 // e, e), "full", 4).activations for e in (1, 8))
  assert ep8 > 2 * ep1  # the expert axis's worst-case receive buffers, 8 rows per token against 2


@pytest.mark.parametrize(
  "expert, batch, compiled_gib",
  [(8, 4, 31.45), (8, 8, 54.54), (8, 12, 81.12), (8, 13, 91.73), (1, 4, 23.40), (1, 32, 84.01)],
)
def test_the_moe_estimate_lands_near_the_compiled_step(expert, batch, compiled_gib):
  """Before the dispatch term, fsdp 8 x expert 8 at batch 12 was estimated 29.43 GiB for XLA's 81.12."""
  est = estimates.estimate(MIXTRAL, mixtral_facts(64 // expert, expert), "full", batch).total / GiB
  assert est == pytest.approx(compiled_gib, rel=0.15)


def test_every_remat_policy_says_what_it_keeps():
  """autofit's memory and recompute model reads parallel/remat.py's KEEPS and OFFLOADS: every policy is there."""
  assert set(remat_lib.KEEPS) == set(remat_lib.POLICIES)
  assert set(remat_lib.OFFLOADS) <= set(remat_lib.POLICIES)
  assert all(remat_lib.KEEPS[name] == () for name in remat_lib.OFFLOADS)
