"""P2: the data path. Ours (one tensor index per batch through a prepared DataLoader, then random crop +
flip + normalise on the whole uint8 batch on the training device) against the seed-style pipeline
(per-sample PIL images, RandomCrop(32, padding=4) + RandomHorizontalFlip + ToTensor + Normalize, default
collate), on the same decoded CIFAR-10 images, in one process, alternating runs. Goal: >= 50x.

    python bench/data_path.py --data-dir ../shared/data/cifar10
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from PIL import Image
from torchvision import transforms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_data_args, header, report  # noqa: E402
from utils.data import MEAN, STD, BatchTransform, load_cifar10, make_loader  # noqa: E402


class PilDataset(torch.utils.data.Dataset):
    """What torchvision.datasets.CIFAR10 does per item: a PIL image, then the transform."""

    def __init__(self, images, labels, transform):
        self.images, self.labels, self.transform = images.permute(0, 2, 3, 1).numpy(), labels.tolist(), transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.transform(Image.fromarray(self.images[i])), self.labels[i]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(parser)
    parser.add_argument("--images", type=int, default=50000, help="images per pass of our loader (50,000: an epoch)")
    parser.add_argument("--seed-images", type=int, default=4000, help="images per pass of the seed-style loader")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    header("P2 data path: batched uint8 + on-device augmentation vs per-sample PIL")

    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=True))
    images, labels = load_cifar10(args.data_dir, args.cache_dir, accelerator)["train"]
    ours_loader = accelerator.prepare(make_loader(images[: args.images], labels[: args.images], args.batch_size, train=True))
    transform = BatchTransform(accelerator.device, 0, augment=True, channels_last=True)  # as train_cifar.py (its default)
    seed_tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                  transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    seed_loader = torch.utils.data.DataLoader(PilDataset(images[: args.seed_images], labels[: args.seed_images], seed_tf),
                                              batch_size=args.batch_size, shuffle=True, drop_last=True)

    def rate(loader, step) -> float:
        n, start = 0, time.perf_counter()
        for x, y in loader:
            n += len(step(x, y))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return n / (time.perf_counter() - start)

    ours, seed = [], []
    rate(ours_loader, lambda x, y: transform(x, train=True))  # warm-up, not counted
    rate(seed_loader, lambda x, y: x.to(accelerator.device, non_blocking=True))
    for _ in range(args.repeats):
        ours.append(rate(ours_loader, lambda x, y: transform(x, train=True)))
        seed.append(rate(seed_loader, lambda x, y: x.to(accelerator.device, non_blocking=True)))
    print(f"device: {accelerator.device}; batch {args.batch_size}; augmentation: crop (pad 4) + flip + normalise")
    report("ours", ours, "seed-style", seed)


if __name__ == "__main__":
    main()
