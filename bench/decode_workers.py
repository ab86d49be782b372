"""Images per second per loader worker at 224 px, decoding JPEGs on the fly with the natural-image crop recipe:
utils/data's LoaderDataset over EncodedImages (a batch per call, crops keyed by sample) against torchvision's
ImageFolder with transforms.v2 doing the same decode, random-resized crop and flip (a sample per call,
default_collate), and the same LoaderDataset reading the same JPEGs from webdataset tar shards as --decode stream
plans them (utils/data/stream.py),
all in this one process (num_workers=0: the rate of one worker), alternating. Prints each rate, the ratios to
torchvision's and how many workers a GPU training at --gpu-rate images/s needs.

    python bench/decode_workers.py --data-dir ../shared/data/cifar10 --images 1024 --repeats 3

--data-dir: the CIFAR-10 parquet copy; its first --images training images are upscaled (bicubic) to 256-320 px
JPEGs (quality 90) in a temporary image folder and in 4 tar shards, as tests/conftest.py's write_upscaled_cifar and
write_tar_shards do at test sizes.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
import torchvision  # noqa: E402
import torchvision.transforms.v2 as T  # noqa: E402
from conftest import write_tar_shards, write_upscaled_cifar  # noqa: E402

from bench.common import image_bench_parser  # noqa: E402
from utils.data.builtin import load_encoded  # noqa: E402
from utils.data.images import LoaderDataset
from utils.data.pixels import CropRecipe  # noqa: E402
from utils.data.stream import StreamSettings  # noqa: E402


def rate(loader, images: int) -> float:
    start = time.perf_counter()
    seen = sum(len(batch[1]) for batch in loader)
    assert seen == images, (seen, images)
    return seen / (time.perf_counter() - start)


def main() -> None:
    parser = image_bench_parser(__doc__)
    parser.add_argument("--gpu-rate", type=float, default=3000.0, help="a GPU's training images/s")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one worker's share
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_upscaled_cifar(Path(tmp), Path(args.data_dir), n_train=args.images, n_test=64,
                                      sizes=(256, 288, 320))
        shards = write_tar_shards(Path(tmp) / "tars", write_upscaled_cifar(
            Path(tmp) / "parquet", Path(args.data_dir), n_train=args.images, n_test=64, sizes=(256, 288, 320),
            parquet_shards=4))
        data = load_encoded(str(folder), image_size=args.size, recipe=CropRecipe(), workers=1)
        ours_set = LoaderDataset(data["train"][0], data["train"][1], 0, True, 0, None)
        ours = torch.utils.data.DataLoader(ours_set, batch_size=128, collate_fn=lambda b: b)
        streamed = load_encoded(str(shards), image_size=args.size, recipe=CropRecipe(), workers=1,
                                stream=StreamSettings())
        stream_set = LoaderDataset(streamed["train"][0], streamed["train"][1], 0, True, 0, None)
        order = streamed["train"][0].sampler(stream_set, True, 0, 128, 128, 1)
        stream = torch.utils.data.DataLoader(stream_set, batch_size=128, sampler=order, collate_fn=lambda b: b)
        recipe = T.Compose([T.RandomResizedCrop(args.size, antialias=True), T.RandomHorizontalFlip(), T.PILToTensor()])
        theirs_set = torchvision.datasets.ImageFolder(str(folder / "train"), transform=recipe)
        theirs = torch.utils.data.DataLoader(theirs_set, batch_size=128, shuffle=True)
        rates = {"ours": [], "torchvision": [], "stream": []}
        for _ in range(args.repeats):
            rates["ours"].append(rate(ours, args.images))
            rates["torchvision"].append(rate(theirs, args.images))
            rates["stream"].append(rate(stream, args.images))
    median = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{args.images} JPEGs of 256-320 px -> {args.size} px crops, 1 worker (1 thread), median of {args.repeats}:")
    print(f"  ours (LoaderDataset, keyed crops): {median['ours']:,.0f} img/s")
    print(f"  torchvision ImageFolder + v2:        {median['torchvision']:,.0f} img/s")
    print(f"  ours from tar shards (--decode stream): {median['stream']:,.0f} img/s")
    print(f"  ratio ours / torchvision: {median['ours'] / median['torchvision']:.2f}x, streamed / torchvision: "
          f"{median['stream'] / median['torchvision']:.2f}x")
    print(f"  a GPU training {args.gpu_rate:,.0f} img/s needs {args.gpu_rate / median['ours']:.0f} such workers")


if __name__ == "__main__":
    main()
