"""P1: training throughput of the seed's DDP script (bench/seed_ddp.py: gloo, DistributedSampler, per-sample
PIL + ToTensor DataLoader with 4 workers, torchvision resnet18, AdamW, batch 128 per rank) against
train_cifar.py --model resnet18_imagenet on the same images, 2 ranks, batch 128 per rank, AdamW, same
epochs, no augmentation and no gradient clipping in either (the seed has neither); ours as shipped (cpu.yaml's
fp32 and the script's default channels_last) and, on a CPU that computes bf16 natively (AVX512-BF16 or AMX), also
with --mixed_precision bf16 (autocast, gradients all-reduced in bf16). Runs alternate. Goal: >= 1.4x.

    python bench/seed_throughput.py --data-dir ../shared/data/cifar10
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import add_data_args, data_flags, header, report  # noqa: E402
from utils.launch import cpu_bf16_native  # noqa: E402


def run(cmd: list[str]) -> str:
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{result.stderr[-3000:]}")
    return result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(parser)
    parser.add_argument("--images", type=int, default=5120)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    header("P1 training throughput: the seed's DDP script vs train_cifar.py, 2 CPU ranks")
    data = data_flags(args)
    seed_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "bench/seed_ddp.py", *data, "--images", str(args.images), "--epochs", str(args.epochs)]
    out = tempfile.mkdtemp(prefix="p1_")

    variants = {"as shipped (cpu.yaml: fp32, channels_last)": []}
    if cpu_bf16_native():  # elsewhere bf16 is emulated, many times slower than fp32
        variants["with --mixed_precision bf16 (autocast + bf16 all-reduce)"] = ["--mixed_precision", "bf16"]

    def ours_cmd(precision: list[str]) -> list[str]:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml",
                  "--main_process_port", "0", *precision]
        return [*launch, "train_cifar.py", *data, "--model", "resnet18_imagenet", "--optimizer", "adamw", "--lr",
                "1e-3", "--weight-decay", "0.01", "--batch-size", "128", "--augment", "none", "--grad-clip", "0",
                "--train-subset", str(args.images), "--eval-subset", "100", "--epochs", str(args.epochs), "--tracker",
                "none", "--output-dir", out, "--overwrite"]

    print("seed:", " ".join(seed_cmd[1:]))
    print("ours:", " ".join(ours_cmd([])[1:]))
    seed, ours = [], {name: [] for name in variants}
    for _ in range(args.repeats):
        seed.append(json.loads(run(seed_cmd).strip().splitlines()[-1])["images_per_sec"])
        for name, precision in variants.items():
            run(ours_cmd(precision))
            ours[name].append(json.loads((Path(out) / "summary.json").read_text())["train_images_per_sec"])
    for name, speeds in ours.items():
        report(f"train_cifar.py {name}", speeds, "seed", seed)

if __name__ == "__main__":
    main()
