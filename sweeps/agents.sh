#!/usr/bin/env bash
# One W&B sweep agent per GPU of this machine, each trial on its own GPU (the sweep's command launches one process
# with accelerate_configs/1gpu.yaml). From the repository root, after `wandb sweep sweeps/FILE.yaml`:
#   bash sweeps/agents.sh ENTITY/PROJECT/SWEEP_ID [TRIALS_PER_AGENT]
# GPUS (default: every GPU nvidia-smi lists) picks them: GPUS="0 1" bash sweeps/agents.sh ...
# Ctrl-C (or SIGTERM) stops the agents; their running trials checkpoint first (--forward-signals) and continue when
# the agent starts them again.
set -euo pipefail
cd "$(dirname "$0")/.."
sweep=${1:?usage: bash sweeps/agents.sh ENTITY/PROJECT/SWEEP_ID [TRIALS_PER_AGENT]}
count=${2:+--count $2}
gpus=${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader)}
pids=()
for gpu in $gpus; do
    CUDA_VISIBLE_DEVICES=$gpu wandb agent --forward-signals $count "$sweep" &
    pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' INT TERM
wait
