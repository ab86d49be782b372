"""On one GPU, in one invocation: the template's speed against the CIFAR-10 speed records. Parts (--parts):

  resnet18  ResNet-18 training images/s (bf16 from 1gpu.yaml, channels_last, compile, data on the GPU, batch 512):
            the last of 2 epochs (the first pays for compilation), and its MFU: images/s x the training FLOPs of
            one image (forward + backward, counted by torch's FlopCounterMode) over the GPU's dense bf16 peak (its
            datasheet figure, and the rate of a large bf16 matmul measured here);
  fast      `--recipe fast`'s training seconds to 94% test top-1: the sum of the epochs' training seconds up to the
            first evaluation at or above --target (read from the run's TensorBoard files), after a short run that
            fills the compile cache;
  airbench  the PyPI package airbench's airbench94 on the same GPU: train94() wall time (training only, like ours)
            after its own warm-up, its TTA accuracy, and the ratio of the two times;
  vit_s     train_vit.py's ViT-S/4 images/s (bf16, data on the GPU, eager) and its MFU.

Needs CUDA; W&B is not used (the GPU machine may lack it). Numbers go to stdout and, part by part as they come, to
--results (JSON). bench/gpu_check.sh runs this beside the CUDA tests. airbench reads CIFAR-10 from
./cifar10/{train,test}.pt; the GPU machine may be offline, so those files are written from our local copy.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import add_data_args, data_flags, header  # noqa: E402

PARTS = ("resnet18", "fast", "airbench", "vit_s")
# Dense bf16 tensor-core peaks from the vendors' datasheets, TFLOP/s (no sparsity), by a name in the device's name.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "L4": 121.0, "A10": 125.0}
EPOCH_LINE = re.compile(r"^epoch (\d+)/\d+ +train_loss \S+ +eval_top1 ([\d.]+)% +([\d,]+) img/s +([\d.]+) s$", re.M)


class PartFailed(Exception):
    """A part could not finish: its one-line reason goes to the results, and the next part runs."""


# ----------------------------------------------------------------------------------------------------
# Reading a finished run without W&B: its console lines and its TensorBoard files
# ----------------------------------------------------------------------------------------------------
def epoch_lines(stdout: str) -> list[dict]:
    """The console line each epoch prints (utils/tracking.Tracker.log_epoch), as numbers."""
    return [{"epoch": int(m[1]), "top1": float(m[2]), "images_per_sec": float(m[3].replace(",", "")),
             "seconds": float(m[4])} for m in EPOCH_LINE.finditer(stdout)]


def epochs_from_tensorboard(output_dir: str | Path) -> list[dict]:
    """Per epoch of a `--tracker tensorboard` run: epoch, step, training seconds and eval top-1 (float32 scalars,
    finer than the console's 0.1 s), from the event files under <output-dir>/<project>/."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(Path(output_dir).rglob("events.out.tfevents.*"))
    if not files:
        raise PartFailed(f"no TensorBoard event file under {output_dir}")
    scalars: dict[str, dict[int, float]] = {}
    for file in files:  # one per life of the run (a resumed job writes a new one)
        acc = EventAccumulator(str(file), size_guidance={"scalars": 0})  # 0: keep every value
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    need = ("epoch", "train/epoch_seconds", "eval/top1")
    missing = [tag for tag in need if tag not in scalars]
    if missing:
        raise PartFailed(f"the TensorBoard files under {output_dir} lack {', '.join(missing)}")
    steps = sorted(scalars["train/epoch_seconds"])
    return [{"epoch": int(scalars["epoch"][s]), "step": s, "seconds": scalars["train/epoch_seconds"][s],
             "top1": scalars["eval/top1"][s]} for s in steps]


def time_to_target(epochs: list[dict], target: float) -> float | None:
    """Training seconds summed over the epochs up to the first whose evaluation reaches target; None if none does."""
    seconds = 0.0
    for row in epochs:
        seconds += row["seconds"]
        if row["top1"] >= target:
            return seconds
    return None


def without_compile(epochs: list[dict]) -> list[dict]:
    """The epochs with the first one's seconds (which hold the compilation, or loading it from the cache) replaced by
    the median of the others: the steady-state time a longer-lived process would see."""
    if len(epochs) < 2:
        return epochs
    return [{**epochs[0], "seconds": statistics.median(row["seconds"] for row in epochs[1:])}, *epochs[1:]]


# ----------------------------------------------------------------------------------------------------
# FLOPs and the GPU's peak
# ----------------------------------------------------------------------------------------------------
def train_flops_per_image(model_name: str, batch: int = 4) -> float:
    """FLOPs of one training step (forward + backward) per 32 x 32 image, counted on the CPU by torch's
    FlopCounterMode (matmuls, convolutions, attention; elementwise ops are not counted, as MFU conventionally
    leaves them out). The optimizer's update is not counted either."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from utils.models import named_model

    model = named_model(model_name)
    images, labels = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(images), labels).backward()
    return counter.get_total_flops() / batch


def measured_matmul_tflops(size: int = 8192, repeats: int = 10) -> float:
    """bf16 TFLOP/s of a size^3 matmul on this GPU: what its tensor cores really deliver here."""
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def datasheet_tflops(device_name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((peak for name, peak in PEAK_BF16_TFLOPS.items() if name in device_name), None)


def mfu(images_per_sec: float, flops_per_image: float, peaks: dict[str, float | None]) -> dict:
    achieved = images_per_sec * flops_per_image / 1e12
    return {"achieved_tflops": achieved, "flops_per_image": flops_per_image,
            **{f"mfu_{name}": achieved / peak for name, peak in peaks.items() if peak}}


# ----------------------------------------------------------------------------------------------------
# The parts
# ----------------------------------------------------------------------------------------------------
def launch(script: str, args: list[str], out: Path) -> str:
    """`accelerate launch --config_file accelerate_configs/1gpu.yaml <script> ...`; returns its stdout."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / "1gpu.yaml"), str(REPO / script), "--output-dir", str(out),
           "--overwrite", *args]
    print("$", " ".join(cmd[3:]), flush=True)
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stderr[-3000:], file=sys.stderr)
        raise PartFailed(f"{script} exited {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
    return result.stdout


def last_epoch_speed(stdout: str, what: str) -> float:
    epochs = epoch_lines(stdout)
    if not epochs:
        raise PartFailed(f"{what}: no epoch line in the output")
    return epochs[-1]["images_per_sec"]


def resnet18(data: list[str], work: Path, peaks: dict) -> dict:
    stdout = launch("train_cifar.py", [*data, "--model", "resnet18", "--channels-last", "--compile",
                                       "--data-on-device", "--batch-size", "512", "--epochs", "2", "--eval-subset",
                                       "512", "--tracker", "none"], work / "resnet18")
    speed = last_epoch_speed(stdout, "resnet18")
    result = {"images_per_sec": speed, **mfu(speed, train_flops_per_image("resnet18"), peaks)}
    print(f"resnet18 bf16 + channels_last + compile, batch 512: {speed:,.0f} img/s, "
          f"{result['achieved_tflops']:.0f} TFLOP/s ({describe_mfu(result)})")
    return result


def fast(data: list[str], work: Path, target: float) -> dict:
    launch("train_cifar.py", [*data, "--recipe", "fast", "--max-steps", "20", "--tracker", "none"], work / "warmup")
    launch("train_cifar.py", [*data, "--recipe", "fast", "--tracker", "tensorboard"], work / "fast")
    epochs = epochs_from_tensorboard(work / "fast")
    for row in epochs:
        print(f"  epoch {row['epoch']:>3}: {row['seconds']:6.2f} s training, eval top-1 {row['top1']:.2f}%")
    summary = json.loads((work / "fast" / "summary.json").read_text())
    reached, steady = time_to_target(epochs, target), time_to_target(without_compile(epochs), target)
    print(f"--recipe fast: final top-1 {summary['eval_top1']:.2f}%, " +
          (f"reached {target}% after {reached:.2f} s of training ({steady:.2f} s with epoch 1 at the median epoch's "
           f"time, without the compile cache's loading)" if reached else f"did not reach {target}%"))
    return {"final_top1": summary["eval_top1"], "seconds_to_target": reached, "seconds_to_target_steady": steady,
            "target": target, "training_seconds": sum(r["seconds"] for r in epochs), "epochs": len(epochs),
            "first_epoch_seconds": epochs[0]["seconds"]}


AIRBENCH = """
import json, time, torch, airbench
from airbench.lib_airbench94 import hyp
airbench.warmup94()  # one epoch: compiles nothing, but fills cuDNN's autotuner and the allocator
loader = airbench.CifarLoader("cifar10", train=True, batch_size=hyp["opt"]["batch_size"], aug=hyp["aug"], altflip=True)
torch.cuda.synchronize(); start = time.perf_counter()  # the data is on the GPU already, as ours is
model = airbench.train94(loader, verbose=False)  # training only (its whitening init included), no evaluation
torch.cuda.synchronize(); seconds = time.perf_counter() - start
accuracy = airbench.evaluate(model, airbench.CifarLoader("cifar10", train=False, batch_size=2000), tta_level=2)
print(json.dumps({"seconds": seconds, "top1": 100 * accuracy}))
"""


def airbench(data_dir: str | None, cache_dir: str | None, work: Path) -> dict:
    import importlib.util

    import torch

    if importlib.util.find_spec("airbench") is None:
        raise PartFailed("airbench is not installed (offline: carry its wheel, see docs/gpu-check.md)")
    from utils.data.decode import load_source

    folder = work / "airbench" / "cifar10"
    folder.mkdir(parents=True, exist_ok=True)
    data = load_source(data_dir, cache_dir=cache_dir)
    for split, name in (("train", "train.pt"), ("test", "test.pt")):  # airbench's cache format: NHWC uint8
        images, labels = data[split]
        torch.save({"images": images.permute(0, 2, 3, 1).contiguous(), "labels": labels,
                    "classes": list(data["classes"])}, folder / name)
    result = subprocess.run([sys.executable, "-c", AIRBENCH], cwd=folder.parent, capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stderr[-3000:], file=sys.stderr)
        raise PartFailed(f"airbench exited {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"airbench94: {measured['top1']:.2f}% (TTA) after {measured['seconds']:.2f} s of training")
    return measured


def vit_s(data: list[str], work: Path, peaks: dict) -> dict:
    stdout = launch("train_vit.py", [*data, "--model", "vit_s", "--data-on-device", "--batch-size", "512",
                                     "--epochs", "2", "--train-subset", "25600", "--eval-subset", "512",
                                     "--tracker", "none"], work / "vit_s")
    speed = last_epoch_speed(stdout, "vit_s")
    result = {"images_per_sec": speed, **mfu(speed, train_flops_per_image("vit_s"), peaks)}
    print(f"vit_s bf16, eager, batch 512: {speed:,.0f} img/s, {result['achieved_tflops']:.0f} TFLOP/s "
          f"({describe_mfu(result)})")
    return result


def describe_mfu(result: dict) -> str:
    named = {"mfu_datasheet": "of the datasheet bf16 peak", "mfu_matmul": "of the measured matmul rate"}
    return ", ".join(f"MFU {result[k]:.1%} {words}" for k, words in named.items() if k in result) or "no peak known"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(parser)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--work", default="/tmp/gpu_race", help="scratch folder for runs and airbench's data")
    parser.add_argument("--target", type=float, default=94.0, help="test top-1 (%%) for the time-to-accuracy race")
    parser.add_argument("--results", help="JSON file for the numbers, rewritten after each part")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, if not in PEAK_BF16_TFLOPS")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/gpu_race.py needs a CUDA GPU.")
    header("GPU race: " + ", ".join(args.parts))
    work, data, results = Path(args.work), data_flags(args), {}
    name = torch.cuda.get_device_name(0)
    peaks = {"datasheet": datasheet_tflops(name, args.peak_tflops), "matmul": measured_matmul_tflops()}
    results["gpu"] = {"name": name, "datasheet_bf16_tflops": peaks["datasheet"], "matmul_bf16_tflops": peaks["matmul"]}
    print(f"{name}: bf16 matmul 8192^3 at {peaks['matmul']:.0f} TFLOP/s; datasheet peak {peaks['datasheet']} TFLOP/s")
    run = {"resnet18": lambda: resnet18(data, work, peaks), "fast": lambda: fast(data, work, args.target),
           "airbench": lambda: airbench(args.data_dir, args.cache_dir, work), "vit_s": lambda: vit_s(data, work, peaks)}
    for part in args.parts:
        started = time.time()
        try:
            results[part] = run[part]()
        except Exception as e:  # any failure of one part (a CUDA error too): record it, run the next part
            if not isinstance(e, PartFailed):
                traceback.print_exc()
            results[part] = {"error": str(e) if isinstance(e, PartFailed) else f"{type(e).__name__}: {e}"}
            print(f"{part}: FAILED: {results[part]['error']}", flush=True)
        results[part]["wall_seconds"] = round(time.time() - started, 1)
        if args.results:
            Path(args.results).write_text(json.dumps(results, indent=2))
    ours, theirs = results.get("fast", {}).get("seconds_to_target"), results.get("airbench", {}).get("seconds")
    if ours and theirs:
        results["ratio_airbench_over_fast"] = theirs / ours
        print(f"ratio airbench94 time / --recipe fast time to {args.target}%: {theirs / ours:.2f}x "
              f"(above 1: we are faster)")
        if args.results:
            Path(args.results).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
