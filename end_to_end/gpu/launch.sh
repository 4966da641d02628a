#!/usr/bin/env bash
# Run train.py on one GPU node of a multi-node job: one process per node driving all its GPUs.
# Run it on every node (Vertex AI custom job, GKE, Slurm `srun --ntasks-per-node=1`, or multihost_runner.py):
#   JAX_COORDINATOR_ADDRESS=node0 JAX_COORDINATOR_PORT=6002 NNODES=2 NODE_RANK=0 GPUS_PER_NODE=8 \
#     bash end_to_end/gpu/launch.sh MaxText/configs/base.yml run_name=gpu_run [key=value ...]
# Under Slurm, NNODES/NODE_RANK/JAX_COORDINATOR_ADDRESS default from SLURM_NNODES/SLURM_NODEID/the first node.
# XLA_FLAGS: the A3 Mega recipe (a3mega_xla_flags.sh) unless XLA_RECIPE=none. It passes hardware=gpu unless a
# key=value word says otherwise (hardware=cpu XLA_RECIPE=none: a rehearsal on CPU).
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -n "${SLURM_JOB_ID:-}" ]; then
  : "${NNODES:=${SLURM_NNODES:-1}}" "${NODE_RANK:=${SLURM_NODEID:-0}}"
  : "${JAX_COORDINATOR_ADDRESS:=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"
fi
export NNODES="${NNODES:-1}" NODE_RANK="${NODE_RANK:-0}" GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
export JAX_COORDINATOR_ADDRESS="${JAX_COORDINATOR_ADDRESS:-127.0.0.1}" JAX_COORDINATOR_PORT="${JAX_COORDINATOR_PORT:-6002}"
if [ "${XLA_RECIPE:-a3mega}" = a3mega ]; then
  source end_to_end/gpu/a3mega_xla_flags.sh
fi
# Let XLA own GPU memory (it plans the step's peak) and keep NCCL on the right interfaces (set by the image).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
echo "launch.sh: node $NODE_RANK of $NNODES, $GPUS_PER_NODE GPUs, coordinator $JAX_COORDINATOR_ADDRESS:$JAX_COORDINATOR_PORT"
[ $# -gt 0 ] || { echo "launch.sh: give the config first, e.g. MaxText/configs/base.yml run_name=r (see --help)" >&2; exit 2; }
config="$1"
shift
# -m from the repository root imports this checkout's MaxText even in an image where setup.sh did not install it.
# hardware=gpu comes before the key=value words, so one of them (hardware=cpu: a rehearsal on CPU) wins.
exec "${PYTHON:-python3}" -m MaxText.train "$config" hardware=gpu "$@"
