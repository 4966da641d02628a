"""How a run executes, apart from what the model computes.

`plan.build(config, mesh)` decides once, before anything is traced, how this run is laid out: the
attention kernel, the context-parallel split, the pipeline schedule, the MoE dispatch, the loss's vocab
tiling, the remat policy, the TPU layout constraints and the data axes (plan.py). Every configuration
error about the layout is raised there. The model receives the frozen `Plan` when it is built and reads
its decisions; it never looks at the mesh or the platform. The `jax.shard_map` wrappers that run a piece
of the model per shard live in ops.py; remat.py names the remat policies.

Kept light: layers import `MaxText.parallel.ops` and `MaxText.parallel.remat`, so this package's
__init__ imports nothing (plan.py imports the model families, which import the layers).
"""
