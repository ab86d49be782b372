"""P2: the data path. Ours (one tensor index per batch through a prepared DataLoader, then random crop +
flip + normalise on the whole uint8 batch on the training device) against the seed-style pipeline
(per-sample PIL images, RandomCrop(32, padding=4) + RandomHorizontalFlip + ToTensor + Normalize, default
collate), on the same decoded CIFAR-10 images. Goal: >= 50x.

Each pipeline runs in fresh processes, alternating, as each would in its own training job, and each process
warms up first. Ours is memory-bound and sensitive to how the allocator treats its 1.5 MB float batch: the first
1-3 passes of a fresh process ran at 260,000 img/s and the later ones at 740,000 (page faults until the heap
settles), and sharing one process with the seed's per-image PIL allocations made it swing between 380,000 and
720,000. The seed-style pipeline is Python-bound and steady.

    python bench/data_path.py --data-dir ../shared/data/cifar10
    python bench/data_path.py --data-dir ../shared/data/cifar10 --mixup 0.2 --cutmix 1.0   # ours also mixes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from PIL import Image
from torchvision import transforms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_data_args, alternate_sides, data_flags, header, report  # noqa: E402
from utils.data.decode import load_source  # noqa: E402
from utils.data.draws import Mixing  # noqa: E402
from utils.data.loaders import make_loader  # noqa: E402
from utils.data.transform import BatchTransform  # noqa: E402


class PilDataset(torch.utils.data.Dataset):
    """What torchvision.datasets.CIFAR10 does per item: a PIL image, then the transform."""

    def __init__(self, images, labels, transform):
        self.images, self.labels, self.transform = images.permute(0, 2, 3, 1).numpy(), labels.tolist(), transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.transform(Image.fromarray(self.images[i])), self.labels[i]


def measure(side: str, args) -> float:
    """Median images/s over `--passes` passes of one pipeline in this process, after one warm-up pass."""
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              dataloader_config=DataLoaderConfiguration(non_blocking=True))
    data = load_source(args.data_dir, cache_dir=args.cache_dir)
    (images, labels), mean, std = data["train"], data["mean"], data["std"]
    if side == "ours":
        n = args.images
        # each batch with its crops and flips (drawn by sample, as train_cifar.py's); channels-last, its default
        mixing = Mixing(args.mixup, args.cutmix) if args.mixup or args.cutmix else None  # and the soft targets
        loader = accelerator.prepare(make_loader(images[:n], labels[:n], args.batch_size, train=True, augment=True,
                                                 mixing=mixing))
        transform = BatchTransform(accelerator.device, channels_last=True, mean=mean, std=std)
        step = lambda batch: transform.train(*batch)[0]  # noqa: E731
    else:
        seed_tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                      transforms.ToTensor(), transforms.Normalize(mean, std)])
        n = args.seed_images
        loader = torch.utils.data.DataLoader(PilDataset(images[:n], labels[:n], seed_tf),
                                             batch_size=args.batch_size, shuffle=True, drop_last=True)
        step = lambda batch: batch[0].to(accelerator.device, non_blocking=True)  # noqa: E731

    def rate() -> float:
        n, start = 0, time.perf_counter()
        for batch in loader:
            n += len(step(batch))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return n / (time.perf_counter() - start)

    for _ in range(args.warmup):
        rate()
    return statistics.median(rate() for _ in range(args.passes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(parser)
    parser.add_argument("--images", type=int, default=50000, help="images per pass of our loader (50,000: an epoch)")
    parser.add_argument("--seed-images", type=int, default=4000, help="images per pass of the seed-style loader")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per pipeline, alternating")
    parser.add_argument("--passes", type=int, default=3, help="measured passes per process (median)")
    parser.add_argument("--warmup", type=int, default=5, help="passes per process before measuring")
    parser.add_argument("--mixup", type=float, default=0.0, help="ours: also mixup with this alpha (--mixup)")
    parser.add_argument("--cutmix", type=float, default=0.0, help="ours: also cutmix with this alpha (--cutmix)")
    parser.add_argument("--side", choices=["ours", "seed"],
                        help=argparse.SUPPRESS)  # one measurement, in a child process
    args = parser.parse_args()
    if args.side:
        print(json.dumps(measure(args.side, args)))
        return
    header("P2 data path: batched uint8 + on-device augmentation vs per-sample PIL")
    forward = [*data_flags(args), "--images", str(args.images), "--seed-images", str(args.seed_images),
               "--batch-size", str(args.batch_size), "--passes", str(args.passes), "--warmup", str(args.warmup),
               "--mixup", str(args.mixup), "--cutmix", str(args.cutmix)]
    rates = alternate_sides(__file__, ("ours", "seed"), forward, args.repeats)
    print(f"device: {torch.device('cuda' if torch.cuda.is_available() else 'cpu')}; batch {args.batch_size}; "
          f"augmentation: crop (pad 4) + flip + normalise (ours: mixup {args.mixup}, cutmix {args.cutmix}); "
          f"each number: one fresh process, median of {args.passes} "
          f"passes "
          f"after {args.warmup} warm-up passes")
    report("ours", rates["ours"], "seed-style", rates["seed"])


if __name__ == "__main__":
    main()
