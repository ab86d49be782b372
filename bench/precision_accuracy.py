"""Does bf16 autocast + channels_last cost accuracy on the CPU? The quick-start job (cpu.yaml: 2 processes x 128,
resnet18_imagenet, 10,000 training images x 5 epochs, full test set) in fp32 and in bf16 + channels_last, over
several seeds, alternating; prints each run, the mean +/- std top-1 of both, and the throughput ratio.

    python bench/precision_accuracy.py --data-dir ../shared/data/cifar10 --seeds 3      # about 8 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import add_data_args, data_flags, header, report  # noqa: E402

SETTINGS = {"fp32": ["--mixed_precision", "no"], "bf16+channels_last": ["--mixed_precision", "bf16"]}


def run(setting: str, seed: int, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / "cpu.yaml"),
           "--main_process_port", "0", *SETTINGS[setting], str(REPO / "train_cifar.py"), "--model", "resnet18_imagenet",
           "--train-subset", str(args.train_subset), "--epochs", str(args.epochs), "--seed", str(seed), "--tracker", "none",
           "--output-dir", str(out), *(["--channels-last"] if "channels_last" in setting else []),
           *data_flags(args)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(result.stderr[-3000:])
    s = json.loads((out / "summary.json").read_text())
    print(f"{setting:>20} seed {seed}: top-1 {s['eval_top1']:.2f}%  {s['train_images_per_sec']:,.0f} img/s", flush=True)
    return s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(parser)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--train-subset", type=int, default=10_000)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    header("bf16 + channels_last vs fp32: accuracy and speed of the quick-start job")
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for name in SETTINGS:
                results[name].append(run(name, seed, args, Path(tmp) / f"{name}-{seed}"))
    for name, runs in results.items():
        top1 = [s["eval_top1"] for s in runs]
        print(f"{name}: top-1 {statistics.fmean(top1):.2f} +/- {statistics.stdev(top1) if len(top1) > 1 else 0:.2f}% "
              f"over {len(top1)} seeds")
    report("bf16+channels_last", [s["train_images_per_sec"] for s in results["bf16+channels_last"]],
           "fp32", [s["train_images_per_sec"] for s in results["fp32"]])


if __name__ == "__main__":
    main()
