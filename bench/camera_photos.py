"""Camera-size photos: images per second per loader worker from 4000 x 3000 JPEGs (quality 90, about 4 MB each, as a
phone's) into 224 px random-resized crops with flips, JPEGs decoded at the DCT scale each crop needs: utils/data's
LoaderDataset over EncodedImages (--decode workers; each JPEG decoded only down to its crop's last row), the same
reading the JPEGs from 2 tar shards as --decode stream plans them, the same decoding every row (not with --gpu), and
the same at full size (--full-decode), against torchvision's ImageFolder with transforms.v2
(RandomResizedCrop(224), RandomHorizontalFlip: the whole image decoded first); the evaluation view (shorter side to
256, centre 224) against torchvision's Resize(256) + CenterCrop(224); what building the decode cache costs per image
(the resize to --size x --size); and how far the reduced decode's pixels are from the full decode's. All in this one
process (num_workers=0: one worker's rate), one thread, each side in turn, repeated. --gpu: also the batches decoded
on the GPU (--decode gpu: nvJPEG, the crops cut there), training crops and evaluation views, against the CPU worker.
--heic: also the same photos as an iPhone's HEIC (quality 90, pillow-heif's x265 encoder), whose decode has no reduced
scale, against the JPEGs. --sideways: every photo stored on its side (3000 x 4000, EXIF orientation 6: shown as
4000 x 3000), as a phone stores one it took held the other way.

    python bench/camera_photos.py --data-dir ../shared/data/cifar10 --images 32 --repeats 3

--data-dir: the CIFAR-10 parquet copy; its first --images training images are upscaled (bicubic) to 4000 x 3000,
with a sensor-like grain (standard deviation 8 levels) so that the files are as large as a camera's, and saved as
JPEGs (tests/conftest.py's write_upscaled_cifar).
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
import torchvision  # noqa: E402
import torchvision.transforms.v2 as T  # noqa: E402
from conftest import add_tar_sample, write_upscaled_cifar  # noqa: E402
from PIL import Image  # noqa: E402

from bench.common import header, image_bench_parser  # noqa: E402
from utils.data import pixels  # noqa: E402
from utils.data.builtin import load_encoded  # noqa: E402
from utils.data.images import LoaderDataset  # noqa: E402
from utils.data.pixels import CropRecipe, square_pixels  # noqa: E402
from utils.data.stream import StreamSettings  # noqa: E402


def rate(loader, images: int) -> float:
    start = time.perf_counter()
    seen = sum(len(batch[1]) for batch in loader)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # --decode gpu's last batch finished, not only queued
    assert seen == images, (seen, images)
    return seen / (time.perf_counter() - start)


def ours(folder, size: int, reduce: bool, train: bool, stream: StreamSettings | None = None, device=None):
    """A DataLoader (batch 16, in this process) over `folder`'s training images as train_cifar.py's loaders read them:
    keyed random-resized crops + flips (train), or the evaluation view; `device`: decoded there (--decode gpu)."""
    data = load_encoded(str(folder), image_size=size, recipe=CropRecipe(), workers=1, stream=stream, reduce=reduce,
                        device=device)
    images, labels = data["train"]
    dataset = LoaderDataset(images, labels, 0 if train else None, train, 0, None)
    order = images.sampler(dataset, True, 0, 16, 16, 1) if train else None
    return torch.utils.data.DataLoader(dataset, batch_size=16, sampler=order, collate_fn=lambda b: b)


class AllRows:
    """A loader whose JPEGs are decoded down to their last row whatever the crop (pixels.first_rows left out): what
    decoding a crop's rows only saves."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        with mock.patch.object(pixels, "first_rows", lambda im, rows, request: im):
            yield from self.loader


def tars(folder: Path, root: Path) -> Path:
    """The image folder's training JPEGs in 2 webdataset tar shards (and its test JPEGs in one)."""
    classes = sorted(p.name for p in (folder / "train").iterdir())  # labels 0..C-1, as a stream's must be
    root.mkdir()
    for split, shards in (("train", 2), ("test", 1)):
        files = sorted((folder / split).rglob("*.jpg"))
        for k in range(shards):
            with tarfile.open(root / f"{split}-{k:05d}-of-{shards:05d}.tar", "w") as tar:
                for path in files[k::shards]:
                    add_tar_sample(tar, f"{split}{path.stem}", "jpg", path.read_bytes(),
                                   classes.index(path.parent.name))
    return root


def as_heic(folder: Path, root: Path) -> Path:
    """The image folder's JPEGs saved again as HEIC photos (quality 90) in a folder of the same layout."""
    import pillow_heif

    for path in folder.rglob("*.jpg"):
        (root / path.parent.relative_to(folder)).mkdir(parents=True, exist_ok=True)
        with Image.open(path) as im:
            pillow_heif.from_pillow(im).save(root / path.relative_to(folder).with_suffix(".heic"), quality=90,
                                             enc_params={"preset": "ultrafast"})
    return root


def distance(folder: Path, size: int) -> dict[str, tuple[float, int]]:
    """Mean and max |reduced - full| per pixel (levels of 255) of the training crops (the same keyed boxes) and the
    evaluation views of the folder's training images."""
    found = {}
    for name, train in (("training crops", True), ("evaluation views", False)):
        batches = [torch.cat([batch[0] for batch in ours(folder, size, reduce, train)]) for reduce in (True, False)]
        difference = (batches[0].int() - batches[1].int()).abs()
        found[name] = difference.float().mean().item(), difference.max().item()
    return found


def cache_cost(files: list[Path], size: int, reduce: bool) -> float:
    """Milliseconds per image of the cache's decode: each file to size x size (bicubic)."""
    start = time.perf_counter()
    for path in files:
        with Image.open(path) as im:
            square_pixels(im, size, reduce)
    return (time.perf_counter() - start) / len(files) * 1e3


def main() -> None:
    parser = image_bench_parser(__doc__)
    parser.set_defaults(images=32)
    parser.add_argument("--gpu-rate", type=float, default=3000.0, help="a GPU's training images/s")
    parser.add_argument("--gpu", action="store_true", help="also --decode gpu (nvJPEG), against the CPU worker")
    parser.add_argument("--heic", action="store_true", help="also the photos as HEIC, against the JPEGs")
    parser.add_argument("--sideways", action="store_true",
                        help="the photos stored on their side with EXIF orientation 6, as a phone stores a photo")
    args = parser.parse_args()
    header("camera-size JPEGs, one loader worker: reduced decoding against torchvision")
    torch.set_num_threads(1)  # one worker's share
    n = args.images
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_upscaled_cifar(Path(tmp) / "photos", Path(args.data_dir), n_train=n, n_test=0,
                                      sizes=((4000, 3000),), grain=8.0, photos=1 if args.sideways else 0)
        shutil.copytree(folder / "train", folder / "test")  # an image folder's splits have the same classes
        shards = tars(folder, Path(tmp) / "tars")
        files = sorted((folder / "train").rglob("*.jpg"))
        megabytes = statistics.mean(p.stat().st_size for p in files) / 2**20
        crop = T.Compose([T.RandomResizedCrop(args.size, antialias=True), T.RandomHorizontalFlip(), T.PILToTensor()])
        view = T.Compose([T.Resize(int(args.size / CropRecipe.eval_crop), antialias=True),
                          T.CenterCrop(args.size), T.PILToTensor()])
        loaders = {
            "ours (--decode workers)": ours(folder, args.size, True, True),
            "ours (--decode stream)": ours(shards, args.size, True, True, StreamSettings()),
            "ours (--full-decode)": ours(folder, args.size, False, True),
            "torchvision ImageFolder + v2": torch.utils.data.DataLoader(torchvision.datasets.ImageFolder(
                str(folder / "train"), transform=crop), batch_size=16, shuffle=True),
            "ours, evaluation view": ours(folder, args.size, True, False),
            "torchvision Resize + CenterCrop": torch.utils.data.DataLoader(torchvision.datasets.ImageFolder(
                str(folder / "train"), transform=view), batch_size=16),
        }
        if args.gpu:
            loaders |= {"ours (--decode gpu)": ours(folder, args.size, False, True, device="cuda"),
                        "ours (--decode gpu), evaluation view": ours(folder, args.size, False, False, device="cuda")}
        else:  # (the GPU check's time is for the GPU's arms)
            loaders["ours (--decode workers), every row decoded"] = AllRows(ours(folder, args.size, True, True))
        if args.heic:
            heic = as_heic(folder, Path(tmp) / "heic")
            heic_megabytes = statistics.mean(p.stat().st_size for p in heic.rglob("*.heic")) / 2**20
            loaders["ours (--decode workers), HEIC"] = ours(heic, args.size, True, True)
        rates = {name: [] for name in loaders}
        cache = {"reduced": [], "full": []}
        for _ in range(args.repeats):
            for name, loader in loaders.items():
                rates[name].append(rate(loader, n))
            for side in cache:
                cache[side].append(cache_cost(files, args.size, side == "reduced"))
        far = distance(folder, args.size)
    median = {k: statistics.median(v) for k, v in rates.items()}
    base, base_view = median["torchvision ImageFolder + v2"], median["torchvision Resize + CenterCrop"]
    print(f"{n} JPEGs of 4000 x 3000 ({megabytes:.1f} MB each) -> {args.size} px, 1 worker (1 thread), "
          f"median of {args.repeats}:")
    for name, value in median.items():
        against = base_view if "view" in name or "Center" in name else base
        print(f"  {name}: {value:.2f} img/s ({value / against:.2f}x torchvision's)")
    print(f"  decode cache, per image at {args.size} x {args.size}: {statistics.median(cache['reduced']):.0f} ms "
          f"reduced, {statistics.median(cache['full']):.0f} ms full")
    for name, (mean, most) in far.items():
        print(f"  reduced against full decoding, {name}: mean {mean:.2f}, max {most} levels of 255")
    for name in [k for k in median if "gpu" in k]:
        cpu = median["ours (--decode workers)" if "view" not in name else "ours, evaluation view"]
        print(f"  {name}: {median[name] / cpu:.2f}x one CPU worker of ours (--decode workers)")
    if args.heic:
        heic_rate = median["ours (--decode workers), HEIC"] / median["ours (--decode workers)"]
        print(f"  HEIC ({heic_megabytes:.1f} MB each): {heic_rate:.2f}x the JPEGs' rate")
    for name in ("ours (--decode workers)", "torchvision ImageFolder + v2"):
        print(f"  a GPU training {args.gpu_rate:,.0f} img/s needs {args.gpu_rate / median[name]:.0f} workers like "
              f"{name}")


if __name__ == "__main__":
    main()
