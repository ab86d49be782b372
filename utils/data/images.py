"""A split's images as the loaders take them, whatever holds them: `Images`, the declared protocol every kind implements
(its `read`: a batch of indices into uint8 pixels), and its two kinds: `TensorImages`, decoded uint8 tensors in memory
(the decode cache's images, a copy's arrays), and `EncodedImages`, encoded rows (a table's, a stream's or a copy's torch
Dataset's: utils/data/sources.py's EncodedRows) decoded by batch in the loader's worker processes (--decode gpu: on the
GPU, by the process that trains). The loaders (utils/data/loaders.py) use only what `Images` declares: one
`LoaderDataset` over any kind (one whole batch per `__getitems__`, with its draws) and the kind's training order
(`EpochSampler`, or a stream's own).

Encoded images (--decode workers, --decode stream, a copy's Dataset) are for images whose decoded copy would not fit the
cache (utils/data/decode.py) or that the crop recipe for natural images needs whole (--augment resized-crop,
utils/data/pixels.py). The sampler's contract holds as on the cached path: each sample's crop, flip and mixing come from
(seed, epoch, sample index), so batches are the same at any process count, worker count and after a resume."""

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

# How the loaders' worker processes start. CPython before 3.11.10 can deadlock a child forked while a thread without
# a Python thread state (a library's native thread calling back into Python) is creating one: the child waits
# forever inside os.fork(), on the interpreter's thread-list lock, before any code of its own runs (gh-112275; seen
# here as a loader worker that never started: 3 of 227 2-rank jobs under load). A training process has such threads,
# so on those versions the workers are forked by a forkserver (a process of its own, started once, that has none).
# Its cost: the libraries' imports once more per process, at its first loader (docs/performance.md, P15); then a
# worker starts about as fast as a forked one and runs the script's own top-level lines; a copy's Dataset must pickle.
WORKER_START = "forkserver" if sys.version_info < (3, 11, 10) else None  # None: the platform's default, fork
if WORKER_START:  # imported by the server once, not by each worker (which then runs only the script's own lines)
    multiprocessing.set_forkserver_preload(["torch", "torchvision", "accelerate", "datasets", "utils.data.loaders"])


def worker_share() -> int:
    """Loader worker processes for this process: its share of the machine's cores (at least 1), for the kinds read and
    decoded in workers."""
    return max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation (population) of uint8 (N, 3, S, S) images, in [0, 1]: what the
    transform normalises with. Summed in float64, a few million pixels at a time."""
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
    """The dataset the loaders iterate, over a split's `images` of any kind: the DataLoader calls `__getitems__` once
    per batch with the sampler's indices, and gets the whole batch, (images, labels) as uint8 (B, 3, S, S) (a view of
    NHWC memory) and int64 (B,), and for a training set also its Draws: no per-image Python work beyond the kind's
    own (`Images.read`). A training batch's draws are keyed by `augment_seed` (None: an evaluation set), `epoch` (set
    by the sampler), `augment` (off: no crop and flip), `pad` (the crop's padding), `mixing`, `erasing` (the
    chance that an image is erased, --random-erase) and `policy` (--auto-augment). Crops that the kind cuts as it
    decodes get the policy here, in the loader's worker; the others on the device after their crop and flip.
    `watch_s` (loader workers; 0: off): a batch still being read after that many seconds writes the stacks of its
    process's threads to stderr (faulthandler, whose own thread needs no lock a hung one may hold): a hang says
    where it waits."""

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
        # the indices through numpy: 3 us for 128, torch.as_tensor(list) 14 us. non_blocking: with the data on a GPU
        # a blocking copy would wait for all queued GPU work every batch (a copy from pageable memory is staged
        # before the call returns, so the host array may go away at once).
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
        """A training batch's draws for BatchTransform.train and the model's forward, from this dataset's
        augment_seed, epoch, augment, pad, mixing, erasing and policy: its forward seed (forward_seed) and, with
        augmentation, its crop and flip (augment_draws; none when the images come `cropped` already,
        utils/data/images.py), its mixing (mix_draws), erasing (erase_draws) and policy (policy_draws), if any."""
        seed, epoch = self.augment_seed, self.epoch
        if not self.augment:
            return Draws(forward=forward_seed(seed, epoch, host))
        return Draws(None if cropped else augment_draws(seed, epoch, host, self.pad),
                     mix_draws(seed, epoch, host, size, self.mixing) if self.mixing else None,
                     erase_draws(seed, epoch, host, size, self.erasing) if self.erasing else None,
                     forward_seed(seed, epoch, host),
                     policy_draws(seed, epoch, host, self.policy, size) if self.policy else None)


class KeyedSampler(torch.utils.data.Sampler):
    """A training order keyed by (seed, epoch); `set_epoch` also tells the dataset the epoch that keys its draws.
    `save_with` registers what the order needs in each checkpoint (a stream's plan); nothing here."""

    def save_with(self, accelerator) -> None:
        """Registers the sampler's state with Accelerate's checkpoints (`register_for_checkpointing`), if it has
        any."""


class EpochSampler(KeyedSampler):
    """The training order: a permutation of the samples per epoch, a function of (seed, epoch) only, cut to whole
    optimizer steps of `step_images` (the global batch). Accelerate's prepare() splits its micro-batches over the
    processes (micro-batch k to process k mod P), so optimizer step s takes the same micro-batches at any process
    count P with P x accumulation fixed.
    Written by hand because Accelerate's seedable sampler keeps the whole epoch and its shards then drop a tail that
    depends on P (a last, partial optimizer step of other micro-batches), and it cannot tell the dataset the epoch
    that keys the augmentation. Has no `generator` attribute on purpose: Accelerate then leaves the RNG alone."""

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
    """A split's images, as every kind gives them to the loaders: `len()`, the first n (`prefix`), their side
    `image_size` (square S x S), the loader worker processes per process that read and decode them (`workers`; 0:
    the main process indexes them), a batch of them by index (`read`, which LoaderDataset calls for every kind), the
    training order (`sampler`), the per-channel mean and std of the images (`channel_stats`),
    the move to the GPU of --data-on-device (`to`: decoded tensors only), and two facts the loaders check:
    `on_device` (the images are on the GPU already) and `crops_whole` (the random-resized crop of --augment
    resized-crop is cut from each whole image as it is decoded)."""

    image_size: int
    workers: int = 0
    on_device: bool = False
    crops_whole: bool = False

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def prefix(self, n: int) -> Images:
        """The first n images (--train-subset, --eval-subset); a source's rows are shuffled, so a prefix is
        class-balanced."""

    @abc.abstractmethod
    def read(self, indices: np.ndarray, key: tuple[int, int] | None) -> tuple[torch.Tensor, bool]:
        """The images at `indices` as one uint8 (B, S, S, 3) batch, and whether they come cropped and flipped
        already: `key` (seed, epoch) keys a training batch's crops where the kind cuts them as it decodes (None:
        evaluation, or no augmentation)."""

    @abc.abstractmethod
    def channel_stats(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The per-channel mean and std, in [0, 1], that the inputs are normalised with (when load_data gives none)."""

    def sampler(self, dataset: LoaderDataset, train: bool, seed: int, step_images: int, micro: int,
                processes: int) -> KeyedSampler | None:
        """The training order (evaluation: None, every image in order): EpochSampler unless the kind plans its own
        (a stream plans what each process and loader worker reads)."""
        return EpochSampler(dataset, seed, step_images) if train else None

    def to(self, device: torch.device) -> Images:
        raise UserError("--data-on-device keeps decoded images on the GPU; these are decoded by batch in the loader's "
                        "workers (--decode workers or stream, or a Dataset from load_data) and cannot stay there.")


class TensorImages(Images):
    """Decoded uint8 images (N, 3, S, S) in memory (a view of NHWC memory is fine, memory-mapped too), indexed by one
    tensor index per batch in the main process. `stats`: their per-channel mean and std when
    already known (the decode cache keeps them), else computed when asked."""

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
        # Measured on the 2-core CPU, 128 uint8 images: index_select copies whole rows: 8 us; advanced indexing
        # (images[idx]) goes element by element: 2.3 ms. On the NHWC view the batch stays NHWC; on the channels-last
        # 4-D tensor itself index_select returns NCHW (a transposing copy, 8x slower).
        idx = torch.from_numpy(indices).to(self.tensor.device, non_blocking=True)
        return self.tensor.permute(0, 2, 3, 1).index_select(0, idx), False

    def channel_stats(self):
        return self.stats or channel_stats(self.tensor)

    def to(self, device: torch.device) -> TensorImages:
        return TensorImages(self.tensor.to(device), self.stats)


def as_images(images: Images | torch.Tensor) -> Images:
    """A split's images as the loaders take them: a kind of `Images` as it is; a bare uint8 (N, 3, S, S) tensor (from
    a script that calls the loaders without checked_data, as train_minimal.py does) as TensorImages."""
    return images if isinstance(images, Images) else TensorImages(images)


STATS_IMAGES = 512  # training images the per-channel mean and std are estimated from (the first, decoded at S)


class EncodedImages(Images):
    """A split's encoded images at --image-size S: where the cached path holds an (N, 3, S, S) uint8 tensor. The
    view of each image: `recipe` None: resized to S x S as the cache does (the small-image crops then run on the
    device, as there); a CropRecipe: the random-resized crop in training, resize and centre crop in evaluation.
    `rows`: a table's or a stream's (utils/data/sources.py's EncodedRows), which also gives the training order.
    `reduce`: JPEGs decoded at the scale each view needs (utils/data/pixels.py's decoded); False: --full-decode.
    `device`: the batch's JPEGs decoded there, whole, by the process that reads it (--decode gpu: 'cuda', `workers`
    0; utils/data/pixels.py's device_views); None: by Pillow, in the loader's workers."""

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
        """The batch decoded here (in a DataLoader worker; with `device`, in the process that reads it) into one (B,
        S, S, 3) uint8 array: with the crop recipe and a training `key`, each image's keyed random-resized crop and
        flip cut as it is decoded (cropped: True), else its evaluation view (or the cache's resize, the small-image
        crops then drawn for the device)."""
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
