#!/usr/bin/env bash
# One GPU, one call, under 8 minutes: ResNet-18 images/s (bf16, channels_last, compile), the training time of
# `train_cifar.py --recipe fast` to 94% test top-1, and the PyPI airbench94 on the same GPU, with the ratio.
#
#   bash bench/gpu.sh --data-dir ../shared/data/cifar10      # from the repository root, on the GPU machine
#
# An offline GPU machine needs airbench brought along: `pip download airbench --no-deps -d .whl` here, then
# `pip install --no-index --no-deps .whl/airbench-*` there before this script. Prints the machine, the versions,
# every command it runs and the measured numbers (see bench/gpu_race.py for how each time is taken).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
exec timeout 480 python bench/gpu_race.py "$@"
