"""P14: what --auto-augment costs. A training step of train_cifar.py's device path (index the cached images, the
batch's draws on the host, BatchTransform.train, forward, backward, step), with no policy and with each of ta_wide,
ra and augmix, the arms alternating in one process; each policy's time as a share of the step, and its draws' host
time. On a GPU the policies run with torch.cuda.set_sync_debug_mode("error"): a host sync inside them would stop the
bench. Then the loader workers' side: apply_policy on one core on 224 px crops (--augment resized-crop), images/s.

    python bench/policy_cost.py --data-dir ../shared/data/cifar10
    python bench/policy_cost.py --data-dir ../shared/data/cifar10 --model resnet18 --batch-size 512   # a GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_data_args, header  # noqa: E402
from utils.data.decode import load_source  # noqa: E402
from utils.data.draws import Draws, augment_draws  # noqa: E402
from utils.data.transform import (  # noqa: E402
    POLICIES,
    BatchTransform,  # noqa: E402
    Policy,
    apply_policy,
    policy_draws,
)
from utils.models import named_model  # noqa: E402

ARMS = ("none", *POLICIES)


def synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def step_times(arm: str, model, optimizer, transform, images, labels, args, dev) -> tuple[float, float]:
    """Seconds per training step with `arm`'s policy, and the seconds of its draws on the host, over args.steps
    steps (after 2 warm-up steps)."""
    policy = None if arm == "none" else Policy(arm)
    order, n, draw_seconds = np.random.default_rng(0).permutation(len(labels)), args.batch_size, 0.0
    for step in range(args.steps + 2):
        if step == 2:
            synchronize(dev)
            start, draw_seconds = time.perf_counter(), 0.0
        host = order[step * n:(step + 1) * n]
        began = time.perf_counter()
        draws = Draws(augment_draws(0, 0, host, 4), policy=policy_draws(0, 0, host, policy, 32) if policy else None)
        draw_seconds += time.perf_counter() - began
        draws = draws.to(dev, non_blocking=True)
        idx = torch.from_numpy(host).to(dev, non_blocking=True)
        batch = images.permute(0, 2, 3, 1).index_select(0, idx).permute(0, 3, 1, 2)
        if dev.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        x, y = transform.train(batch, labels.index_select(0, idx), draws)
        if dev.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(dev)
    return (time.perf_counter() - start) / args.steps, draw_seconds / args.steps


def worker_rate(policy: str, size: int, n: int = 32, repeats: int = 3) -> float:
    """Images/s of apply_policy on one core on n uint8 size x size crops (a loader worker's batch)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a DataLoader worker runs
    crops = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8)
    rates = []
    for r in range(repeats):
        draws = policy_draws(0, r, np.arange(n), Policy(policy), size)
        start = time.perf_counter()
        apply_policy(crops, draws)
        rates.append(n / (time.perf_counter() - start))
    torch.set_num_threads(threads)
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(parser)
    parser.add_argument("--model", default="resnet8")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker-size", type=int, default=224)
    args = parser.parse_args()
    header("P14 --auto-augment's cost per training step")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = load_source(args.data_dir, cache_dir=args.cache_dir)
    images, labels = (t[:args.batch_size * (args.steps + 2)].to(dev) for t in data["train"])
    torch.manual_seed(0)
    model = named_model(args.model).to(dev).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    transform = BatchTransform(dev, True, mean=data["mean"], std=data["std"], num_classes=10)
    seconds = {arm: [] for arm in ARMS}
    draw_seconds = {arm: [] for arm in ARMS}
    for _ in range(args.repeats):
        for arm in ARMS:
            step, draws = step_times(arm, model, optimizer, transform, images, labels, args, dev)
            seconds[arm].append(step)
            draw_seconds[arm].append(draws)
    base = statistics.median(seconds["none"])
    print(f"model {args.model}, batch {args.batch_size} at 32 px on {dev.type}, {args.steps} steps per arm x "
          f"{args.repeats} repeats (alternating), {torch.get_num_threads()} threads")
    print(f"none: {base * 1e3:.1f} ms per step (median)")
    for arm in POLICIES:
        t = statistics.median(seconds[arm])
        print(f"{arm}: {t * 1e3:.1f} ms per step, ratio to none {t / base:.2f}x, the policy "
              f"{100 * (t - base) / t:.0f}% of the step; its draws on the host "
              f"{statistics.median(draw_seconds[arm]) * 1e3:.2f} ms per batch")
    if dev.type == "cuda":
        print("no host sync inside the policies (torch.cuda.set_sync_debug_mode('error') raised nothing)")
    for arm in POLICIES:
        print(f"loader worker, {arm} on {args.worker_size} px crops, one core: "
              f"{worker_rate(arm, args.worker_size):,.0f} img/s")


if __name__ == "__main__":
    main()
