"""What every benchmark prints: the machine, the versions, the command, and a ratio of two medians."""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys

import torch


def add_data_args(parser) -> None:
    """The data flags every benchmark shares with train_cifar.py."""
    parser.add_argument("--data-dir", default=None, help="parquet folder (unset: the Hub)")
    parser.add_argument("--cache-dir", default=None, help="decoded-tensor cache")


def image_bench_parser(doc: str):
    """The flags of the benches that decode upscaled CIFAR-10 JPEGs: --data-dir (the parquet copy), --images, --size
    (the crop's side) and --repeats; the parser, for a bench to add its own."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3)
    return parser


def data_flags(args) -> list[str]:
    """The data flags parsed by add_data_args, back as command-line arguments for train_cifar.py."""
    return [f"--{name}={value}" for name,
            value in (("data-dir", args.data_dir), ("cache-dir", args.cache_dir)) if value]


def header(title: str) -> None:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import accelerate
    import torchvision

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(f"# {title}")
    print(f"machine: {os.cpu_count()} cores, {cpu}; GPU: {gpu}")
    print(f"versions: python {platform.python_version()}, torch {torch.__version__}, "
          f"torchvision {torchvision.__version__}, "
          f"accelerate {accelerate.__version__}")
    print(f"command: {shlex.join([sys.executable.rsplit('/', 1)[-1], *sys.argv])}")


def report(name_a: str, rates_a: list[float], name_b: str, rates_b: list[float], unit: str = "img/s") -> float:
    """Prints both medians and the ratio a/b; returns the ratio."""
    a, b = statistics.median(rates_a), statistics.median(rates_b)
    print(f"{name_a}: {a:,.0f} {unit} (median of {len(rates_a)}: {', '.join(f'{r:,.0f}' for r in rates_a)})")
    print(f"{name_b}: {b:,.0f} {unit} (median of {len(rates_b)}: {', '.join(f'{r:,.0f}' for r in rates_b)})")
    print(f"ratio {name_a} / {name_b}: {a / b:.2f}x")
    return a / b


def alternate_sides(script: str, sides: tuple[str, ...], flags: list[str], repeats: int) -> dict[str, list]:
    """Each side's measurement from `repeats` fresh processes of `python script --side SIDE FLAGS`, the sides
    alternating (machines drift: each side meets the same conditions); a child prints its result as JSON on its last
    line. A child that fails ends the bench with its stderr."""
    import json
    import subprocess
    import sys

    found: dict[str, list] = {side: [] for side in sides}
    for _ in range(repeats):
        for side in sides:
            result = subprocess.run([sys.executable, script, "--side", side, *flags], capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(result.stderr[-3000:])
            found[side].append(json.loads(result.stdout.strip().splitlines()[-1]))
    return found
