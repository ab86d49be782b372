"""A split's images as the loaders take them: `Images`, the protocol every kind implements (its `read`: a batch of
indices into uint8 pixels), and its kinds: `TensorImages` (decoded tensors in memory) and `EncodedImages` (sources.py's
EncodedRows decoded by batch in the loader's workers; --decode gpu: on the GPU). The loaders use only `Images`: one
`LoaderDataset` over any kind, and the kind's training order (`EpochSampler`, or a stream's own).
Each sample's crop, flip and mixing come from (seed, epoch, sample index): the same at any process and worker count and
after a resume."""

from __future__ import annotations

import abc
import faulthandler
import multiprocessing
import os
import sys
from dataclasses import replace
from functools import partial

import numpy as np
import torch

from utils import UserError
from utils.data.draws import Draws, Mixing, augment_draws, erase_draws, forward_seed, key_stream, mix_draws
from utils.data.pixels import (
    CropRecipe,
    device_views,
    evaluation_view,
    open_image,
    resized_crop_draws,
    row_pixels,
    square_pixels,
    train_view,
    upright_size,
)
from utils.data.sources import EncodedRows
from utils.data.transform import Policy, apply_policy, policy_draws

# How loader workers start. CPython before 3.11.10 can deadlock a child forked while a native thread is creating its
# Python thread state (gh-112275; here 3 of 227 2-rank jobs under load), so there a forkserver, which has no such
# thread, forks them (cost: docs/performance.md, P15; a copy's Dataset must pickle).
WORKER_START = "forkserver" if sys.version_info < (3, 11, 10) else None  # None: the platform's default, fork
if WORKER_START:  # imported by the server once, not by each worker (which then runs only the script's own lines)
    multiprocessing.set_forkserver_preload(["torch", "torchvision", "accelerate", "datasets", "utils.data.loaders"])


def worker_share() -> int:
    """Loader worker processes for this process: its share of the machine's cores (at least 1)."""
    return max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std (population) of uint8 (N, 3, S, S) images in [0, 1], summed in float64."""
    pixels = images.permute(0, 2, 3, 1).reshape(-1, 3)  # a view of channels-last memory
    total, squares = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for chunk in pixels.split(1 << 22):
        chunk = chunk.double()
        total += chunk.sum(0)
        squares += (chunk * chunk).sum(0)
    n = max(len(pixels), 1)
    mean = total / n
    std = (squares / n - mean * mean).clamp(min=0).sqrt()
    return tuple((mean / 255).tolist()), tuple((std / 255).tolist())


class LoaderDataset(torch.utils.data.Dataset):
    """What the loaders iterate, over a split's `images` of any kind: `__getitems__` gets the sampler's indices and
    returns the whole batch, uint8 (B, 3, S, S) images, int64 labels and for training its Draws, keyed by `augment_seed`
    (None: evaluation), `epoch` (set by the sampler), `augment`, `pad`, `mixing`, `erasing` and `policy`. `watch_s`
    (workers; 0: off): a batch still being read after that long writes its process's stacks to stderr (faulthandler): a
    hang says where it waits."""

    def __init__(self, images: Images, labels: torch.Tensor, augment_seed: int | None, augment: bool, pad: int,
                 mixing: Mixing | None, erasing: float = 0.0, policy: Policy | None = None, watch_s: float = 0.0):
        self.images, self.labels = images, labels
        self.augment_seed, self.augment, self.pad, self.mixing, self.epoch = augment_seed, augment, pad, mixing, 0
        self.erasing, self.policy, self.watch_s = erasing, policy, watch_s

    def __len__(self) -> int:
        return len(self.labels)

    def __getitems__(self, indices: list[int]):
        if not self.watch_s:
            return self.batch(indices)
        faulthandler.dump_traceback_later(self.watch_s)
        try:
            return self.batch(indices)
        finally:
            faulthandler.cancel_dump_traceback_later()

    def batch(self, indices: list[int]):
        # numpy: 3 us for 128 indices (torch.as_tensor(list): 14 us); non_blocking: a data-on-GPU copy would wait
        # for all queued GPU work (a pageable copy is staged before the call returns)
        host = np.asarray(indices, dtype=np.int64)  # once, for the batch and its draws
        key = (self.augment_seed, self.epoch) if self.augment_seed is not None and self.augment else None
        nhwc, cropped = self.images.read(host, key)
        labels = self.labels.index_select(0, torch.from_numpy(host).to(self.labels.device, non_blocking=True))
        images = nhwc.permute(0, 3, 1, 2)
        if self.augment_seed is None:
            return images, labels
        draws = self.draws(host, nhwc.shape[1], cropped)
        if cropped and draws.policy is not None:  # on the crops, here: the device's transform gets them finished
            images, draws = apply_policy(images, draws.policy), replace(draws, policy=None)
        return images, labels, draws

    def draws(self, host: np.ndarray, size: int, cropped: bool = False) -> Draws:
        """A training batch's Draws: its forward seed and, with augmentation, its crop and flip (none for images
        `cropped` already), mixing, erasing and policy."""
        seed, epoch = self.augment_seed, self.epoch
        if not self.augment:
            return Draws(forward=forward_seed(seed, epoch, host))
        return Draws(None if cropped else augment_draws(seed, epoch, host, self.pad),
                     mix_draws(seed, epoch, host, size, self.mixing) if self.mixing else None,
                     erase_draws(seed, epoch, host, size, self.erasing) if self.erasing else None,
                     forward_seed(seed, epoch, host),
                     policy_draws(seed, epoch, host, self.policy, size) if self.policy else None)


class KeyedSampler(torch.utils.data.Sampler):
    """A training order keyed by (seed, epoch); `set_epoch` tells the dataset the epoch too; `save_with` registers what
    the order needs in each checkpoint (a stream's plan)."""

    def save_with(self, accelerator) -> None:
        """Registers the sampler's state with Accelerate's checkpoints, if it has any."""


class EpochSampler(KeyedSampler):
    """The training order: a permutation per epoch from (seed, epoch) only, cut to whole steps of `step_images`;
    prepare() gives micro-batch k to process k mod P, so a step takes the same micro-batches at any P with P x
    accumulation fixed. Written by hand: Accelerate's seedable sampler drops a tail that depends on P and cannot tell
    the dataset the epoch. No `generator` attribute on purpose: Accelerate then leaves the RNG alone."""

    def __init__(self, dataset: LoaderDataset, seed: int, step_images: int):
        self.dataset, self.seed, self.step_images, self.epoch = dataset, seed, step_images, 0

    def set_epoch(self, epoch: int) -> None:  # called by the prepared loader's set_epoch and at each iteration
        self.epoch = self.dataset.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset) // self.step_images * self.step_images

    def __iter__(self):
        order = torch.Generator().manual_seed(int(key_stream(self.seed, self.epoch, 0)[0]))
        return iter(torch.randperm(len(self.dataset), generator=order)[:len(self)].tolist())


class Images(abc.ABC):
    """A split's images, as every kind gives them: `len()`, `prefix`, `image_size` (S), `workers` (loader workers per
    process; 0: the main process), `read` (a batch by index), `sampler`, `channel_stats`, `to` (--data-on-device), and
    two facts the loaders check: `on_device` and `crops_whole` (--augment resized-crop cuts from whole images as they
    are decoded)."""

    image_size: int
    workers: int = 0
    on_device: bool = False
    crops_whole: bool = False

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def prefix(self, n: int) -> Images:
        """The first n images (--train-subset, --eval-subset); a prefix is class-balanced."""

    @abc.abstractmethod
    def read(self, indices: np.ndarray, key: tuple[int, int] | None) -> tuple[torch.Tensor, bool]:
        """The images at `indices` as uint8 (B, S, S, 3), and whether they come cropped and flipped: `key` (seed, epoch)
        keys the crops a kind cuts as it decodes (None: evaluation, or no augmentation)."""

    @abc.abstractmethod
    def channel_stats(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The per-channel mean and std, in [0, 1], that the inputs are normalised with (when load_data gives none)."""

    def sampler(self, dataset: LoaderDataset, train: bool, seed: int, step_images: int, micro: int,
                processes: int) -> KeyedSampler | None:
        """The training order (evaluation: None): EpochSampler unless the kind plans its own."""
        return EpochSampler(dataset, seed, step_images) if train else None

    def to(self, device: torch.device) -> Images:
        raise UserError("--data-on-device keeps decoded images on the GPU; these are decoded by batch in the loader's "
                        "workers (--decode workers or stream, or a Dataset from load_data) and cannot stay there.")


class TensorImages(Images):
    """Decoded uint8 (N, 3, S, S) images in memory (NHWC views and memory maps are fine), indexed once per batch.
    `stats`: their mean and std when known (the cache's), else computed when asked."""

    def __init__(self, tensor: torch.Tensor, stats: tuple | None = None):
        # NHWC rows: a batch is then one row copy per image, and arrives in the layout the transform reads
        tensor = tensor.contiguous(memory_format=torch.channels_last)  # no copy of NHWC memory (the cache's)
        self.tensor, self.image_size, self.workers, self.stats = tensor, int(tensor.shape[-1]), 0, stats
        self.on_device = tensor.device.type != "cpu"

    def __len__(self) -> int:
        return len(self.tensor)

    def prefix(self, n: int) -> TensorImages:
        return TensorImages(self.tensor[:n], self.stats)

    def read(self, indices, key):
        # index_select of the NHWC view copies whole rows (8 us for 128; images[idx]: 2.3 ms) and stays NHWC
        idx = torch.from_numpy(indices).to(self.tensor.device, non_blocking=True)
        return self.tensor.permute(0, 2, 3, 1).index_select(0, idx), False

    def channel_stats(self):
        return self.stats or channel_stats(self.tensor)

    def to(self, device: torch.device) -> TensorImages:
        return TensorImages(self.tensor.to(device), self.stats)


def as_images(images: Images | torch.Tensor) -> Images:
    """A kind of `Images` as it is; a bare uint8 (N, 3, S, S) tensor (train_minimal.py's) as TensorImages."""
    return images if isinstance(images, Images) else TensorImages(images)


STATS_IMAGES = 512  # training images the per-channel mean and std are estimated from (the first, decoded at S)


class EncodedImages(Images):
    """A split's encoded `rows` at --image-size S. `recipe` None: each resized to S x S as the cache does (crops then on
    the device); a CropRecipe: the random-resized crop in training, the evaluation view otherwise. `reduce`: JPEGs
    decoded at the scale each view needs (False: --full-decode). `device`: decoded there by the process that reads the
    batch (--decode gpu; `workers` 0), else by Pillow in the loader's workers."""

    def __init__(self, rows: EncodedRows, size: int, recipe: CropRecipe | None, workers: int, reduce: bool = True,
                 device: str | None = None):
        self.rows, self.image_size, self.recipe, self.workers, self.reduce = rows, size, recipe, workers, reduce
        self.crops_whole, self.device, self.on_device = recipe is not None, device, device not in (None, "cpu")

    def __len__(self) -> int:
        return len(self.rows)

    def prefix(self, n: int) -> EncodedImages:
        return EncodedImages(self.rows.take(torch.arange(n)), self.image_size, self.recipe, self.workers, self.reduce,
                             self.device)

    def read(self, indices, key):
        """The batch decoded into one (B, S, S, 3) uint8 array: with a recipe and a training `key`, each image's keyed
        crop and flip cut as it is decoded (cropped: True), else its evaluation view."""
        rows, size, recipe = self.rows, self.image_size, self.recipe
        sources = rows.fetch(indices)
        opened = [open_image(source, rows, int(i)) for source, i in zip(sources, indices)]
        cropped = recipe is not None and key is not None
        boxes, mirrored = (resized_crop_draws(*key, indices, [upright_size(im) for im in opened], recipe) if cropped
                           else (None, None))
        if self.device is not None:
            return device_views(rows, indices, sources, opened, size, recipe, boxes, mirrored, self.device), cropped
        out = np.empty((len(indices), size, size, 3), dtype=np.uint8)
        for k, im in enumerate(opened):
            view = (partial(train_view, box=boxes[k], mirrored=bool(mirrored[k]), size=size, recipe=recipe,
                            reduce=self.reduce) if cropped else evaluation_view(size, recipe, self.reduce))
            out[k] = row_pixels(rows, int(indices[k]), im, view)
        return torch.from_numpy(out), cropped

    def sampler(self, dataset, train, seed, step_images, micro, processes):
        """The rows' own order (a stream plans what each process and loader worker reads), else every kind's."""
        own = self.rows.sampler(dataset, train, seed, step_images, (processes, self.workers, micro))
        return own or super().sampler(dataset, train, seed, step_images, micro, processes)

    def channel_stats(self):
        """Estimated from the first STATS_IMAGES training images, decoded at S (resized as the cache would)."""
        sample = self.rows.take(torch.arange(min(STATS_IMAGES, len(self.rows))))
        view = partial(square_pixels, size=self.image_size, reduce=self.reduce)
        pixels = np.stack([row_pixels(sample, i, open_image(s, sample, i), view)
                           for i, s in enumerate(sample.fetch(range(len(sample))))])
        return channel_stats(torch.from_numpy(pixels).permute(0, 3, 1, 2))
