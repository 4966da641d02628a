"""The values of `attention`: the training-attention kernels. The one list of the names (config.CHOICES
reads it); the run plan chooses among them (parallel/plan.py) and layers/attention.py runs the choice.

- autoselected: the plan picks for the target platform and shapes;
- dot_product: XLA einsums, any platform, query-chunked with attention_query_chunk, context-parallel;
- flash: Pallas splash kernels (TPU; Pallas' interpreter elsewhere, for tests);
- cudnn_flash_te: cuDNN fused attention (NVIDIA GPUs).
"""

KINDS = ("autoselected", "dot_product", "flash", "cudnn_flash_te")
