"""Do the fast defaults cost accuracy on the CPU? The quick-start job (cpu.yaml: 2 processes x 128, resnet18_imagenet,
10,000 training images x 5 epochs, full test set) as shipped (bf16 autocast, channels_last, gradients all-reduced in
bf16) against a slower setting - fp32 NCHW by default, or bf16 with an fp32 all-reduce - over several seeds,
alternating; prints each run, the mean +/- std top-1 of both, the paired difference and the throughput ratio.

    python bench/precision_accuracy.py --data-dir ../shared/data/cifar10 --seeds 3      # about 8 minutes on 2 cores
    python bench/precision_accuracy.py --data-dir ../shared/data/cifar10 --against fp32-sync
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

# name -> (launcher flags, script flags)
SETTINGS = {"shipped": (["--mixed_precision", "bf16"], []),
            "fp32": (["--mixed_precision", "no"], ["--no-channels-last"]),
            "fp32-sync": (["--mixed_precision", "bf16"], ["--no-bf16-grad-sync"])}


def run(setting: str, seed: int, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / "cpu.yaml"),
           "--main_process_port", "0", *SETTINGS[setting][0], str(REPO / "train_cifar.py"), "--model",
           "resnet18_imagenet",
           "--train-subset", str(args.train_subset), "--epochs", str(args.epochs), "--seed", str(seed), "--tracker",
           "none",
           "--output-dir", str(out), *SETTINGS[setting][1], *data_flags(args)]
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
    parser.add_argument("--against", choices=["fp32", "fp32-sync"], default="fp32",
                        help="fp32: fp32 NCHW, no autocast; fp32-sync: as shipped but gradients all-reduced in fp32")
    args = parser.parse_args()
    header(f"as shipped vs {args.against}: accuracy and speed of the quick-start job")
    names = ["shipped", args.against]
    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for name in names:
                results[name].append(run(name, seed, args, Path(tmp) / f"{name}-{seed}"))
    for name, runs in results.items():
        top1 = [s["eval_top1"] for s in runs]
        print(f"{name}: top-1 {statistics.fmean(top1):.2f} +/- {statistics.stdev(top1) if len(top1) > 1 else 0:.2f}% "
              f"over {len(top1)} seeds")
    diffs = [a["eval_top1"] - b["eval_top1"] for a, b in zip(results["shipped"], results[args.against])]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    print(f"paired difference shipped - {args.against}: {statistics.fmean(diffs):+.2f} +/- {se:.2f} points "
          f"(standard error)")
    report("shipped", [s["train_images_per_sec"] for s in results["shipped"]],
           args.against, [s["train_images_per_sec"] for s in results[args.against]])


if __name__ == "__main__":
    main()
