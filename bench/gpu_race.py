"""On one GPU, in one invocation: (1) ResNet-18 training images/s in bf16 with channels_last and torch.compile,
(2) the training time `--recipe fast` needs to reach 94% test top-1, (3) the PyPI `airbench` package's airbench94
on the same GPU and the ratio of the two times. Run through bench/gpu.sh; needs CUDA.

Times: (1) the last of 3 epochs (the first pays for compilation); (2) the sum of the epochs' training seconds up
to the first evaluation at or above the target, after a short warm-up run that fills the compile cache;
(3) airbench's train94() wall time after its own warm-up (airbench94's published 3.83 s on an A100 is measured
the same way). airbench reads CIFAR-10 from ./cifar10/{train,test}.pt; the GPU machine may be offline, so those
files are written here from our local parquet copy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import add_data_args, data_flags, header  # noqa: E402


def launch(args: list[str], out: Path, env: dict | None = None) -> str:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / "1gpu.yaml"),
           str(REPO / "train_cifar.py"), "--output-dir", str(out), "--overwrite", *args]
    print("$", " ".join(cmd[3:]), flush=True)
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if result.returncode != 0:
        sys.exit(f"failed:\n{result.stderr[-3000:]}")
    return result.stdout


def resnet18_throughput(data: list[str], work: Path) -> float:
    stdout = launch([*data, "--model", "resnet18", "--channels-last", "--compile", "--data-on-device", "--batch-size",
                     "512",
                     "--epochs", "3", "--tracker", "none"], work / "resnet18")
    rates = [float(m.group(1).replace(",", "")) for m in re.finditer(r"epoch \d+/\d+ .* ([\d,]+) img/s", stdout)]
    epochs = ", ".join(f"{r:,.0f}" for r in rates)
    print(f"resnet18 bf16 + channels_last + compile, batch 512: {rates[-1]:,.0f} img/s (epochs: {epochs})")
    return rates[-1]


def fast_recipe_time(data: list[str], work: Path, target: float) -> float | None:
    import compare_runs

    launch([*data, "--recipe", "fast", "--max-steps", "20", "--tracker", "none"], work / "warmup")  # compile cache
    launch([*data, "--recipe", "fast", "--tracker", "wandb"], work / "fast",
           env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    [run] = compare_runs.load(str(work / "fast"))
    seconds, reached = 0.0, None
    for row in (r for r in run.history if "eval/top1" in r):
        seconds += row["train/epoch_seconds"]
        print(f"  epoch {row['epoch']:>3}: {seconds:7.2f} s training, eval top-1 {row['eval/top1']:.2f}%")
        if reached is None and row["eval/top1"] >= target:
            reached = seconds
    summary = json.loads((work / "fast" / "summary.json").read_text())
    print(f"--recipe fast: final top-1 {summary['eval_top1']:.2f}%, " +
          (f"reached {target}% after {reached:.2f} s of training" if reached else f"did not reach {target}%"))
    return reached


AIRBENCH = """
import json, time, torch, airbench
airbench.warmup94()
torch.cuda.synchronize(); start = time.perf_counter()
accuracy = airbench.train94()
torch.cuda.synchronize()
print(json.dumps({"seconds": time.perf_counter() - start, "accuracy": float(accuracy)}))
"""


def airbench_time(data_dir: str | None, cache_dir: str | None, work: Path) -> float | None:
    import torch

    try:
        import airbench  # noqa: F401
    except ImportError:
        if subprocess.run([sys.executable, "-m", "pip", "install", "-q", "airbench"]).returncode != 0:
            print("airbench: not installed and not installable here (offline?): carry a wheel (see bench/gpu.sh)")
            return None
    from utils.data import CLASSES, load_cifar10

    folder = work / "airbench" / "cifar10"
    folder.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", "train.pt"), ("test", "test.pt")):  # airbench's cache format: NHWC uint8
        images, labels = load_cifar10(data_dir, cache_dir)[split]
        torch.save({"images": images.permute(0, 2, 3, 1).contiguous(), "labels": labels, "classes": list(CLASSES)},
                   folder / name)
    result = subprocess.run([sys.executable, "-c", AIRBENCH], cwd=folder.parent, capture_output=True, text=True)
    if result.returncode != 0:
        print(f"airbench failed:\n{result.stderr[-2000:]}")
        return None
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    accuracy = measured["accuracy"] * (100 if measured["accuracy"] <= 1 else 1)
    print(f"airbench94: {accuracy:.2f}% in {measured['seconds']:.2f} s")
    return measured["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(parser)
    parser.add_argument("--work", default="/tmp/gpu_race", help="scratch folder for runs and airbench's data")
    parser.add_argument("--target", type=float, default=94.0, help="test top-1 (%%) for the time-to-accuracy race")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/gpu_race.py needs a CUDA GPU.")
    header("GPU race: ResNet-18 throughput, --recipe fast to 94%, airbench94")
    work = Path(args.work)
    data = data_flags(args)
    resnet18_throughput(data, work)
    ours = fast_recipe_time(data, work, args.target)
    theirs = airbench_time(args.data_dir, args.cache_dir, work)
    if ours and theirs:
        print(f"ratio airbench94 time / --recipe fast time to {args.target}%: {theirs / ours:.2f}x "
              f"(above 1: we are faster)")


if __name__ == "__main__":
    main()
