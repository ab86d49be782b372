"""Images per second of predict.py against a plain torchvision loop over the same JPEGs, model and weights: files
opened with PIL in a torch Dataset, torchvision.transforms.v2 (Resize of the shorter side, CenterCrop, to float,
Normalize) as the run's preprocessor_config.json says, a DataLoader with the same batch size and workers, the model in
eval mode under no_grad, softmax and top-1, and a CSV row per image. Each side is a fresh process, timed whole (start
to exit, the way a user meets it), the sides alternating.

    python bench/predict_rate.py --data-dir ../shared/data/cifar10 --images 1024 --repeats 3

--data-dir: the CIFAR-10 parquet copy; its first --images test images are upscaled (bicubic) to 256-320 px JPEGs
(quality 90) in a temporary image folder, as tests/conftest.py's write_upscaled_cifar does at test sizes. The run:
`resnet18_imagenet` at --size px with the resized-crop recipe, trained 1 step on them (its weights do not change
the rate).
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

REPO = Path(__file__).resolve().parents[1]


def plain_loop(run: Path, images: Path, output: Path, batch: int, workers: int) -> None:
    """The loop a user writes from the docs: the reference side."""
    import torch
    from PIL import Image
    from safetensors.torch import load_file
    from torchvision.transforms import v2

    from utils.models import named_model

    pre = json.loads((run / "preprocessor_config.json").read_text())
    resample = {2: v2.InterpolationMode.BILINEAR, 3: v2.InterpolationMode.BICUBIC}[pre["resample"]]
    transform = v2.Compose([v2.Resize(pre["size"]["shortest_edge"], interpolation=resample, antialias=True),
                            v2.CenterCrop(pre["crop_size"]["height"]), v2.PILToTensor(),
                            v2.ToDtype(torch.float32, scale=True), v2.Normalize(pre["image_mean"], pre["image_std"])])
    files = sorted(p for p in images.rglob("*.jpg"))

    class Files(torch.utils.data.Dataset):
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            with Image.open(files[i]) as im:
                return transform(im.convert("RGB"))

    model = named_model("resnet18_imagenet", len(pre["classes"]))
    model.load_state_dict(load_file(run / "model.safetensors"))
    model.eval()
    rows = []
    with torch.no_grad():
        for x in torch.utils.data.DataLoader(Files(), batch_size=batch, num_workers=workers):
            best = model(x).softmax(dim=1).max(dim=1)
            rows += zip(best.indices.tolist(), best.values.tolist())
    with open(output, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "prediction", "probability"])
        for path, (c, p) in zip(files, rows):
            writer.writerow([path.relative_to(images).as_posix(), pre["classes"][c], f"{p:.6f}"])


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(result.stderr[-3000:])
    return time.perf_counter() - start


def main() -> None:
    from bench.common import header, image_bench_parser, report

    parser = image_bench_parser(__doc__)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--side", choices=["plain"], help=argparse_suppress())
    parser.add_argument("--run")
    parser.add_argument("--folder")
    parser.add_argument("--output")
    args = parser.parse_args()
    if args.side == "plain":
        plain_loop(Path(args.run), Path(args.folder), Path(args.output), args.batch_size, args.workers)
        return
    header("predict.py against a plain torchvision prediction loop")
    from conftest import write_upscaled_cifar

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = write_upscaled_cifar(tmp / "data", Path(args.data_dir), n_train=64, n_test=args.images,
                                    sizes=(256, 288, 320))
        run = tmp / "run"
        trained = subprocess.run([sys.executable, "train_cifar.py", "--data-dir", str(data), "--output-dir", str(run),
                                  "--model", "resnet18_imagenet", "--image-size", str(args.size), "--augment",
                                  "resized-crop", "--decode", "workers", "--max-steps", "1", "--batch-size", "32",
                                  "--eval-subset", "32", "--tracker", "none"], cwd=REPO, capture_output=True, text=True)
        if trained.returncode != 0:
            sys.exit(trained.stderr[-3000:])
        sizes = ["--batch-size", str(args.batch_size), "--workers", str(args.workers)]
        ours, plain = [], []
        for _ in range(args.repeats):
            ours.append(args.images / timed(["predict.py", str(run), str(data / "test"), "--output",
                                             str(tmp / "ours.csv"), *sizes]))
            plain.append(args.images / timed([__file__, "--data-dir", args.data_dir, "--side", "plain", "--run",
                                              str(run), "--folder", str(data / "test"), "--output",
                                              str(tmp / "plain.csv"), *sizes]))
        same = [r["prediction"] for r in csv.DictReader(open(tmp / "ours.csv"))] == \
            [r["prediction"] for r in csv.DictReader(open(tmp / "plain.csv"))]
        print(f"{args.images} JPEGs of 256-320 px at {args.size} px, batch {args.batch_size}, {args.workers} loader "
              f"workers; the two files' predictions {'agree' if same else 'DIFFER'}")
        report("predict.py", ours, "plain loop", plain)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
