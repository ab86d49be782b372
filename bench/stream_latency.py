"""Images per second of one loader worker streaming tar shards (--decode stream) from a server that answers each
request after --latency seconds (object storage's first-byte latency), with read-ahead (--read-ahead R requests in
flight, the next window read while this one is decoded) and without (each read when asked), against the same shards
in a local folder. All in this one process (num_workers=0: the rate of one worker), the three alternating, each
repeat a new epoch's plan. Prints each rate and the ratios.

    python bench/stream_latency.py --data-dir ../shared/data/cifar10 --images 1024 --latency 0.05 --repeats 3

--data-dir: the CIFAR-10 parquet copy; its first --images training images are upscaled (bicubic) to 256-320 px
JPEGs (quality 90) in 4 tar shards, as tests/conftest.py's write_upscaled_cifar and write_tar_shards do at test
sizes, and decoded with the natural-image crop recipe at 224 px. Windows of --window rows, blocks of --block rows.
"""

from __future__ import annotations

import functools
import http.server
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from conftest import RangeHandler, write_tar_shards, write_upscaled_cifar  # noqa: E402

from bench.common import header, image_bench_parser  # noqa: E402
from utils.data.builtin import load_encoded  # noqa: E402
from utils.data.images import LoaderDataset
from utils.data.pixels import CropRecipe  # noqa: E402
from utils.data.stream import StreamSettings  # noqa: E402


class SlowHandler(RangeHandler):
    latency = 0.05

    def send_head(self):
        time.sleep(self.latency)
        return super().send_head()


def loader(source: str, size: int, settings: StreamSettings):
    data = load_encoded(source, image_size=size, recipe=CropRecipe(), workers=1, stream=settings)
    dataset = LoaderDataset(data["train"][0], data["train"][1], 0, True, 0, None)
    sampler = data["train"][0].sampler(dataset, True, 0, 128, 128, 1)
    return sampler, torch.utils.data.DataLoader(dataset, batch_size=128, sampler=sampler, collate_fn=lambda b: b)


def rate(sampler, loader, epoch: int) -> float:
    sampler.set_epoch(epoch)  # a new plan: nothing held from the last epoch
    start = time.perf_counter()
    seen = sum(len(batch[1]) for batch in loader)
    return seen / (time.perf_counter() - start)


def main() -> None:
    parser = image_bench_parser(__doc__)
    parser.add_argument("--latency", type=float, default=0.05, help="seconds before the server answers a request")
    parser.add_argument("--read-ahead", type=int, default=4)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--block", type=int, default=32)
    args = parser.parse_args()
    header("one loader worker streaming tar shards: a server with latency, with and without read-ahead, and local")
    torch.set_num_threads(1)  # one worker's share
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_tar_shards(Path(tmp) / "tars", write_upscaled_cifar(
            Path(tmp) / "parquet", Path(args.data_dir), n_train=args.images, n_test=64, sizes=(256, 288, 320),
            parquet_shards=4))
        handler = functools.partial(type("Slow", (SlowHandler,), {"latency": args.latency}), directory=str(shards))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        runs = {"local": (str(shards), args.read_ahead), "server, read-ahead": (url, args.read_ahead),
                "server, no read-ahead": (url, 0)}
        loaders = {name: loader(source, args.size, StreamSettings(args.window, args.block, ahead))
                   for name, (source, ahead) in runs.items()}
        rates = {name: [] for name in runs}
        for epoch in range(args.repeats):
            for name, (sampler, data) in loaders.items():
                rates[name].append(rate(sampler, data, epoch))
        server.shutdown()
    median = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{args.images} JPEGs of 256-320 px -> {args.size} px crops in 4 tar shards; windows of {args.window}, "
          f"blocks of {args.block}; {args.latency * 1000:.0f} ms a request; read-ahead {args.read_ahead}; 1 worker "
          f"(1 thread), median of {args.repeats}:")
    for name, value in median.items():
        print(f"  {name}: {value:,.0f} img/s ({', '.join(f'{r:,.0f}' for r in rates[name])})")
    print(f"  ratio read-ahead / none: {median['server, read-ahead'] / median['server, no read-ahead']:.2f}x; "
          f"read-ahead / local: {median['server, read-ahead'] / median['local']:.2f}x")


if __name__ == "__main__":
    main()
