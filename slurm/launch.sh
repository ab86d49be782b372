#!/usr/bin/env bash
# One `accelerate launch` per node, configured from SLURM's environment; srun runs it once on every node.
# Used by train_1node.sbatch and train_multinode.sbatch; runnable by hand with the same variables set.
#   SLURM_NNODES, SLURM_NODEID      how many nodes, and this one's index (the machine rank)
#   SLURM_JOB_NODELIST              the nodes; the first is the head (rendezvous host), via `scontrol show hostnames`
#   GPUS_PER_NODE                   processes per node (default: SLURM_GPUS_ON_NODE, else 1)
#   MAIN_PORT                       rendezvous port on the head node (default 29500)
#   RDZV_BACKEND                    c10d (default: elastic, tolerant of node start order) or static
#   MIXED_PRECISION                 bf16 (default), fp16 or no
#   SCRIPT                          the training script (default train_cifar.py; also train_minimal.py)
#   everything after `--` goes to the script
set -euo pipefail
cd "$(dirname "$0")/.."
nodes=${SLURM_NNODES:-1}
node_rank=${SLURM_NODEID:-0}
per_node=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
head_node=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" | head -n 1)
port=${MAIN_PORT:-29500}
[ "${1:-}" = "--" ] && shift
# exec: the launcher replaces this shell, so a SIGTERM sent to the job step reaches it, and it forwards
# SIGTERM to the training processes, which checkpoint at the next health check (every 10 optimizer steps) and exit.
processes=$((nodes * per_node))
multi=""
[ "$processes" -gt 1 ] && multi=--multi_gpu  # one process (an array task on 1 GPU): Accelerate refuses --multi_gpu
exec python -m accelerate.commands.launch $multi \
    --num_machines "$nodes" --machine_rank "$node_rank" --num_processes "$processes" \
    --main_process_ip "$head_node" --main_process_port "$port" --rdzv_backend "${RDZV_BACKEND:-c10d}" \
    --mixed_precision "${MIXED_PRECISION:-bf16}" \
    "${SCRIPT:-train_cifar.py}" --resume auto "$@"
