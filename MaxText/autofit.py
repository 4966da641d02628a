"""Auto-fit: the layout with the most tokens per step per chip that fits a topology's HBM, found by estimating
every candidate and compiling only the few near the frontier (docs/aot.md, "Auto-fit").

    python3 MaxText/train_compile.py MaxText/configs/base.yml model_name=llama2-7b compile_topology=v5e-256 \
      auto_fit=true [auto_fit_margin=0.9] [auto_fit_output=FILE.yml]

The search space: the split of one slice into fsdp x tensor x expert (the dcn_* keys stay the config's),
remat_policy (REMAT_POLICIES, offloading included), gradient_accumulation_steps (1 up to
auto_fit_max_accumulation, powers of 2) and per_device_batch_size (the step's, 1 up to auto_fit_max_batch).
Steps:
1. For each split, the exact per-device bytes of the train state (params + optimizer state, from the state's
   abstract shapes and shardings: nothing compiled, nothing allocated).
2. For each (split, remat, accumulation) group, `estimate` gives the memory of every batch: the state, its
   gradients (and an accumulator), two layers of gathered weights, the activations the remat policy saves,
   one layer's backward workspace (MoE: the dispatch buffers as moe_dispatch sizes them, `dispatch_rows`)
   and the loss's logits. The group's candidate is its largest batch under
   auto_fit_margin x HBM. Candidates are ranked by tokens per step per chip, then by estimated tokens/s.
3. Compiles (at most auto_fit_compiles): the best group is compiled at its estimated batch; each compile
   calibrates the activation term (a per-sample slope from two compiles, else the ratio to the estimate)
   and the next probe bisects on the batch until a batch fits and the next one does not. Then the next
   group, if its calibrated estimate could still beat the winner.
The winner is written as a recipe (train.py runs it by name) and the commands are printed.
The estimates (bytes per device, seconds per step) are autofit_estimate.py's.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import yaml

from MaxText import accelerators, console, memory_fit, optimizers, planner, sharding
from MaxText import config as config_lib
from MaxText import flops as flops_lib
from MaxText import state as state_lib
from MaxText.autofit_estimate import ICI_BYTES_PER_S, Candidate, Dims, Facts, Split, dims, estimate, step_time
from MaxText.config import Config
from MaxText.errors import ConfigError

GiB = 2**30
# Searched remat policies, most memory-frugal first: full keeps layer inputs; the offloaded one keeps
# matmul outputs in host memory; the others keep more on the chip and recompute less.
REMAT_POLICIES = ("full", "minimal_offloaded", "save_qkv_proj", "save_dot_except_mlp", "minimal")
SHOWN = 12  # estimated-only rows in the table
KEYS = ("per_device_batch_size", "remat_policy", "gradient_accumulation_steps")  # searched, beside the split


def splits(config: Config, chips: int) -> list[Split]:
  """The fsdp x tensor x expert splits of one slice's chips that the heads and experts divide."""
  found = []
  for t in (1, 2, 4, 8):
    if config.num_query_heads % t or config.num_kv_heads % t or chips % t:
      continue
    experts = [e for e in (1, 2, 4, 8, 16) if config.num_experts > 1 and config.num_experts % e == 0] or [1]
    found += [Split(chips // (t * e), t, e) for e in experts if chips % (t * e) == 0]
  return found


def facts(config: Config, split: Split, devices: Sequence[Any]) -> Facts:
  """The state's per-device bytes on `split` (abstract: nothing allocated) and the FLOP count."""
  config = config.replace(**split.overrides())
  mesh = sharding.create_mesh(config, devices)
  plan = planner.build(config, mesh)
  tx, _ = optimizers.build(config)
  with sharding.activate(config, mesh):
    spec = state_lib.state_spec(config, tx, mesh, plan)
  params = memory_fit.per_device_bytes(spec.abstract.params)
  d = dims(config)
  embed = d.vocab * d.emb * (1 if config.logits_via_embedding else 2)
  layer = (spec.num_params - embed) / d.layers * d.act_bytes / (split.tensor * split.expert)
  model = flops_lib.abstract_model(config, spec)
  count = flops_lib.training_flops_per_token(config, model)
  mlp_in, mlp_out = 2 * d.emb * d.mlp, d.emb * d.mlp
  width = {"qkv": d.emb * d.qkv, "out": d.context * d.emb, "mlp_in": mlp_in, "mlp_out": mlp_out}
  shares = {k: v / sum(width.values()) for k, v in width.items()}
  batch_shards = math.prod(mesh.shape[a] for a in sharding.data_axes(config) if a in mesh.shape)
  return Facts(
    split, len(devices), memory_fit.per_device_bytes(spec.abstract), params, layer, batch_shards, count.total, shares
  )  # fmt: skip


def candidate_config(config: Config, c: Candidate) -> Config:
  return config.replace(
    **c.split.overrides(), per_device_batch_size=float(c.batch), remat_policy=c.remat,
    gradient_accumulation_steps=c.accumulation, auto_fit=False,
  )  # fmt: skip


def valid(config: Config, c: Candidate, devices: Sequence[Any]) -> bool:
  """Whether the batch splits over the mesh and the plan accepts the layout (its ConfigErrors, not raised)."""
  try:
    cfg = candidate_config(config, c)
    sharding.global_batch_size(cfg, sharding.create_mesh(cfg, devices))
  except ConfigError:
    return False
  return True


class Settings(NamedTuple):
  budget: float  # bytes per device a candidate may use: auto_fit_margin x HBM
  hbm: float
  peak: float  # FLOP/s per device
  ici: float  # bytes/s per chip
  device: str


def settings(config: Config, devices: Sequence[Any]) -> Settings:
  device = devices[0]
  if not 0 < config.auto_fit_margin <= 1:
    raise ConfigError(f"auto_fit_margin={config.auto_fit_margin} must be in (0, 1]: the fraction of HBM to fill")
  hbm = config.auto_fit_hbm_gib * GiB or accelerators.hbm_bytes_per_device(device)
  if not hbm:
    raise ConfigError(
      f"auto_fit needs the HBM of {device.device_kind}, which accelerators.DEVICE_SPECS does not list; "
      "set auto_fit_hbm_gib"
    )
  spec = accelerators.device_spec(device.device_kind)
  peak = spec.peak_flops if spec else accelerators.peak_flops_per_device(device)
  ici = ICI_BYTES_PER_S.get(spec.name if spec else "", 100e9)
  return Settings(config.auto_fit_margin * hbm, hbm, peak, ici, device.device_kind)


def groups(config: Config, devices: Sequence[Any], s: Settings, all_facts: dict[Split, Facts]) -> list[Candidate]:
  """Every (split, remat, accumulation) group at its largest estimated-fitting batch, best first."""
  d = dims(config)
  found = []
  accumulations = [a for a in (1, 2, 4, 8, 16, 32) if a <= config.auto_fit_max_accumulation]
  for split, f in all_facts.items():
    for remat in REMAT_POLICIES:
      for acc in accumulations:
        batches = [b for b in range(acc, config.auto_fit_max_batch + 1, acc)]
        fitting = [b for b in batches if estimate(d, f, remat, b, acc).total <= s.budget]
        for b in reversed(fitting):  # the largest that also splits over the mesh
          c = Candidate(split, remat, acc, b, estimate(d, f, remat, b, acc).total)
          if valid(config, c, devices):
            found.append(dataclasses.replace(c, step_s=step_time(d, f, c, s.peak, config.auto_fit_mfu, s.ici)))
            break
  return sorted(found, key=lambda c: rank(config, c), reverse=True)


def rank(config: Config, c: Candidate) -> tuple[float, float]:
  """auto_fit_objective: tokens per step per chip, then estimated tokens/s (or the other way round)."""
  per_step, per_s = c.batch, c.batch / c.step_s if c.step_s else 0.0
  return (per_s, per_step) if config.auto_fit_objective == "tokens_per_second" else (per_step, per_s)


Compile = Callable[[Config], "float | None"]  # a candidate's config -> XLA's total bytes per device; None: OOM


class Calibration:
  """Compiled totals of one group by batch: predicts the largest batch under the budget by interpolating
  between the compiled batches that bracket it (two compiles), else from the estimate scaled to the compile."""

  def __init__(self, d: Dims, f: Facts, c: Candidate):
    self.d, self.f, self.c = d, f, c
    self.points: dict[int, float | None] = {}

  def predict(self, budget: float, scale: float) -> int:
    step = self.c.accumulation
    under = [(b, m) for b, m in self.points.items() if m is not None and m <= budget]
    over = [(b, m) for b, m in self.points.items() if m is not None and m > budget]
    near = sorted([max(under, default=None), min(over, default=None)] if under and over else under or over)
    measured = [p for p in near if p is not None] if len(near) == 2 else sorted(under + over)[-2:]
    if len(measured) >= 2 and measured[1][1] > measured[0][1]:
      (b0, m0), (b1, m1) = measured
      best = b0 + (budget - m0) * (b1 - b0) / (m1 - m0)
    else:
      est = lambda b: estimate(self.d, self.f, self.c.remat, b, step)  # noqa: E731
      fixed = est(step).fixed
      per_sample = (est(2 * step).activations - est(step).activations) / step * scale
      base = est(step).activations * scale - per_sample * step
      best = (budget - fixed - base) / per_sample if per_sample > 0 else self.c.batch
    return max(step, int(best // step) * step)


def _next_probe(guess: float, lo: int, hi: int | None, cap: int, step: int) -> int | None:
  """The next batch to compile inside (lo, hi): the calibrated guess (lo + step where it says lo is the
  largest), or the middle where the guess is at or above hi (the calibration disagrees with the compiles)."""
  upper = cap if hi is None else hi - step
  if upper <= lo:
    return None
  if hi is not None and guess >= hi:
    return max(lo + step, (lo + hi) // 2 // step * step)
  return min(max(guess, lo + step), upper)


def search_group(
  config: Config, c: Candidate, f: Facts, s: Settings, compile_fn: Compile, left: int, scale: float, began: float
):
  """Bisect one group's batch with compiles: (largest fitting batch or 0, smallest failing or None, compiled
  candidates, compiles left, the calibrated activation scale). `began`: when the search's first compile started
  (each line's ETA: the mean compile so far times the compiles left, an upper bound)."""
  d = dims(config)
  cal = Calibration(d, f, c)
  lo, hi, tried, sides = 0, None, [], []
  probe = c.batch
  while left > 0 and probe is not None and probe not in cal.points:
    cand = dataclasses.replace(c, batch=probe, estimate=estimate(d, f, c.remat, probe, c.accumulation).total)
    started = time.perf_counter()
    total = compile_fn(candidate_config(config, cand))
    left -= 1
    fits = total is not None and total <= s.budget
    done, now = config.auto_fit_compiles - left, time.perf_counter()
    print(
      f"auto-fit: compile {done}/{config.auto_fit_compiles}: {cand.split}, remat {cand.remat}, accumulation "
      f"{cand.accumulation}, batch {probe}: "
      f"{'out of memory' if total is None else f'{total / GiB:.3f} GiB'} (estimated {cand.estimate / GiB:.3f}), "
      f"{'fits' if fits else 'does not fit'}, {now - started:.0f} s; at most "
      f"{console.format_duration((now - began) / done * left)} left",
      flush=True,
    )
    cal.points[probe] = total
    tried.append(dataclasses.replace(cand, compiled=total, fits=fits))
    if total is not None:
      e = estimate(d, f, c.remat, probe, c.accumulation)
      scale = max((total - e.fixed) / e.activations, 0.05)
    lo, hi = (max(lo, probe), hi) if fits else (lo, probe if hi is None else min(hi, probe))
    sides.append(fits)
    guess = cal.predict(s.budget, scale)
    # Safeguard (as in regula falsi's variants): where two compiles in a row fell on the same side of the budget,
    # the next one bisects the bracket, unless the guess is the batch right above the largest that fits.
    if hi is not None and sides[-2:] == [fits, fits] and len(sides) >= 2 and guess > lo + c.accumulation:
      guess = math.inf
    probe = _next_probe(guess, lo, hi, config.auto_fit_max_batch, c.accumulation)
  return lo, hi, tried, left, scale


class Result(NamedTuple):
  winner: Candidate | None
  rows: list[Candidate]  # every candidate the table shows: compiled ones, then the estimated groups
  next_fails: bool | None  # whether the winner's next batch was compiled and did not fit (None: not compiled)
  seconds: float


def search(config: Config, devices: Sequence[Any], compile_fn: Compile) -> Result:
  start = time.perf_counter()
  s = settings(config, devices)
  chips = len(devices) // max(sharding.num_slices(config, devices), 1)
  all_facts = {}
  for split in splits(config, chips):
    try:
      all_facts[split] = facts(config, split, devices)
    except ConfigError:
      continue  # the plan refuses this split (e.g. a width the tensor axis does not divide)
  ranked = groups(config, devices, s, all_facts)
  print(f"auto-fit: {len(ranked)} groups estimated over {len(all_facts)} splits in {time.perf_counter() - start:.0f} s")
  winner, next_fails, compiled, left, scale = None, None, [], config.auto_fit_compiles, 1.0
  began = time.perf_counter()
  for c in ranked:
    if left <= 0:
      break
    if winner is not None and rank(config, _calibrated(config, c, all_facts, s, scale)) <= rank(config, winner):
      continue  # even calibrated as the compiles so far, it cannot beat the winner
    lo, hi, tried, left, scale = search_group(config, c, all_facts[c.split], s, compile_fn, left, scale, began)
    compiled += tried
    if lo:
      best = next(t for t in tried if t.batch == lo)
      if winner is None or rank(config, _timed(config, best, all_facts, s)) > rank(config, winner):
        winner = _timed(config, best, all_facts, s)
        next_fails = None if hi is None else (hi == lo + c.accumulation) or None
  rows = [_timed(config, t, all_facts, s) for t in compiled] + [c for c in ranked]
  return Result(winner, rows, next_fails, time.perf_counter() - start)


def _timed(config: Config, c: Candidate, all_facts: dict[Split, Facts], s: Settings) -> Candidate:
  return dataclasses.replace(
    c, step_s=step_time(dims(config), all_facts[c.split], c, s.peak, config.auto_fit_mfu, s.ici)
  )


def _calibrated(config: Config, c: Candidate, all_facts: dict[Split, Facts], s: Settings, scale: float) -> Candidate:
  """`c` at the largest batch its estimate allows with the activation term scaled as the compiles measured."""
  batch = Calibration(dims(config), all_facts[c.split], c).predict(s.budget, scale)
  return _timed(config, dataclasses.replace(c, batch=min(batch, config.auto_fit_max_batch)), all_facts, s)


def table(result: Result, config: Config, s: Settings) -> str:
  gib = lambda b: "-" if b is None else f"{b / GiB:.3f}"  # noqa: E731
  head = f"{'split':<28} {'remat':<20} {'accum':>5} {'batch':>5} {'est GiB':>8} {'XLA GiB':>8} {'fits':>5} "
  head += f"{'step s':>8} {'tok/s/chip':>10}"
  lines = [
    f"auto-fit for {s.device}: budget {s.budget / GiB:.2f} GiB per chip "
    f"({config.auto_fit_margin:g} x {s.hbm / GiB:.2f} GiB); cost model: FLOPs over peak {s.peak / 1e12:.0f} "
    f"TFLOP/s x MFU {config.auto_fit_mfu:g}, ICI {s.ici / 1e9:.0f} GB/s per chip",
    head,
  ]
  compiled = [c for c in result.rows if c.fits is not None]
  estimated = [c for c in result.rows if c.fits is None]
  for i, c in enumerate(compiled + estimated[:SHOWN]):
    if i == len(compiled):
      lines.append("estimated only (each group's largest batch under the budget, best first):")
    fits = "-" if c.fits is None else ("yes" if c.fits else "no")
    tps = c.batch * config.max_target_length / c.step_s if c.step_s else 0
    lines.append(
      f"{str(c.split):<28} {c.remat:<20} {c.accumulation:>5} {c.batch:>5} {gib(c.estimate):>8} "
      f"{gib(c.compiled):>8} {fits:>5} {c.step_s:>8.3g} {tps:>10,.0f}"
    )
  if len(estimated) > SHOWN:
    lines.append(f"... and {len(estimated) - SHOWN} more estimated groups")
  lines.append(f"search: {len(compiled)} compiles, {len(estimated)} groups estimated, {result.seconds:.0f} s")
  return "\n".join(lines)


def recipe_path(config: Config) -> str:
  if config.auto_fit_output:
    return config.auto_fit_output
  return os.path.join(config_lib.CONFIG_DIR, "auto", f"{config.model_name}-{config.compile_topology}.yml")


def recipe_text(config: Config, argv: Sequence[str], c: Candidate, result: Result) -> str:
  """The winner as a config file: the user's config (base_config) and command-line keys, then the searched keys."""
  skip = ("auto_fit", "compile_topology", "compiled_trainstep_file", "base_output_directory", "run_name", "log_config")
  user = [a.split("=", 1)[0].strip() for a in argv[1:] if "=" in a]
  values = {k: config[k] for k in user if not k.startswith(skip) and k not in KEYS}
  values.update({k: v for k, v in c.split.overrides().items()})
  values.update(per_device_batch_size=float(c.batch), remat_policy=c.remat, gradient_accumulation_steps=c.accumulation)
  source = config_lib.resolve_config_path(argv[0])
  inside = os.path.relpath(os.path.abspath(source), config_lib.CONFIG_DIR)
  head = [
    f"# auto-fit (train_compile.py auto_fit=true) for {config.compile_topology} "
    f"x {config.compile_topology_num_slices}: {c.batch} x {config.max_target_length} tokens per chip per step,",
    f"# {c.compiled / GiB:.2f} GiB per chip compiled (budget {config.auto_fit_margin:g} x HBM); estimated "
    f"{c.step_s:.3g} s per step; search {result.seconds:.0f} s.",
    f"#   python3 MaxText/train_compile.py {recipe_name(config)} compile_topology={config.compile_topology}",
  ]
  if os.path.basename(source) != "base.yml" or inside.startswith(".."):
    values = {"base_config": inside if not inside.startswith("..") else os.path.abspath(source), **values}
  return "\n".join(head) + "\n" + yaml.safe_dump(values, sort_keys=False)


def recipe_name(config: Config) -> str:
  """The name train.py takes for the written recipe: its name under configs/, else its path."""
  path = os.path.abspath(recipe_path(config))
  inside = os.path.relpath(path, config_lib.CONFIG_DIR)
  return path if inside.startswith("..") or not path.endswith(".yml") else inside[: -len(".yml")]


def run(config: Config, argv: Sequence[str], devices: Sequence[Any], compile_fn: Compile) -> Candidate:
  """train_compile.py auto_fit=true: search, print the table, write the winner's recipe and its commands."""
  s = settings(config, devices)
  result = search(config, devices, compile_fn)
  print(table(result, config, s), flush=True)
  if config.auto_fit_compiles == 0 and result.rows:  # estimate only: nothing verified, so no recipe
    best = result.rows[0]
    print(
      f"estimate only (auto_fit_compiles=0): best {best.split}, remat {best.remat}, accumulation "
      f"{best.accumulation}, per_device_batch_size {best.batch}; no recipe written",
      flush=True,
    )
    return best
  if result.winner is None:
    raise ConfigError(
      f"auto_fit: no candidate fits {config.auto_fit_margin:g} x {s.hbm / GiB:.2f} GiB per chip of {s.device} "
      f"within auto_fit_compiles={config.auto_fit_compiles}; use a bigger compile_topology, raise "
      "auto_fit_max_accumulation or auto_fit_compiles"
    )
  w = result.winner
  path = recipe_path(config)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    f.write(recipe_text(config, argv, w, result))
  checked = {True: "the next batch was compiled and does not fit", None: "the next batch was not compiled"}
  print(
    f"winner: {w.split}, remat {w.remat}, accumulation {w.accumulation}, per_device_batch_size {w.batch}: "
    f"{w.compiled / GiB:.2f} GiB per chip compiled; {checked[result.next_fails]}\n"
    f"wrote {path}\n"
    f"  python3 MaxText/train.py {recipe_name(config)} run_name=NAME base_output_directory=DIR\n"
    f"  python3 MaxText/train_compile.py {recipe_name(config)} compile_topology={config.compile_topology}",
    flush=True,
  )
  return w
