#!/usr/bin/env bash
# Every GPU-only check in one call, under 8 minutes on one GPU: the CUDA tests (python -m pytest -m cuda), the GPU
# races of bench/gpu_race.py (ResNet-18 img/s and MFU, --recipe fast to 94%, airbench94, the ratio), and the ViT's
# memory (bench/fsdp_memory.py) and speed. Results: OUT/results.json, OUT/summary.txt and one log per part.
#
#   bash bench/gpu_check.sh OUT [--data-dir DIR] [--budget SECONDS]        # from the repository root
#   bash bench/offline_kit.sh run bash bench/gpu_check.sh OUT                # an offline GPU machine (docs/gpu-check.md)
#
# Without CUDA it stops at once with one line (exit 1). Exit 0 only when every part passed. PYTHON picks the
# interpreter (default: python3, the one that holds torch on the GPU machines this project is lent).
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
exec "${PYTHON:-python3}" bench/gpu_check.py "$@"
