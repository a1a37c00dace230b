#!/usr/bin/env bash
# shardkit continue-pretrain under torchrun: {{LAYOUT}} ({{WORLD}} GPUs: {{NODES}} node(s) x {{GPUS_PER_NODE}}).
# {{RUN}}
# Template: `shardkit launch` fills in the double-brace fields (plan/templates/torchrun.sh in the shardkit package).
# Run the rendered script once per node with NODE_RANK=0..NNODES-1 and MASTER_ADDR set to node 0, or submit the
# sbatch script rendered beside it, which runs it once per rank under srun with SHARDKIT_LAUNCHER=srun (no torchrun:
# each SLURM task is one rank). Environment variables override the rendered defaults.
set -euo pipefail

NNODES=${NNODES:-{{NODES}}}
GPUS_PER_NODE=${GPUS_PER_NODE:-{{GPUS_PER_NODE}}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
MASTER_ADDR=${MASTER_ADDR:-{{MASTER_ADDR}}}
MASTER_PORT=${MASTER_PORT:-{{MASTER_PORT}}}

# NCCL and CUDA settings Megatron-style training expects
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # keeps TP/SP collectives ordered with compute
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a failed rank stops the job, no hang
export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_IB_RETRY_CNT=${NCCL_IB_RETRY_CNT:-10}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
{{ENV}}{{RESUME}}
# the Python that runs shardkit, found when the job runs (nothing of the submitting machine is written here):
# SHARDKIT_PYTHON, else python3 on PATH (sbatch passes the submitting shell's environment on: an activated venv)
PYTHON=${SHARDKIT_PYTHON:-python3}
if ! "$PYTHON" -c 'import shardkit, torch' 2>/dev/null; then
    echo "$0: $PYTHON cannot import shardkit and torch: activate the environment shardkit is installed in, or set" \
         "SHARDKIT_PYTHON to its python" >&2
    exit 2
fi
case ${SHARDKIT_LAUNCHER:-torchrun} in
    # torchrun's own agent and arguments; a failed job ends in one line, not torchrun's traceback (shardkit/torchrun.py)
    torchrun) launcher=("$PYTHON" -m shardkit.torchrun
                        --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --node-rank "$NODE_RANK"
                        --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT") ;;
    srun) launcher=("$PYTHON") ;;  # this process is one rank: the trainer reads SLURM_PROCID, SLURM_NTASKS, MASTER_ADDR
    *) echo "$0: SHARDKIT_LAUNCHER=$SHARDKIT_LAUNCHER: expected torchrun or srun" >&2; exit 2 ;;
esac
exec "${launcher[@]}" -m shardkit continue-pretrain \
{{ARGS}}
