"""Images decoded on the fly (--decode workers): the source's images stay encoded (parquet rows in datasets'
memory-mapped table, or an image folder's files) and the DataLoader's worker processes decode each batch as the
sampler asks for it. For images whose decoded copy would not fit the cache (utils/decode.py) or that the crop recipe
for natural images needs whole (--augment resized-crop, utils/crops.py). The sampler's contract holds as on the
cached path: the order comes from utils.batches.EpochSampler, each sample's crop, flip and mixing from (seed, epoch,
sample index), so batches are the same at any process count, worker count and after a resume.

`load_encoded` is the entry point (`load_builtin`, a template's load_data, returns it where the flags ask for it);
`EncodedImages` stands where the cached path has an image tensor, and makes the loader's dataset
(`DecodingDataset`). `choose_decode` says which path --decode auto takes.
"""

from __future__ import annotations

import os
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import torch

from utils.batches import SPLITS, batch_draws, channel_stats
from utils.config_groups import is_url
from utils.crops import CropRecipe, eval_view, resized_crop_draws, train_view
from utils.decode import default_cache_dir, load_source, square_pixels
from utils.launch import main_print
from utils.sources import Rows, fingerprint, first_size, locate, open_image, row_pixels, split_rows
from utils.stream import StreamSettings, holds_tar_shards_only, open_stream

STATS_IMAGES = 512  # training images the per-channel mean and std are estimated from (the first, decoded at S)


class EncodedImages:
    """A split's encoded images at --image-size S: where the cached path holds an (N, 3, S, S) uint8 tensor. The
    view of each image: `recipe` None: resized to S x S as the cache does (the small-image crops then run on the
    device, as there); a CropRecipe: the random-resized crop in training, resize and centre crop in evaluation."""

    def __init__(self, rows: Rows, size: int, recipe: CropRecipe | None, workers: int):
        self.rows, self.image_size, self.recipe, self.workers = rows, size, recipe, workers

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, prefix: slice) -> EncodedImages:
        """images[:n], the first n images (--train-subset, --eval-subset), as a tensor's prefix."""
        return EncodedImages(self.rows.take(torch.arange(len(self))[prefix]), self.image_size, self.recipe,
                             self.workers)

    def dataset(self, labels, train: bool, seed: int, augment: bool, pad: int, mixing) -> DecodingDataset:
        return DecodingDataset(self, labels, seed if train else None, augment, pad, mixing)


class DecodingDataset(torch.utils.data.Dataset):
    """BatchedTensorDataset's batches (utils/batches.py) from encoded images: `__getitems__` decodes the batch's
    images, in a DataLoader worker, into one (B, S, S, 3) uint8 array. A training set (`augment_seed` given) returns
    (images, labels, draws) as there: the small-image crop and flip drawn for the device, or with the crop recipe
    cropped and flipped here already (draws (None, None), then the mixing draws if any)."""

    def __init__(self, images: EncodedImages, labels: torch.Tensor, augment_seed: int | None, augment: bool,
                 pad: int, mixing):
        self.images, self.labels, self.augment_seed, self.augment = images, labels, augment_seed, augment
        self.pad, self.mixing, self.epoch = pad, mixing, 0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitems__(self, indices: list[int]):
        host = np.asarray(indices, dtype=np.int64)
        rows, size, recipe = self.images.rows, self.images.image_size, self.images.recipe
        out = np.empty((len(host), size, size, 3), dtype=np.uint8)
        opened = [_open(rows, source, int(i)) for source, i in zip(rows.fetch(host), host)]
        cropped_here = recipe is not None and self.augment_seed is not None and self.augment
        if cropped_here:
            boxes, mirrored = resized_crop_draws(self.augment_seed, self.epoch, host, [im.size for im in opened],
                                                 recipe)
        for k, im in enumerate(opened):
            if cropped_here:
                view = partial(train_view, box=boxes[k], mirrored=bool(mirrored[k]), size=size, recipe=recipe)
            else:
                view = partial(eval_view, size=size, recipe=recipe) if recipe else partial(square_pixels, size=size)
            out[k] = row_pixels(rows, int(host[k]), im, view)
        batch = torch.from_numpy(out).permute(0, 3, 1, 2), self.labels[torch.from_numpy(host)]
        if self.augment_seed is None:
            return batch
        return (*batch, batch_draws(self, host, size, cropped=cropped_here))


def _open(rows: Rows, source, i: int):
    return open_image(source, rows.split, rows.where(i))


def load_encoded(data_dir: str | None, dataset: str | None = None, image_size: int | None = None,
                 columns: tuple[str | None, str | None] = (None, None), val_fraction: float | None = None,
                 recipe: CropRecipe | None = None, workers: int | None = None, stream: StreamSettings | None = None
                 ) -> dict:
    """The built-in sources (as utils.decode.load_source gives them), with EncodedImages in place of the image
    tensors: nothing is decoded but the first STATS_IMAGES training images, for the per-channel mean and std.
    image_size: S; None: the first training image's size. recipe: the crop recipe (--augment resized-crop), or None.
    workers: the DataLoader's decoding worker processes (per process); None: this process's share of the cores.
    stream: read the shards of data_dir (a folder or a URL; --dataset: the Hub's) as a stream (utils/stream.py) with
    these settings, instead of through datasets' table (whose index every process reads; no cache file is
    written)."""
    if stream:
        rows, classes, description = open_stream(data_dir or f"hf://datasets/{dataset}", columns, stream)
    else:
        source = locate(data_dir, dataset, val_fraction)
        rows, classes = split_rows(source, columns, encoded=True)
        source.announce_held_out(main_print, len(rows["train"]), len(rows["test"]))
        key = fingerprint(source.paths, {"columns": list(columns), "val_fraction": source.fraction})
        description = {**source.describe(key), "decode": "workers"}
    size = image_size or first_size(rows)[0]
    workers = workers or max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    sample = rows["train"].take(torch.arange(min(STATS_IMAGES, len(rows["train"]))))
    pixels = np.stack([row_pixels(sample, i, _open(sample, s, i), partial(square_pixels, size=size))
                       for i, s in enumerate(sample.fetch(range(len(sample))))])
    mean, std = channel_stats(torch.from_numpy(pixels).permute(0, 3, 1, 2))
    data = {s: (EncodedImages(rows[s], size, recipe, workers), rows[s].labels) for s in SPLITS}
    view = {"eval_crop": recipe.eval_crop, "interpolation": recipe.interpolation} if recipe else {}  # how it evaluates
    return data | {"classes": classes, "mean": mean, "std": std, "dataset": description} | view


def load_builtin(cfg) -> dict:
    """The built-in sources by a script's data flags (its DataConfig group), for its load_data: --data-dir or
    --dataset (neither: CIFAR-10 from the Hub), on the path choose_decode picks: decoded once into the cache
    (utils/decode.py), kept encoded and decoded by batch in the loader's workers, or streamed from shards
    (utils/stream.py)."""
    dataset = cfg.dataset or (None if cfg.data_dir else "uoft-cs/cifar10")
    columns = (cfg.image_column, cfg.label_column)
    decode = choose_decode(cfg, dataset)  # printed, with why
    if decode == "cache":
        return load_source(cfg.data_dir, dataset, cfg.image_size, columns, cfg.val_fraction, cfg.cache_dir,
                           cfg.decode_workers)
    recipe = CropRecipe(cfg.crop_scale, cfg.crop_ratio, cfg.eval_crop or CropRecipe.eval_crop,  # unset: defaults
                        cfg.interpolation or CropRecipe.interpolation) if cfg.augment == "resized-crop" else None
    stream = None
    if decode == "stream":
        local = cfg.data_dir if cfg.data_dir and not is_url(cfg.data_dir) else None
        stream = StreamSettings(cfg.shuffle_buffer, cfg.shuffle_block, cfg.read_ahead,
                                Path(cfg.cache_dir or default_cache_dir(local)) / "stream-index")
    return load_encoded(cfg.data_dir, dataset, cfg.image_size, columns, cfg.val_fraction, recipe, cfg.data_workers,
                        stream=stream)


def choose_decode(cfg, dataset: str | None) -> str:
    """The path --decode takes, said on the main process with why: 'cache', 'workers' or 'stream'. auto: stream for a
    --data-dir URL or a folder of tar shards; workers for --augment resized-crop (its crops need whole images), or when
    the decoded images (N x 3 x S x S bytes; S: --image-size, else the first training image's own size) would not
    fit in the cache folder's free space; else the cache. cfg: the data group of a script's Config (contradicting
    flags are refused when they are parsed)."""
    if cfg.decode != "auto":
        choice, why = cfg.decode, f"--decode {cfg.decode}"
    elif is_url(cfg.data_dir):
        choice, why = "stream", "--decode auto: --data-dir is a URL"
    elif cfg.data_dir and holds_tar_shards_only(Path(cfg.data_dir)):
        choice, why = "stream", "--decode auto: --data-dir holds tar shards"
    elif cfg.augment == "resized-crop":
        choice, why = "workers", "--decode auto: --augment resized-crop crops whole images"
    else:
        folder = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir(cfg.data_dir)
        while not folder.exists():
            folder = folder.parent
        source = locate(cfg.data_dir, dataset, cfg.val_fraction)
        side = cfg.image_size or first_size(split_rows(source, (cfg.image_column, cfg.label_column), True)[0])[0]
        need, free = source.count() * 3 * side ** 2, shutil.disk_usage(folder).free
        choice = "workers" if need > free else "cache"
        why = (f"--decode auto: the decoded images take {need / 2**20:,.1f} MiB at {side} x {side} px, {folder} has "
               f"{free / 2**20:,.1f} free")
    main_print({"workers": f"decoding each batch in the loader's workers ({why})",
                "stream": f"streaming the shards, each batch decoded in the loader's workers ({why})",
                "cache": f"decoding the images once into the cache ({why})"}[choice])
    return choice
