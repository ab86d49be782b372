"""P3: the overhead of train_cifar.py's training loop (Accelerate's prepared loader, model and optimizer,
accumulate, the LR schedule, logging, the health checks) against a bare PyTorch loop over the same tensors,
model, optimizer, augmentation and batch, in one process, alternating runs. Goal: at most 2% slower.

    python bench/loop_overhead.py --data-dir ../shared/data/cifar10
    python bench/loop_overhead.py --data-dir ../shared/data/cifar10 --ema-decay 0.999   # ours also keeps an EMA
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_cifar  # noqa: E402
from bench.common import add_data_args, header, report  # noqa: E402
from utils.data.decode import load_source  # noqa: E402
from utils.data.draws import augment_draws  # noqa: E402
from utils.data.transform import BatchTransform  # noqa: E402
from utils.models import named_model  # noqa: E402
from utils.schedule import warmup_cosine  # noqa: E402


def bare_loop(cfg: train_cifar.Config, images: torch.Tensor, labels: torch.Tensor, mean, std) -> float:
    """Images/s of the plainest loop doing the same work: index, augment, forward, backward, clip, step."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    images, labels = images.to(dev), labels.to(dev)
    torch.manual_seed(cfg.seed)
    model = named_model(cfg.model).to(dev)
    if cfg.channels_last:  # as train_cifar.py does (its default)
        model = model.to(memory_format=torch.channels_last)
    optimizer = train_cifar.build_optimizer(cfg, model, cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(1, cfg.max_steps))
    transform = BatchTransform(dev, channels_last=cfg.channels_last, mean=mean, std=std)
    order = torch.randperm(len(labels))  # on the host, as the sampler's
    model.train()
    start = time.perf_counter()
    for step in range(cfg.max_steps):
        host_idx = order[step * cfg.batch_size:(step + 1) * cfg.batch_size]
        draws = tuple(d.to(dev, non_blocking=True) for d in augment_draws(cfg.seed, 0, host_idx.numpy(), 4))
        idx = host_idx.to(dev, non_blocking=True)
        # index_select on the NHWC view, as train_cifar.py's dataset does (images[idx] is ~300x slower for uint8)
        batch = images.permute(0, 2, 3, 1).index_select(0, idx).permute(0, 3, 1, 2)
        loss = F.cross_entropy(model(transform(batch, draws)), labels.index_select(0, idx))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    loss.item()
    return cfg.max_steps * cfg.batch_size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(parser)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--model", default="resnet18_imagenet")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--ema-decay", type=float, default=None, help="ours: also keep an EMA of the weights")
    args = parser.parse_args()
    header("P3 loop overhead: train_cifar.py's loop vs a bare PyTorch loop")
    out = tempfile.mkdtemp(prefix="loop_overhead_")
    n = args.steps * args.batch_size
    cfg = train_cifar.Config(data_dir=args.data_dir, cache_dir=args.cache_dir, output_dir=out, model=args.model,
                             batch_size=args.batch_size, train_subset=n, eval_subset=100, epochs=1,
                             max_steps=args.steps, ema_decay=args.ema_decay,
                             warmup_epochs=1 / args.steps, tracker="none", overwrite=True, log_every=10)
    assert math.ceil(n / args.batch_size) == args.steps
    data = load_source(cfg.data_dir, cache_dir=cfg.cache_dir)
    images, labels = data["train"]
    ours, bare = [], []
    for _ in range(args.repeats):
        ours.append(train_cifar.main(cfg)["train_images_per_sec"])
        bare.append(bare_loop(cfg, images[:n], labels[:n], data["mean"], data["std"]))
    print(f"model {args.model}, batch {args.batch_size}, {args.steps} optimizer steps per run, "
          f"{torch.get_num_threads()} threads, ours with --ema-decay {args.ema_decay}")
    ratio = report("train_cifar.py loop", ours, "bare loop", bare)
    print(f"overhead: {100 * (1 / ratio - 1):+.1f}% time per image")


if __name__ == "__main__":
    main()
