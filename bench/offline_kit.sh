#!/usr/bin/env bash
# The GPU check on a GPU machine without internet, whose Python already has torch, torchvision, accelerate, pyarrow,
# pandas, tensorboard and the CUDA stack (a cloud image, a lent machine), but not `datasets` or `airbench`:
#   here, with internet:  bash bench/offline_kit.sh prepare DATA [PYTHON_VERSION]
#       writes .gpu-kit/ in the checkout: wheels of datasets (three releases, so pip there picks one that fits the
#       machine's pyarrow and fsspec) with their pure-Python needs, torchcodec 0.17.0 (--decode gpu), airbench 0.1.8
#       (built here: it is published as a source archive only), and DATA's CIFAR-10 parquet files; .gpu-kit/ is kept
#       out of git
#   there, from the checkout with .gpu-kit/ beside it:
#       bash bench/offline_kit.sh run bash bench/gpu_check.sh OUT
#       installs the carried wheels (nothing is fetched), prints the versions that matter, runs the command offline
#       (bench/gpu_check.py reads .gpu-kit/data/cifar10 when no --data-dir is given)
# PYTHON_VERSION: the GPU machine's Python (default 3.12); the wheels are for x86-64 Linux.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
kit=.gpu-kit
py=${PYTHON:-python3}

case "${1:-}" in
prepare)
    data=${2:?usage: bash bench/offline_kit.sh prepare DATA [PYTHON_VERSION]}
    version=${3:-3.12}
    ls "$data"/*.parquet >/dev/null 2>&1 || { echo "error: $data holds no CIFAR-10 parquet files" >&2; exit 2; }
    grep -qxF "/$kit/" .git/info/exclude 2>/dev/null || echo "/$kit/" >> .git/info/exclude
    mkdir -p "$kit/whl" "$kit/data/cifar10"
    get() {
        "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d "$kit/whl" "$@"
    }
    # newest first, each datasets release with the dill / multiprocess / fsspec it accepts
    get datasets==4.4.1 dill==0.4.0 multiprocess==0.70.18 fsspec==2025.10.0
    get datasets==3.6.0 dill==0.3.8 multiprocess==0.70.16 fsspec==2025.3.0
    get torchcodec==0.17.0  # --decode gpu (nvJPEG); built for torch 2.14
    if ! ls "$kit"/whl/airbench-*.whl >/dev/null 2>&1; then
        src=$(mktemp -d)
        "$py" -m pip download -q --no-deps --no-binary=:all: -d "$src" airbench==0.1.8
        "$py" -m pip wheel -q --no-deps -w "$kit/whl" "$src"/airbench-0.1.8.tar.gz
        rm -rf "$src"
    fi
    cp -u "$data"/*.parquet "$kit/data/cifar10/"
    echo "prepared $kit: $(du -sm "$kit/whl" | cut -f1) MB of wheels, $(du -sm "$kit/data" | cut -f1) MB of data"
    ;;
run)
    shift
    [ -d "$kit/whl" ] || { echo "error: no $kit/whl here: run 'bash bench/offline_kit.sh prepare DATA' first" >&2; exit 2; }
    "$py" -m pip install -q --no-index --find-links "$kit/whl" --no-cache-dir datasets airbench torchcodec
    "$py" -c 'import importlib
for name in ("torch", "torchvision", "accelerate", "datasets", "pyarrow", "airbench", "torchcodec"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:
        print(name, "not importable:", type(e).__name__)
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
    exec "$@"
    ;;
*)
    echo "usage: bash bench/offline_kit.sh prepare DATA [PYTHON_VERSION] | run COMMAND..." >&2
    exit 2
    ;;
esac
