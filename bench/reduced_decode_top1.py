"""Does decoding JPEGs at reduced scale change what a model learns? Top-1 of train_cifar.py with --augment
resized-crop on photo-sized JPEGs, with JPEGs decoded at the DCT scale each crop needs (the default) and at full size
(--full-decode), over several seeds; each run a fresh process (2 gloo ranks, 2 loader workers each), alternating.
Prints each run and the mean +/- std top-1 of each side.

The data: CIFAR-10's first --images training and --test-images test images upscaled (bicubic) to --photo-size px
(a 4:3 landscape, every fourth stored as a portrait phone photo: rotated, with EXIF orientation 6) and saved as JPEGs
(quality 90) in an image folder. At --image-size 32 the crops of 35-100% of a 640 x 480 photo (--crop-scale 0.35 1)
are decoded at 1/4 or 1/8 scale.

    python bench/reduced_decode_top1.py --data-dir ../shared/data/cifar10 --seeds 3   # about 25 minutes on 2 cores
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
sys.path.insert(0, str(REPO / "tests"))

from conftest import write_upscaled_cifar  # noqa: E402

from bench.common import header  # noqa: E402


def train(folder: Path, out: Path, seed: int, full: bool, args) -> float:
    cmd = ["accelerate", "launch", "--config_file", str(REPO / "accelerate_configs" / "cpu.yaml"),
           "--main_process_port", "0", str(REPO / "train_cifar.py"), "--data-dir", str(folder),
           "--output-dir", str(out), "--seed", str(seed), "--model", "resnet8", "--image-size", "32",
           "--augment", "resized-crop", "--crop-scale", "0.35", "1", "--epochs", str(args.epochs),
           "--batch-size", "64", "--data-workers", "2", "--tracker", "none", *(["--full-decode"] if full else [])]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(result.stderr[-3000:])
    return json.loads((out / "summary.json").read_text())["eval_top1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, help="the CIFAR-10 parquet copy")
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--test-images", type=int, default=1000)
    parser.add_argument("--photo-size", type=int, nargs=2, default=(640, 480))
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    header("top-1 with JPEGs decoded at reduced scale against full size")
    found = {"reduced": [], "full": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_upscaled_cifar(Path(tmp) / "photos", Path(args.data_dir), args.images, args.test_images,
                                      (tuple(args.photo_size),), photos=4)
        for seed in range(args.seeds):
            for side in found:
                top1 = train(folder, Path(tmp) / f"{side}-{seed}", seed, side == "full", args)
                found[side].append(top1)
                print(f"seed {seed} {side:>7}: top-1 {top1:.2f}%", flush=True)
    for side, values in found.items():
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"{side:>7}: {statistics.mean(values):.2f} +/- {spread:.2f}% top-1 (mean +/- std of {len(values)} seeds)")
    diff = [a - b for a, b in zip(found["reduced"], found["full"])]
    print(f"reduced - full, per seed: {', '.join(f'{d:+.2f}' for d in diff)} points; mean {statistics.mean(diff):+.2f}")


if __name__ == "__main__":
    main()
