"""A copy's own torch Dataset as load_data's split against the same images as arrays: the training loader's images per
second (the template's loader and on-device crop + flip + normalise), and the one-time pass `checked_data` makes
over a Dataset's items (contract, labels) and the channel statistics.

The Dataset is what torchvision.datasets.CIFAR10 gives without a transform: a PIL image and an int per item. Through
the template it is read by batch in the loader's worker processes (utils/data/sources.py; decoded as the built-in
folders are, utils/data/images.py); the arrays are indexed one tensor index per batch in the main process. Each
side runs in fresh processes, alternating, after warm-up passes.

    python bench/dataset_items.py --data-dir ../shared/data/cifar10 --images 10000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_data_args, alternate_sides, data_flags, header, report  # noqa: E402
from utils.data.contract import checked_data  # noqa: E402
from utils.data.decode import load_source  # noqa: E402
from utils.data.loaders import make_loader  # noqa: E402
from utils.data.transform import BatchTransform  # noqa: E402


class PilItems(torch.utils.data.Dataset):
    """(PIL image, int) items, as torchvision.datasets.CIFAR10 gives them without a transform."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images.permute(0, 2, 3, 1).numpy(), labels.tolist()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return Image.fromarray(np.ascontiguousarray(self.images[i])), self.labels[i]


def measure(side: str, args) -> dict:
    """{"rate": median images/s over --passes passes, "check": seconds of checked_data}, in this process."""
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    source = load_source(args.data_dir, cache_dir=args.cache_dir)
    images, labels = (t[:args.images] for t in source["train"])
    test = tuple(t[:100] for t in source["test"])
    start = time.perf_counter()
    if side == "dataset":
        data = checked_data({"train": PilItems(images, labels), "test": PilItems(*test), "classes": source["classes"]})
    else:
        data = checked_data({"train": (images, labels), "test": test, "classes": source["classes"]})
    check = time.perf_counter() - start
    loader = accelerator.prepare(make_loader(*data["train"], args.batch_size, train=True, augment=True))
    transform = BatchTransform.for_data(data, accelerator.device, channels_last=True)

    def rate() -> float:
        n, start = 0, time.perf_counter()
        for batch in loader:
            n += len(transform.train(*batch)[0])
        return n / (time.perf_counter() - start)

    for _ in range(args.warmup):
        rate()
    return {"rate": statistics.median(rate() for _ in range(args.passes)), "check": check,
            "workers": data["train"][0].workers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(parser)
    parser.add_argument("--images", type=int, default=10000, help="training images (a pass is one epoch of them)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per side, alternating")
    parser.add_argument("--passes", type=int, default=3, help="measured passes per process (median)")
    parser.add_argument("--warmup", type=int, default=1, help="passes per process before measuring")
    parser.add_argument("--side", choices=["dataset", "arrays"], help=argparse.SUPPRESS)  # one child's measurement
    args = parser.parse_args()
    if args.side:
        print(json.dumps(measure(args.side, args)))
        return
    header("a copy's torch Dataset (PIL items) against the same images as arrays, through the template's loader")
    forward = [*data_flags(args), "--images", str(args.images), "--batch-size", str(args.batch_size), "--passes",
               str(args.passes), "--warmup", str(args.warmup)]
    found = alternate_sides(__file__, ("dataset", "arrays"), forward, args.repeats)
    print(f"{args.images:,} training images, batch {args.batch_size}, crop + flip + normalise; the Dataset read by "
          f"{found['dataset'][0]['workers']} loader worker(s); each number: one fresh process, median of "
          f"{args.passes} passes after {args.warmup} warm-up pass(es)")
    report("dataset", [r["rate"] for r in found["dataset"]], "arrays", [r["rate"] for r in found["arrays"]])
    checks = [r["check"] for r in found["dataset"]]
    print(f"checked_data's pass over the Dataset's {args.images + 100:,} items: {statistics.median(checks):.2f} s "
          f"(median of {len(checks)}: {', '.join(f'{c:.2f}' for c in checks)})")


if __name__ == "__main__":
    main()
