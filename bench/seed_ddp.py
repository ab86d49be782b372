"""The seed cheat sheet's DDP script, kept faithful for P1, changed only where this machine forces it:
gloo on the CPU instead of NCCL on GPUs, and the CIFAR-10 images from the local parquet copy (decoded once
by utils.data.decode, then served per sample as PIL images, as torchvision.datasets.CIFAR10 does) instead of a
download. Prints one JSON line: images/s over the training loop, all ranks.

    torchrun --nproc_per_node 2 bench/seed_ddp.py --data-dir ../shared/data/cifar10 --images 5000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms
from torchvision.models import resnet18

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_data_args  # noqa: E402
from bench.data_path import PilDataset  # noqa: E402
from utils.data.decode import load_source  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    add_data_args(parser)
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--num-workers", type=int, default=4)  # the seed's value
    args = parser.parse_args()

    dist.init_process_group(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")

    model = resnet18(num_classes=10).to(device)
    model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()

    images, labels = load_source(args.data_dir, cache_dir=args.cache_dir)["train"]
    ds = PilDataset(images[: args.images], labels[: args.images], transforms.Compose([transforms.ToTensor()]))
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(ds, batch_size=128, sampler=sampler, num_workers=args.num_workers, pin_memory=True)

    seen, start = 0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            seen += len(y)
    seconds = time.perf_counter() - start
    total = torch.tensor([seen], dtype=torch.long)
    dist.all_reduce(total)
    if rank == 0:
        print(json.dumps({"images": int(total), "seconds": seconds, "images_per_sec": int(total) / seconds,
                          "world_size": world_size, "threads": torch.get_num_threads(), "pid": os.getpid()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
