"""P15: what starting the loaders' workers from a forkserver costs (utils/data/images.py's WORKER_START: CPython
before 3.11.10, gh-112275) against forking them from the training process. Each arm is a fresh process (the
forkserver starts once per process, at its first loader) that runs a loader of 2 workers over 4,096 CIFAR-sized
images for --epochs epochs, each epoch starting its workers anew as the templates' loaders do; the arms alternate.
Printed per arm: the first epoch's seconds, a later epoch's median, and the ratios against fork.

    python bench/worker_start.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ARM = """
import json, sys, time
import torch
from utils.data import images as kinds, loaders
kinds.WORKER_START = loaders.WORKER_START = sys.argv[1] if sys.argv[1] != "fork" else None
pixels = torch.randint(0, 256, (4096, 3, 32, 32), dtype=torch.uint8)
images = kinds.TensorImages(pixels)
images.workers = 2  # read in 2 loader worker processes, as the encoded kinds are
loader = loaders.make_loader(images, torch.arange(4096), 256, train=True, timeout=120)
seconds = []
for epoch in range(int(sys.argv[2])):
    loader.sampler.set_epoch(epoch)
    start = time.perf_counter()
    assert sum(len(batch[1]) for batch in loader) == 4096
    seconds.append(time.perf_counter() - start)
print(json.dumps(seconds))
"""


def arm(start: str, epochs: int) -> list[float]:
    result = subprocess.run([sys.executable, "-c", ARM, start, str(epochs)], cwd=REPO, capture_output=True,
                            text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}; 2 loader workers, 4,096 images of 32 px, {args.epochs} epochs per process")
    runs = {"fork": [], "forkserver": []}
    for _ in range(args.repeats):
        for start in runs:
            runs[start].append(arm(start, args.epochs))
    first = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
    later = {k: statistics.median(s for r in v for s in r[1:]) for k, v in runs.items()}
    for start in runs:
        print(f"  {start}: first epoch {first[start]:.2f} s ({first[start] / first['fork']:.2f}x fork's), later "
              f"epochs {later[start] * 1e3:.0f} ms ({later[start] / later['fork']:.2f}x fork's), median of "
              f"{args.repeats}")


if __name__ == "__main__":
    main()
