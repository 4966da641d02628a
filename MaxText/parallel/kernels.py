"""The values of `attention`: the training-attention kernels. The one list of the names (config.CHOICES
reads it); the run plan chooses among them (`choose`, for the plan's lengths) and layers/attention.py runs
the choice.

- autoselected: the plan picks for the target platform and shapes;
- dot_product: XLA einsums, any platform, query-chunked with attention_query_chunk, context-parallel;
- flash: Pallas splash kernels (TPU; Pallas' interpreter elsewhere, for tests);
- cudnn_flash_te: cuDNN fused attention (NVIDIA GPUs).
"""

KINDS = ("autoselected", "dot_product", "flash", "cudnn_flash_te")
# TPU vector lanes: the splash kernel tiles the sequence in blocks that are multiples of this.
LANES = 128


def choose(
  requested: str, platform: str, context_shards: int, length: int, soft_cap: float, sinks: bool = False
) -> tuple[str, str]:
  """(kernel, why): config.attention, with autoselected resolved for the platform: flash (Pallas splash) on
  TPU, cuDNN on NVIDIA GPUs, dot_product elsewhere or where the fused kernel cannot take the shapes (or the
  attention sinks)."""
  if requested != "autoselected":
    return requested, f"attention={requested} in the config"
  if sinks:
    return "dot_product", "autoselected: attention_sink, which only dot_product takes"
  if context_shards > 1:  # the kernels see a whole sequence; dot_product runs per context shard
    return "dot_product", f"autoselected: context parallelism over {context_shards} shards runs dot_product"
  if platform == "tpu" and length % LANES == 0:
    return "flash", "autoselected: TPU, length a multiple of 128 (Pallas splash)"
  if platform == "tpu":
    return "dot_product", f"autoselected: TPU, but length {length} is not a multiple of {LANES} for flash"
  if platform == "gpu" and not soft_cap:
    return "cudnn_flash_te", "autoselected: NVIDIA GPU, no attention soft-cap (cuDNN flash)"
  if platform == "gpu":
    return "dot_product", "autoselected: GPU with attn_logits_soft_cap, which cuDNN does not take"
  return "dot_product", f"autoselected: no fused kernel on {platform}"
