"""P7: the first decode with --decode-workers N against 1 worker: images/s of load_source on a folder of CIFAR-10 PNGs
(all 60,000 images of the parquet source, written once as lossless PNGs into a temporary image folder), each run
into an empty cache folder, alternating, after one warm-up run (the folder's table of files, built once into
datasets' cache), and its decode alone. The caches written must be the same file, byte for byte.

    python bench/decode_rate.py --data-dir ../shared/data/cifar10            # 2 workers against 1
    python bench/decode_rate.py --data-dir ../shared/data/cifar10 --workers 8 --repeats 3
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import header, report  # noqa: E402
from utils.data import decode as decode_module  # noqa: E402
from utils.data.decode import load_source  # noqa: E402

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def png_folder(data_dir: str, root: Path) -> int:
    """The source's images as <split>/<class>/<row>.png; returns how many."""
    data = load_source(data_dir, cache_dir=str(root / "parquet-cache"), decode_workers=1)
    count = 0
    for split in ("train", "test"):
        images, labels = data[split]
        for row, (image, label) in enumerate(zip(images, labels.tolist())):
            folder = root / "folder" / split / CLASSES[label]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"{row:05d}.png")
            count += 1
    return count


def decode(folder: Path, cache: Path, workers: int) -> tuple[float, float, str]:
    """Seconds of one load_source into an empty cache folder, of its decode_all alone (the part the workers share),
    and the cache file's sha256."""
    shutil.rmtree(cache, ignore_errors=True)
    timed, real = [], decode_module.decode_all

    def decode_all(*args):
        start = time.perf_counter()
        real(*args)
        timed.append(time.perf_counter() - start)

    decode_module.decode_all = decode_all
    try:
        start = time.perf_counter()
        load_source(str(folder), cache_dir=str(cache), decode_workers=workers)
        seconds = time.perf_counter() - start
    finally:
        decode_module.decode_all = real
    (path,) = cache.glob("images-*.safetensors")
    return seconds, timed[0], hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="CIFAR-10 parquet folder")
    parser.add_argument("--workers", type=int, default=2, help="--decode-workers of the compared side")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    header(f"P7: first decode of a PNG folder, --decode-workers {args.workers} against 1")
    work = Path(tempfile.mkdtemp(prefix="decode-rate-"))
    try:
        count = png_folder(args.data_dir, work)
        print(f"{count:,} PNG files in {work / 'folder'}", flush=True)
        decode(work / "folder", work / "cache", 1)  # warm-up: the folder's table (datasets' cache), files in page cache
        rates, decoding, digests = {1: [], args.workers: []}, {1: [], args.workers: []}, set()
        for _ in range(args.repeats):
            for workers in (args.workers, 1):
                seconds, decoding_seconds, digest = decode(work / "folder", work / "cache", workers)
                rates[workers].append(count / seconds)
                decoding[workers].append(count / decoding_seconds)
                digests.add(digest)
        print("load_source, end to end (listing and reading the folder through datasets, the decode, the statistics):")
        report(f"{args.workers} workers", rates[args.workers], "1 worker", rates[1])
        print("the decode alone (decode_all):")
        report(f"{args.workers} workers", decoding[args.workers], "1 worker", decoding[1])
        print(f"cache files identical across runs: {len(digests) == 1}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
