"""Quantized serving: int8 weights (quantization=int8w), the int8/fp8 KV cache (quantize_kvcache), saved int8
params, and the settings that cannot work together.

Greedy tokens are compared with the float model's on a tiny model; the tests also check that they may be:
along the float model's greedy path, every step's gap between the two most likely tokens is more than
twice the largest logit change quantization causes, so no argmax can flip. Random tiny models have small
gaps (vocabulary 64: often < 0.05, while int8 weights move logits by ~0.05); init_weights_seed=3 with
PROMPT has a smallest gap of 0.17 against a change of 0.06, which is why they are used here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from MaxText import config, decode
from MaxText.errors import ConfigError
from MaxText.inference import Engine, engine, quantize
from MaxText.layers import kv_cache
from MaxText.tests.conftest import BASE
from MaxText.tests.helpers import DECODE_FAMILIES, DECODE_TINY

PROMPT = [[5, 9, 33, 7, 50]]
NEW = 8


def load(*overrides):
  return config.load(
    [BASE, *DECODE_TINY, "ici_fsdp_parallelism=2", "ici_data_parallelism=-1", "init_weights_seed=3", *overrides], {}
  )


@pytest.fixture(scope="module")
def float_engine():
  return Engine.load(load())


def greedy(e: Engine) -> list[int]:
  return e.generate(PROMPT, NEW, strategy="greedy", stop_tokens=[]).completions[0].tokens


def path_logits(e: Engine, tokens: list[int]) -> np.ndarray:
  """Logits [T, V] of one prefill over `tokens` (through the engine's cache, quantized or not)."""
  ids, lengths = jnp.asarray([tokens + [0] * (16 - len(tokens))], jnp.int32), jnp.asarray([len(tokens)])
  logits, _ = jax.jit(engine.prefill, static_argnums=(0, 1))(e.graphdef, 16, e.params, ids, lengths)
  return np.asarray(logits[0, : len(tokens)], np.float32)


def gap_and_change(reference: Engine, other: Engine) -> tuple[float, float]:
  """Along the reference's greedy path: its smallest top-2 logit gap, and the largest logit change in `other`."""
  path, first = PROMPT[0] + greedy(reference), len(PROMPT[0]) - 1
  a, b = path_logits(reference, path)[first:-1], path_logits(other, path)[first:-1]
  top2 = np.sort(a, axis=-1)[:, -2:]
  return float((top2[:, 1] - top2[:, 0]).min()), float(np.abs(a - b).max())


def assert_same_greedy_tokens(reference: Engine, other: Engine) -> None:
  """Equal greedy tokens, on a path where the reference's top-2 gaps exceed twice the largest logit change."""
  gap, change = gap_and_change(reference, other)
  assert gap > 2 * change, f"margins too small to compare tokens: top-2 gap {gap}, logit change {change}"
  assert greedy(other) == greedy(reference)


def test_int8_weights_give_the_float_models_greedy_tokens(float_engine):
  e = Engine.load(load("quantization=int8w"))
  kernel = e.params["layers"]["mlp"]["wi"][0]["kernel"].get_value()
  assert isinstance(kernel, qwix.QArray) and kernel.qvalue.dtype == jnp.int8 and kernel.scale.dtype == jnp.float32
  assert kernel.scale.shape == (2, 1, 48)  # [layers, contracted embed dim, one scale per output channel]
  assert "quantized to int8" in e.source
  assert quantize.weight_bytes(e.params) < 0.6 * quantize.weight_bytes(float_engine.params)
  assert_same_greedy_tokens(float_engine, e)


def test_int8_kv_cache_is_int8_and_gives_the_same_greedy_tokens(float_engine):
  e = Engine.load(load("quantize_kvcache=true"))
  tokens, lengths = jnp.asarray([PROMPT[0] + [0] * 3], jnp.int32), jnp.asarray([5])
  _, cache = jax.jit(engine.prefill, static_argnums=(0, 1))(e.graphdef, 16, e.params, tokens, lengths)
  layer = jax.tree.leaves(cache, is_leaf=lambda x: isinstance(x, kv_cache.KVCache))[0]
  assert layer.key.dtype == layer.value.dtype == jnp.int8
  assert layer.key_scale.dtype == jnp.float32 and layer.key_scale.shape == layer.key.shape[:-1]
  assert_same_greedy_tokens(float_engine, e)


def test_kv_quantization_round_trip_is_close_per_token_and_head():
  x = jax.random.normal(jax.random.key(0), (2, 5, 3, 8)) * jnp.arange(1, 6)[None, :, None, None]
  x = x.at[0, 0].set(0.0)  # a zero (padding) vector stays zero
  for dtype, tolerance in ((jnp.int8, 0.5 / 127), (jnp.float8_e4m3fn, 2.0**-4)):
    q, scale = kv_cache.quantize(x, dtype)
    assert q.dtype == dtype and scale.shape == (2, 5, 3)
    back = q.astype(jnp.float32) * scale[..., None]
    bound = tolerance * jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    assert bool(jnp.all(jnp.abs(back - x) <= bound + 1e-7)) and not bool(jnp.any(back[0, 0]))


@pytest.mark.slow  # two MoE engines: ~45 s on 2 busy cores
def test_moe_experts_are_int8_and_the_router_stays_float():
  e = Engine.load(load(*DECODE_FAMILIES["mixtral"], "quantization=int8w"))
  moe = e.params["layers"]["mlp"]
  assert all(isinstance(moe[name].get_value(), qwix.QArray) for name in quantize.MOE_WEIGHTS)
  assert moe["gate"]["kernel"].get_value().dtype == jnp.float32
  # Here the smallest top-2 gap (0.077) is close to the change (0.069): logits are compared, not tokens.
  assert gap_and_change(Engine.load(load(*DECODE_FAMILIES["mixtral"])), e)[1] < 0.1


@pytest.mark.slow  # decode.py, then two engines: ~65 s on 2 busy cores
def test_saved_int8_params_decode_without_quantizing_again(tmp_path, capsys):
  path = str(tmp_path / "int8")
  args = [BASE, *DECODE_TINY, "vocab_size=320", "init_weights_seed=3", "prompt=hi", "decode_max_new_tokens=4"]
  decode.main(["decode.py", *args, "quantization=int8w", f"save_quantized_params_path={path}"])
  assert f"Saved int8 params to {path}" in capsys.readouterr().out
  assert quantize.is_quantized_checkpoint(path)
  fresh, saved = (
    Engine.load(load("vocab_size=320", "quantization=int8w")),
    Engine.load(load("vocab_size=320", "quantization=int8w", f"load_parameters_path={path}")),
  )
  assert "as saved" in saved.source
  for a, b in zip(jax.tree.leaves(fresh.params), jax.tree.leaves(saved.params)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
  assert_same_greedy_tokens(fresh, saved)
  with pytest.raises(ConfigError, match="holds int8 weights.*add quantization=int8w"):
    Engine.load(load("vocab_size=320", f"load_parameters_path={path}"))
  with pytest.raises(ConfigError, match="does not match this model"):  # another architecture
    Engine.load(load("quantization=int8w", f"load_parameters_path={path}"))


@pytest.mark.parametrize(
  "overrides, message",
  [
    (["quantization=int8"], "is a training mode"),
    (["quantize_kvcache=true", "kv_quant_dtype=int4"], "kv_quant_dtype='int4' is not one of"),
    (["save_quantized_params_path=/tmp/x"], "add quantization=int8w"),
    ([*DECODE_FAMILIES["deepseek"], "quantize_kvcache=true"], "not supported with MLA"),
  ],
)
def test_settings_that_cannot_work_together_fail_with_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message) as error:
    quantize.check(load(*overrides))
  assert "\n" not in str(error.value)
