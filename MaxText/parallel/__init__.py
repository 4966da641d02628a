"""How a run executes, apart from what the model computes.

plan.py holds the frozen `Plan` types: the attention kernel, the context-parallel split, the pipeline
schedule, the MoE dispatch, the loss's vocab tiling, the remat policy, the TPU layout constraints and the data
axes. The builder that decides them once before anything is traced, raising every layout error, sits above
the model families (MaxText/planner.py). The model receives the frozen `Plan` when it is built and reads its
decisions; it never looks at the mesh or the platform. The `jax.shard_map` wrappers that run a piece of the
model per shard live in ops.py; remat.py names the remat policies, kernels.py the attention kernels.

This package sits below the layers: nothing in it imports a layer, a model family or the builder.
"""
