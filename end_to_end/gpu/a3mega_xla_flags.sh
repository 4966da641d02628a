#!/usr/bin/env bash
# XLA flags for training on A3 Mega (8 x H100 per node, GPUDirect-TCPXO between nodes). Source it:
#   source end_to_end/gpu/a3mega_xla_flags.sh   (appends to XLA_FLAGS; multihost_job.py --PLATFORM=vertex uses it)
# Why each one:
A3MEGA_XLA_FLAGS=(
  # Overlap collectives with compute: schedule by estimated latency instead of program order.
  --xla_gpu_enable_latency_hiding_scheduler=true
  # cuBLAS beats Triton for the large bf16 GEMMs of LLM layers; Triton autotuning also costs compile time.
  --xla_gpu_enable_triton_gemm=false
  # Combine many small per-layer collectives into a few large ones: fewer launches, better bandwidth.
  --xla_gpu_all_reduce_combine_threshold_bytes=134217728
  --xla_gpu_all_gather_combine_threshold_bytes=134217728
  --xla_gpu_reduce_scatter_combine_threshold_bytes=67108864
  # Pipeline FSDP's all-gathers / reduce-scatters across scanned layers: layer i+1's gather runs during layer i.
  --xla_gpu_enable_pipelined_all_gather=true
  --xla_gpu_enable_pipelined_reduce_scatter=true
  --xla_gpu_enable_pipelined_all_reduce=true
  # Double-buffer the scanned layer loop so the pipelined collectives have a buffer to land in.
  --xla_gpu_enable_while_loop_double_buffering=true
  # Combine collectives across different dimensions too (with scan the combined sizes stay bounded).
  --xla_gpu_enable_all_gather_combine_by_dim=false
  --xla_gpu_enable_reduce_scatter_combine_by_dim=false
  # XLA's own rematerialisation fights remat_policy; the config decides what is recomputed.
  --xla_disable_hlo_passes=rematerialization
)
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }${A3MEGA_XLA_FLAGS[*]}"
