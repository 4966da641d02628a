"""Our checkpoint -> upstream MaxText's params-only layout, for its load_parameters_path (train or decode).

    python3 -m MaxText.convert.to_upstream CONFIG.yml load_parameters_path=PARAMS [key=value ...] --output DIR \
      [--dtype bfloat16]

PARAMS: a params-only checkpoint or a train state's `state` directory (ours, or upstream's: any layout
load_parameters_path reads). DIR (local or gs://) becomes an orbax PyTree checkpoint with upstream's Linen
tree {params: {params: {decoder: ..., token_embedder: ...}}}: layers stacked on axis 1 when the config's
scan_layers is true (upstream's param_scan_axis; pass scan_layers=false for layers_<i>), gated MLP inputs
as wi_0/wi_1, mixtral's experts in MoeBlock_0, and the query kernels divided by sqrt(head_dim) (upstream's
attention has no such factor). Give upstream the same scan_layers. Layout facts: MaxText/convert/upstream.py.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from MaxText import checkpointing, launch, paths
from MaxText import state as state_lib
from MaxText.config import Config
from MaxText.convert import upstream
from MaxText.errors import ConfigError

DTYPES = ("float32", "bfloat16")


def export(c: Config, output: str, dtype: str = "float32") -> None:
  """Write the params of c.load_parameters_path (laid out per c.scan_layers) to `output` in upstream's tree."""
  if not c.load_parameters_path:
    raise ConfigError("to_upstream needs load_parameters_path=<the checkpoint to export>")
  fam = upstream.family(c)  # refuses a family upstream's trees are not mapped for, before any loading
  if c.scan_layers and fam.block and fam.layers % fam.block and not fam.remainder:
    raise ConfigError(
      f"upstream scans {c.decoder_block} in whole cycles of {fam.block} layers only, and num_decoder_layers="
      f"{fam.layers} is not a multiple: pass scan_layers=false"
    )
  spec = state_lib.param_spec(state_lib.for_inference(c))
  params = checkpointing.load_params(c.load_parameters_path, spec.abstract, c)
  # cast after re-laying: the query kernels are rescaled first, in float32 (a bf16 cast before would round twice)
  tree = upstream.from_ours(jax.tree.map(np.asarray, nnx.to_pure_dict(params)), fam)
  tree = {"params": {"params": jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), tree)}}
  checkpointer = ocp.PyTreeCheckpointer()
  checkpointer.save(paths.absolute(output), tree)
  jax.effects_barrier()


def main(argv: Sequence[str]) -> None:
  """argv: sys.argv (the program name first)."""
  where = "directory to write (an orbax checkpoint)"
  output = launch.export_main(
    argv, "MaxText.convert.to_upstream", __doc__, "docs/checkpoints.md", where, DTYPES, export
  )
  print(f"Wrote {output} (upstream MaxText params; its load_parameters_path)")


if __name__ == "__main__":
  main(sys.argv)
