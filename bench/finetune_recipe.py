"""Does fine-tuning a pretrained model beat training it from scratch, and at which backbone lr? A transfer task built
from CIFAR-10 with no download: timm's test_resnet trained here (plain PyTorch) on the 8 classes that are not ship or
truck, saved by timm's save_for_hf, then fine-tuned by train_cifar.py with --recipe finetune on ship vs truck (2 gloo
ranks, --train-subset images, 2 epochs, plain crops), for each --backbone-lr-factor given, against the same
architecture from scratch (timm:test_resnet, same flags); over several seeds. Each of --layer-decays, --drop-paths,
--random-erases and --auto-augments adds fine-tuned runs at factor 1 with that flag at each value given;
--no-exemptions, one with
--no-decay-exemptions (every tensor decayed). Prints each run and the mean +/- std top-1 on the 2,000 ship and truck
test images.
tests/test_pretrained.py builds its task with the functions here.

    python bench/finetune_recipe.py --data-dir ../shared/data/cifar10 --seeds 3     # about 3 minutes on 2 cores
    python bench/finetune_recipe.py --data-dir ../shared/data/cifar10 --seeds 3 --factors 0 1   # a linear probe
    python bench/finetune_recipe.py --data-dir ../shared/data/cifar10 --seeds 3 --factors 1 --layer-decays 0.75 0.5 \
        --drop-paths 0.1 --random-erases 0.25 --no-exemptions
    python bench/finetune_recipe.py --data-dir ../shared/data/cifar10 --seeds 3 --factors 1 \
        --auto-augments ta_wide augmix
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import header  # noqa: E402

SHIP_TRUCK = [8, 9]  # CIFAR-10's labels of the fine-tuning classes; the timm model is trained on the other 8


def cifar_rows(cifar_dir: Path, split: str, labels: list[int], n: int | None = None):
    """The rows of CIFAR-10's parquet `split` with one of `labels`, in file order (the first n)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(Path(cifar_dir) / f"{split}-00000-of-00001.parquet")
    table = table.filter(pc.is_in(table["label"], value_set=pa.array(labels)))
    return table.slice(0, n) if n else table


def pretrain_timm(cifar_dir: Path, folder: Path) -> None:
    """timm's test_resnet trained (plain PyTorch, SGD, one-cycle, flips, 4 epochs of 8,000 images) on CIFAR-10's 8
    classes that are not ship or truck, saved by timm.models.save_for_hf with its preprocessing: 32 px, mean and
    std 0.5."""
    import timm
    from PIL import Image
    from timm.models import save_for_hf

    rows = cifar_rows(cifar_dir, "train", [k for k in range(10) if k not in SHIP_TRUCK], 8000)
    images = torch.from_numpy(np.stack([np.asarray(Image.open(io.BytesIO(cell["bytes"])).convert("RGB"))
                                        for cell in rows["img"].to_pylist()])).permute(0, 3, 1, 2)
    labels = torch.tensor(rows["label"].to_pylist())
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=4 * (len(images) // 128))
    for _ in range(4):
        order = torch.randperm(len(images))
        for i in range(len(images) // 128):
            batch = order[i * 128:(i + 1) * 128]
            x = (images[batch].float() / 255 - 0.5) / 0.5
            x = torch.where(torch.rand(len(batch), 1, 1, 1) < 0.5, x.flip(-1), x)
            loss = torch.nn.functional.cross_entropy(model(x), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
    save_for_hf(model.eval(), str(folder), safe_serialization=True, data_config={
        "input_size": (3, 32, 32), "crop_pct": 1.0, "interpolation": "bicubic", "mean": (0.5,) * 3, "std": (0.5,) * 3})


def write_ship_truck(cifar_dir: Path, folder: Path) -> Path:
    """CIFAR-10's ship and truck images (10,000 train, 2,000 test) as a 2-class parquet folder (0 ship, 1 truck)."""
    import datasets

    folder.mkdir(parents=True)
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=["ship", "truck"])})
    for split in ("train", "test"):
        table = cifar_rows(cifar_dir, split, SHIP_TRUCK)
        labels = [label - SHIP_TRUCK[0] for label in table["label"].to_pylist()]
        datasets.Dataset.from_dict({"img": table["img"].to_pylist(), "label": labels}, features=features).to_parquet(
            str(folder / f"{split}-00000-of-00001.parquet"))
    return folder


def run(model: str, factor: float, extra: tuple[str, ...], seed: int, args, root: Path) -> float:
    out = root / f"run-{len(list(root.glob('run-*')))}"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / "cpu.yaml"), "--main_process_port", "0", str(REPO / "train_cifar.py"),
           "--model", model, "--recipe", "finetune", "--augment", "standard", "--backbone-lr-factor", str(factor),
           "--train-subset", str(args.train_subset), "--batch-size", "16", "--global-batch-size", "32", "--epochs",
           "2", "--seed", str(seed), "--deterministic", "--no-channels-last", "--tracker", "none",
           "--data-dir", str(root / "two"), "--cache-dir", str(root / "cache"), "--output-dir", str(out), *extra]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(result.stderr[-3000:])
    top1 = json.loads((out / "summary.json").read_text())["eval_top1"]
    print(f"{model.rsplit('/', 1)[-1]:>17} factor {factor:<4g} {' '.join(extra)} seed {seed}: top-1 {top1:.2f}%",
          flush=True)
    return top1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, help="the CIFAR-10 parquet copy")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--train-subset", type=int, default=512)
    parser.add_argument("--factors", type=float, nargs="+", default=[0.1, 0.3, 1.0])
    parser.add_argument("--layer-decays", type=float, nargs="*", default=[])
    parser.add_argument("--drop-paths", type=float, nargs="*", default=[])
    parser.add_argument("--random-erases", type=float, nargs="*", default=[])
    parser.add_argument("--auto-augments", nargs="*", default=[], choices=["ta_wide", "ra", "augmix"])
    parser.add_argument("--no-exemptions", action="store_true", help="add a run with --no-decay-exemptions")
    args = parser.parse_args()
    header("fine-tuning a timm model (8 CIFAR-10 classes) on ship vs truck, against the same net from scratch")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pretrain_timm(Path(args.data_dir), root / "timm8")
        write_ship_truck(Path(args.data_dir), root / "two")
        timm8 = str(root / "timm8")
        arms = [(flag, str(v)) for flag, values in (("--layer-decay", args.layer_decays), ("--drop-path",
                args.drop_paths), ("--random-erase", args.random_erases), ("--auto-augment", args.auto_augments))
                for v in values]
        settings = ([(timm8, f, ()) for f in args.factors] + [(timm8, 1.0, arm) for arm in arms]
                    + [(timm8, 1.0, ("--no-decay-exemptions",))] * args.no_exemptions + [("timm:test_resnet", 1.0, ())])
        results = {s: [run(*s, seed, args, root) for seed in range(args.seeds)] for s in settings}
    for (model, factor, extra), top1 in results.items():
        name = "from scratch" if model.startswith("timm:") else f"fine-tuned, --backbone-lr-factor {factor:g}"
        name += "".join(f" {flag}" for flag in extra)
        spread = statistics.stdev(top1) if len(top1) > 1 else 0.0
        print(f"{name}: top-1 {statistics.fmean(top1):.2f} +/- {spread:.2f}% over {len(top1)} seeds")


if __name__ == "__main__":
    main()
