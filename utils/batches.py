"""From decoded tensors to the model's input, one batch at a time, the same at any process count:
  1. `EpochSampler` orders each epoch by (seed, epoch) alone, cut to whole global batches;
  2. `BatchedTensorDataset.__getitems__` returns a whole batch with one tensor index, so the DataLoader that
     `accelerator.prepare` wraps (sharding, skip_first_batches, gather_for_metrics all stay Accelerate's) does no
     per-image Python work, with each image's crop and flip drawn from (seed, epoch, index) (`augment_draws`);
  3. `BatchTransform` crops, flips and normalises the whole uint8 batch on the training device, after the (4x
     smaller than float) transfer. In NHWC a row of an image is one contiguous run of bytes, so a crop is a copy of
     S rows, not of S x S pixels.
`checked_data` checks a template's load_data result (the data contract) and `build_loaders` puts the three
together for the scripts (the built-in sources: utils/decode.py, decoded once; utils/onthefly.py, whose images stay
encoded and are decoded by batch in the loader's workers, through the same sampler and draws).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from accelerate.utils import broadcast_object_list

from utils import UserError

SPLITS = ("train", "test")  # load_data's splits: "test" is the one evaluated on


def crop_padding(size: int) -> int:
    """The zero padding of the random crop: 4 pixels at 32 x 32, in proportion at other sizes."""
    return max(1, round(size / 8))


def check_one_batch(labels: torch.Tensor, batch_size: int, processes: int, accumulation: int = 1) -> None:
    """Training keeps whole global batches only: a split smaller than one would train nothing."""
    if len(labels) < batch_size * processes * accumulation:
        raise UserError(f"{len(labels)} training images do not fill one global batch of "
                        f"{batch_size * processes * accumulation} ({batch_size} on each of {processes} processes x "
                        f"{accumulation} accumulation steps).")


def take_prefix(pair: tuple[torch.Tensor, torch.Tensor], n: int | None, flag: str):
    """The first n (images, labels) of a split (all with n None); a prefix is class-balanced (rows are shuffled)."""
    images, labels = pair
    if n is not None and n > len(labels):
        raise UserError(f"{flag} {n} is larger than the split ({len(labels)} images).")
    return (images[:n], labels[:n]) if n is not None else pair


# ----------------------------------------------------------------------------------------------------
# Batched dataset and on-device augmentation
# ----------------------------------------------------------------------------------------------------
def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic): a counter-based hash, so the draw for key k is
    computed from k alone, in any order, by any process."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def key_stream(seed: int, epoch: int, purpose: int) -> np.ndarray:
    """A (1,) uint64 key of (seed, epoch, purpose): 0 the epoch's shuffle (EpochSampler's, or a stream's: its shards'
    order, utils/stream.py), 1 its augmentation, 2 its mixing, 3 its resized crops (utils/crops.py). Two bits."""
    return splitmix64(np.array([(seed % 2**32) << 32 | (epoch % 2**30) << 2 | purpose], dtype=np.uint64))


def augment_draws(seed: int, epoch: int, indices, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The crop and flip of each training sample in `indices`, a function of (seed, epoch, sample index) only: an
    image is augmented the same way whichever process draws it at whatever process count. Returns (the positions
    in the batch of the images to mirror, each image's crop offset: an index into the (2 pad + 1)^2 (dy, dx)).
    On the host, beside the sampler's indices (128 hashes in numpy: about 50 us on the 2-core CPU), because how
    many images are mirrored sets the shapes of the transform's kernels: drawn on a GPU, that count would cost a
    device sync per batch."""
    h = splitmix64(np.asarray(indices).astype(np.uint64) ^ key_stream(seed, epoch, 1))
    mirrored = np.flatnonzero(h >> np.uint64(63))  # the top bit: a fair coin
    crop = (h & np.uint64(0xFFFFFFFF)) % np.uint64((2 * pad + 1) ** 2)  # the low 32 bits: uniform to 2e-8
    return torch.from_numpy(mirrored.astype(np.int64)), torch.from_numpy(crop.astype(np.int64))


@dataclass(frozen=True)
class Mixing:
    """--mixup / --cutmix / --mix-prob: torchvision.transforms.v2's MixUp and CutMix, drawn per sample."""
    mixup: float = 0.0  # Beta(alpha, alpha) of mixup's lambda; 0: no mixup
    cutmix: float = 0.0  # of cutmix's; 0: no cutmix
    prob: float = 1.0  # the chance that a sample is mixed at all; with both on, each is then chosen with chance 1/2


def uniform01(h: np.ndarray) -> np.ndarray:
    return (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53  # the top 53 bits: uniform in [0, 1)


def mix_draws(seed: int, epoch: int, indices, size: int, mixing: Mixing):
    """Each training sample's mixing, a function of (seed, epoch, sample index) and its micro-batch only (the
    batches are the same at any process count, see EpochSampler): (partner: the position in the batch of the
    image mixed in, never its own; mixup weight: 1 - lambda of a mixup sample, else 0; box: (y0, y1, x0, x1) of a
    cutmix sample's pasted region, else empty). lambda ~ Beta(alpha, alpha) by the inverse of its CDF; the cutmix
    box is torchvision's: a centre uniform over the pixels, half-sides sqrt(1 - lambda) / 2 of the image's, clipped
    to it (the pasted area then sets the label weight). On the host, beside augment_draws (no device sync)."""
    from scipy.special import betaincinv  # imported here: only mixing runs use it

    n, hashes = len(indices), []
    h = np.asarray(indices).astype(np.uint64) ^ key_stream(seed, epoch, 2)
    for _ in range(6):  # one stream per sample, hashed on for each value it needs
        h = splitmix64(h)
        hashes.append(h)
    apply, choose, lam, offset, cy, cx = hashes
    mixed = (uniform01(apply) < mixing.prob) & (n > 1)
    cut = mixed & (mixing.cutmix > 0) & ((mixing.mixup == 0) | (uniform01(choose) < 0.5))
    alpha = np.where(cut, mixing.cutmix, mixing.mixup if mixing.mixup > 0 else 1.0)
    lam = np.where(mixed, betaincinv(alpha, alpha, uniform01(lam)), 1.0)
    partner = (np.arange(n) + 1 + (offset % np.uint64(max(n - 1, 1))).astype(np.int64)) % n
    weight = np.where(mixed & ~cut, 1.0 - lam, 0.0)
    half = (0.5 * np.sqrt(1.0 - lam) * size).astype(np.int64)  # int(r * W) in torchvision, W = H = size
    y, x = (np.floor(uniform01(c) * size).astype(np.int64) for c in (cy, cx))
    box = np.stack([np.clip(y - half, 0, size), np.clip(y + half, 0, size), np.clip(x - half, 0, size),
                    np.clip(x + half, 0, size)], axis=1) * cut[:, None]
    return torch.from_numpy(partner), torch.from_numpy(weight.astype(np.float32)), torch.from_numpy(box)


def batch_draws(dataset, host: np.ndarray, size: int, cropped: bool = False) -> tuple | None:
    """A training batch's draws for BatchTransform.train, from a dataset's augment_seed, epoch, augment, pad and
    mixing: None without augmentation; else the crop and flip (augment_draws; (None, None) when the images come
    `cropped` already, utils/onthefly.py) followed by the mixing draws (mix_draws), if any; None when that leaves
    nothing to draw."""
    if not dataset.augment:
        return None
    crops = (None, None) if cropped else augment_draws(dataset.augment_seed, dataset.epoch, host, dataset.pad)
    if dataset.mixing is None:
        return None if cropped else crops
    return crops + mix_draws(dataset.augment_seed, dataset.epoch, host, size, dataset.mixing)


class BatchedTensorDataset(torch.utils.data.Dataset):
    """Images and labels as two tensors. The DataLoader calls `__getitems__` once per batch with the
    sampler's indices, so a batch costs one tensor index instead of `batch_size` Python calls.
    A training set (`augment_seed` given) returns (images, labels, draws): each sample's crop and flip for the
    current `epoch` (set by `EpochSampler`), from `augment_draws`, and with `mixing` its mixing (`mix_draws`); draws
    is None when `augment` is off."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment_seed: int | None = None,
                 augment: bool = True, pad: int = 4, mixing: Mixing | None = None):
        assert len(images) == len(labels)
        # NHWC rows: a batch is then one row copy per image, and arrives in the layout the transform reads.
        self.images, self.labels = images.contiguous(memory_format=torch.channels_last), labels
        self.augment_seed, self.augment, self.pad, self.epoch = augment_seed, augment, pad, 0
        self.mixing = mixing

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]

    def __getitems__(self, indices: list[int]):
        # Measured on the 2-core CPU, 128 uint8 images:
        # - index_select copies whole rows: 8 us; advanced indexing (images[idx]) goes element by element: 2.3 ms.
        # - on the (N, 32, 32, 3) view the batch stays NHWC; on the channels-last 4-D tensor itself index_select
        #   returns NCHW (a transposing copy, 8x slower).
        # - the indices through numpy: 3 us; torch.as_tensor(list) 14 us.
        # non_blocking: with the data on a GPU a blocking copy would wait for all queued GPU work every batch (a
        # copy from pageable memory is staged before the call returns, so the host array may go away at once).
        host = np.asarray(indices, dtype=np.int64)  # once, for the batch and its draws
        idx = torch.from_numpy(host).to(self.labels.device, non_blocking=True)
        nhwc = self.images.permute(0, 2, 3, 1).index_select(0, idx)
        batch = nhwc.permute(0, 3, 1, 2), self.labels.index_select(0, idx)
        if self.augment_seed is None:
            return batch
        return (*batch, batch_draws(self, host, self.images.shape[-1]))


class EpochSampler(torch.utils.data.Sampler):
    """The training order: a permutation of the samples per epoch, a function of (seed, epoch) only, cut to whole
    optimizer steps of `step_images` (the global batch). Accelerate's prepare() splits its micro-batches over the
    processes (micro-batch k to process k mod P), so optimizer step s takes the same micro-batches at any process
    count P with P x accumulation fixed.
    Written by hand because Accelerate's seedable sampler keeps the whole epoch and its shards then drop a tail that
    depends on P (a last, partial optimizer step of other micro-batches), and it cannot tell the dataset the epoch
    that keys the augmentation. Has no `generator` attribute on purpose: Accelerate then leaves the RNG alone."""

    def __init__(self, dataset: BatchedTensorDataset, seed: int, step_images: int):
        self.dataset, self.seed, self.step_images, self.epoch = dataset, seed, step_images, 0

    def set_epoch(self, epoch: int) -> None:  # called by the prepared loader's set_epoch and at each iteration
        self.epoch = self.dataset.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset) // self.step_images * self.step_images

    def __iter__(self):
        order = torch.Generator().manual_seed(int(key_stream(self.seed, self.epoch, 0)[0]))
        return iter(torch.randperm(len(self.dataset), generator=order)[:len(self)].tolist())


def keep_batch(batch):
    """collate_fn for BatchedTensorDataset: `__getitems__` already returned the collated batch."""
    return batch


def make_loader(images, labels, batch_size: int, train: bool, seed: int = 0, augment: bool = False, pad: int = 4,
                global_batch: int | None = None, mixing: Mixing | None = None, processes: int = 1
                ) -> torch.utils.data.DataLoader:
    """A plain DataLoader for `accelerator.prepare`. Training: `EpochSampler` (reshuffled per epoch from the seed,
    whole global batches only; global_batch unset: batch_size) and batches (images, labels, draws); evaluation keeps
    every image in order, as (images, labels). Streamed shards (utils/stream.py) bring their own sampler, which
    plans what each of the `processes` and its loader workers reads."""
    encoded = hasattr(images, "dataset")  # utils.onthefly.EncodedImages: decoded by batch in worker processes
    dataset = (images.dataset(labels, train, seed, augment, pad, mixing) if encoded else
               BatchedTensorDataset(images, labels, seed if train else None, augment, pad, mixing))
    step_images = global_batch or batch_size
    if encoded and hasattr(images.rows, "sampler"):  # utils.stream.StreamRows
        sampler = images.rows.sampler(dataset, train, seed, step_images, batch_size, processes)
    else:
        sampler = EpochSampler(dataset, seed, step_images) if train else None
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=train,
        collate_fn=keep_batch,
        pin_memory=torch.cuda.is_available() and (encoded or images.device.type == "cpu"),  # asynchronous copies
        # not persistent: each epoch's workers start after set_epoch, with the epoch that keys their draws
        num_workers=images.workers if encoded else 0,
    )


def rebatched(loader: torch.utils.data.DataLoader, batch_size: int) -> torch.utils.data.DataLoader:
    """make_loader's DataLoader (before prepare()) again, over the same dataset and sampler, in batches of
    batch_size: the same images in the same order, cut finer (utils.guard.MemoryGuard)."""
    return torch.utils.data.DataLoader(loader.dataset, batch_size=batch_size, sampler=loader.sampler,
                                       drop_last=loader.drop_last, collate_fn=loader.collate_fn,
                                       pin_memory=loader.pin_memory, num_workers=loader.num_workers)


class BatchTransform:
    """uint8 (B, 3, S, S) on the device -> normalised float batch (the data's per-channel mean and std, in [0, 1]);
    given a training batch's draws (`augment_draws`), first a crop of each image (zero padding of `pad` pixels:
    crop_padding(S)) and its horizontal flip. Works in NHWC (channels-last) memory, which the loader delivers;
    --no-channels-last gets NCHW at the end. Holds no random state: the draws come with the batch. `num_classes`:
    the width of the soft targets under mixing."""

    def __init__(self, device: torch.device, channels_last: bool, *, mean: tuple[float, ...], std: tuple[float, ...],
                 pad: int = 4, num_classes: int | None = None):
        self.channels_last, self.pad, self.num_classes = channels_last, pad, num_classes
        # (x - mean) / std as one fused x * scale + shift over rows of W pixels x 3 channels: with a
        # per-channel (3,) operand the innermost loop would be 3 long (5x slower on CPU than this).
        std, mean = torch.tensor(std, device=device) * 255, torch.tensor(mean, device=device) * 255
        self.scale, self.shift = 1 / std, -mean / std
        self.row_scale_shift = {}  # width -> (scale, shift) tiled along a row
        self.canvas = None  # (2B, H + 2 pad, W + 2 pad, 3) uint8 with a zero border, kept between batches

    @classmethod
    def for_data(cls, data: dict, device: torch.device, channels_last: bool) -> BatchTransform:
        """The transform for `checked_data`'s dict: its mean and std, its image size's crop padding, its classes."""
        return cls(device, channels_last, mean=data["mean"], std=data["std"], pad=crop_padding(data["image_size"]),
                   num_classes=len(data["classes"]))

    def __call__(self, images: torch.Tensor, draws: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if images.dtype != torch.uint8:  # float images would be divided by 255 x std: training on near-zero inputs
            raise UserError(f"the loader gave {str(images.dtype).removeprefix('torch.')} images; the transform takes "
                            f"uint8 images (0-255), as utils/batches.py's loaders give them (docs/customizing.md).")
        if draws is not None:
            images = self.crop_and_flip(images, draws)
        n, c, h, w = images.shape
        rows = images.permute(0, 2, 3, 1).reshape(n * h, w * c)  # a view for channels-last input
        if w not in self.row_scale_shift:
            self.row_scale_shift[w] = self.scale.repeat(w), self.shift.repeat(w)
        scale, shift = self.row_scale_shift[w]
        x = torch.addcmul(shift, rows, scale).view(n, h, w, c).permute(0, 3, 1, 2)  # float, channels-last
        return x if self.channels_last else x.contiguous()

    def train(self, images: torch.Tensor, labels: torch.Tensor, draws: tuple | None = None):
        """A training batch -> (the model's input, the loss's targets): the labels, or with mixing draws
        (`mix_draws`) class probabilities (num_classes wide), each image's label and its partner's weighted by the
        share of the partner in the mixed image. Mixed after the crop, flip and normalisation, as torchvision's
        MixUp and CutMix mix a batch of augmented tensors."""
        x = self(images, draws[:2] if draws is not None and draws[0] is not None else None)  # None: cropped
        if draws is None or len(draws) == 2:
            return x, labels
        partner, weight, box = draws[2:]
        n, c, h, w = x.shape
        rows, cols = torch.arange(h, device=x.device).view(1, h, 1), torch.arange(w, device=x.device).view(1, 1, w)
        y0, y1, x0, x1 = (box[:, i].view(n, 1, 1) for i in range(4))
        pasted = (rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1)  # cutmix: the partner's pixels there
        nhwc = x.permute(0, 2, 3, 1)  # a view of channels-last memory: index_select keeps that layout
        theirs = nhwc.index_select(0, partner)
        # each value's share of the partner: 1 - lambda (mixup), 1 inside a cutmix box, else 0; lerp gives either
        # image exactly at 0 and 1. Spelled out to the full shape: lerp's broadcast (and torch.where's) ran 2x slower.
        share = (weight.view(n, 1, 1) + pasted).unsqueeze(3).expand(n, h, w, c).contiguous()
        mixed = torch.lerp(nhwc, theirs, share).permute(0, 3, 1, 2)
        if not self.channels_last:
            mixed = mixed.contiguous()
        own = F.one_hot(labels, self.num_classes).float()
        partner_share = weight + (box[:, 1] - box[:, 0]) * (box[:, 3] - box[:, 2]) / (h * w)
        return mixed, torch.lerp(own, own.index_select(0, partner), partner_share.view(n, 1))

    def crop_and_flip(self, images: torch.Tensor, draws: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Each image: its crop at the drawn offset of its zero-padded self, mirrored if drawn so.

        Written with plain tensor ops because torchvision's v2 transforms draw one crop for the whole batch.
        1. The batch goes into the interior of a canvas whose zero border is written once. The images to
           mirror go mirrored into the canvas' second half: mirroring is the expensive step in NHWC (3-byte
           pixels), so only those images pay for it.
        2. ONE index_select of B x H row windows (each W x 3 contiguous bytes of the canvas) crops all images.
        The result is a view of a buffer that the next call overwrites (`__call__` reads it at once): fresh
        buffers per batch cost page faults on CPU (reusing this one and the mirror's took P2 from 48x to 52x).
        draws: (mirrored, crop) from `augment_draws`, on the images' device.
        """
        n, c, h, w = images.shape
        p, dev = self.pad, images.device
        if self.canvas is None or self.canvas.shape != (2 * n, h + 2 * p, w + 2 * p, c) or self.canvas.device != dev:
            self._make_canvas(n, c, h, w, dev, images.dtype)
        nhwc = images.permute(0, 2, 3, 1)
        self.interior[:n].copy_(nhwc)
        mirrored, crop = draws
        m = len(mirrored)
        self.interior[n:n + m].copy_(torch.index_select(nhwc, 0, mirrored, out=self.scratch[:m]).flip(2))
        start = self.image_start[:n].index_copy(0, mirrored, self.image_start[n:n + m])  # where image i now is
        rows = self.crop_rows.index_select(0, crop).add_(start.view(n, 1))  # (n, h): first byte of each cropped row
        crops = torch.index_select(self.windows, 0, rows.view(-1), out=self.crops)
        return crops.view(n, h, w, c).permute(0, 3, 1, 2)

    def _make_canvas(self, n: int, c: int, h: int, w: int, dev: torch.device, dtype: torch.dtype) -> None:
        p = self.pad
        H, W = h + 2 * p, w + 2 * p
        self.canvas = torch.zeros(2 * n, H, W, c, dtype=dtype, device=dev)
        self.interior = self.canvas[:, p:p + h, p:p + w]
        self.windows = self.canvas.view(-1).unfold(0, w * c, 1)  # a view: window k = bytes k .. k + w*c - 1
        self.scratch = torch.empty(n, h, w, c, dtype=dtype, device=dev)
        self.crops = torch.empty(n * h, w * c, dtype=dtype, device=dev)
        self.image_start = torch.arange(2 * n, device=dev) * (H * W * c)  # flat offsets in the canvas, in bytes
        shifts = torch.arange(2 * p + 1, device=dev)
        crop_offset = (shifts.view(-1, 1) * (W * c) + shifts.view(1, -1) * c).view(-1, 1)  # every (dy, dx)
        self.crop_rows = crop_offset + torch.arange(h, device=dev) * (W * c)  # ((2p+1)^2, h): where each row starts


# ----------------------------------------------------------------------------------------------------
# The scripts' loaders
# ----------------------------------------------------------------------------------------------------
def checked_data(data: dict, where: str = "load_data") -> dict:
    """A template's load_data(cfg) result, checked and put in the form the loaders take. The contract (the edit point
    of docs/customizing.md): 'train' and 'test', each a pair (images, labels): uint8 images N x H x W x 3 or
    N x 3 x H x W, square, both splits the same size, as numpy arrays (memory-mapped is fine) or tensors; integer
    labels 0 .. C-1; and 'classes', the C class names. Optional: 'mean' and 'std' (per channel, in [0, 1]; computed
    from the training images when absent), 'dataset' (a JSON-able description, for summary.json), and 'eval_crop'
    and 'interpolation' (the built-in loader's: the test images are resized to S / eval_crop on their shorter side
    with that filter, then centre-cropped to S; for preprocessor_config.json). Returns them
    with the images as (N, 3, S, S) uint8 tensor views (no copy of NHWC input), int64 labels and 'image_size' S. A
    broken contract: one line naming `where` and what is wrong."""
    if not isinstance(data, dict) or not {"train", "test", "classes"} <= data.keys():
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise UserError(f"{where} must return a dict with 'train', 'test' and 'classes' (got {got}).")
    classes = tuple(str(c) for c in data["classes"])
    out = {"classes": classes, "dataset": data.get("dataset", {"source": where})}
    for split in SPLITS:
        try:
            images, labels = data[split]
        except (TypeError, ValueError):
            raise UserError(f"{where}: data[{split!r}] must be a pair (images, labels).") from None
        images = images if hasattr(images, "dataset") else _images(images, f"{where}: the {split} images")
        out[split] = images, _labels(labels, len(classes), where, split)
        if len(out[split][0]) != len(out[split][1]):
            raise UserError(f"{where}: the {split} split has {len(out[split][0])} images but {len(out[split][1])} "
                            f"labels.")
    size, test_size = (getattr(im, "image_size", None) or im.shape[-1] for im in (out["train"][0], out["test"][0]))
    if size != test_size:
        raise UserError(f"{where}: the train images are {size} px and the test images {test_size} px; give both "
                        f"splits one size.")
    if "mean" in data and "std" in data:
        out["mean"], out["std"] = tuple(map(float, data["mean"])), tuple(map(float, data["std"]))
    else:
        out["mean"], out["std"] = channel_stats(out["train"][0])
    view = {k: data[k] for k in ("eval_crop", "interpolation") if k in data}  # the built-in loader's resized crops
    return out | {"image_size": int(size)} | view


def data_facts(data: dict) -> dict:
    """For summary.json: where the data came from, its classes and what the model takes (image size; the per-channel
    mean and std the inputs are normalised with; the evaluation's resize and crop, when resized-crop)."""
    return {"dataset": data["dataset"], "classes": list(data["classes"]), "image_size": data["image_size"],
            "image_mean": [float(m) for m in data["mean"]], "image_std": [float(s) for s in data["std"]],
            **{k: data[k] for k in ("eval_crop", "interpolation") if k in data}}


def _images(images, what: str) -> torch.Tensor:
    """uint8 N x H x W x 3 or N x 3 x H x W (numpy or torch) -> an (N, 3, S, S) tensor, a view where possible."""
    if isinstance(images, np.ndarray):
        with warnings.catch_warnings():  # a read-only memory map: torch warns that writing would be undefined
            warnings.simplefilter("ignore", UserWarning)
            images = torch.from_numpy(images)
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4:
        kind = (f"{str(images.dtype).removeprefix('torch.')} {tuple(images.shape)}" if isinstance(images, torch.Tensor)
                else type(images).__name__)
        raise UserError(f"{what} must be uint8 (0-255), N x H x W x 3 or N x 3 x H x W (got {kind}).")
    if images.shape[1] != 3 and images.shape[3] == 3:
        images = images.permute(0, 3, 1, 2)  # NHWC -> an NCHW view of channels-last memory
    if images.shape[1] != 3 or images.shape[2] != images.shape[3]:
        raise UserError(f"{what} must be square with 3 channels (got {tuple(images.shape)}).")
    return images


def _labels(labels, classes: int, where: str, split: str) -> torch.Tensor:
    labels = torch.as_tensor(np.asarray(labels) if not isinstance(labels, torch.Tensor) else labels)
    if labels.dim() != 1 or labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise UserError(f"{where}: the {split} labels must be integers, one per image (got "
                        f"{str(labels.dtype).removeprefix('torch.')} "
                        f"{tuple(labels.shape)}).")
    labels = labels.to(torch.int64)
    bad = torch.nonzero((labels < 0) | (labels >= classes)).flatten()
    if len(bad):
        raise UserError(f"{where}: the {split} split has label {int(labels[bad[0]])} at row {int(bad[0])}; with "
                        f"{classes} classes, labels are 0-{classes - 1}.")
    return labels


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


def build_loaders(data: dict, cfg, accelerator, plan):
    """Training and evaluation DataLoaders over checked_data's splits; prepare() then shards them and moves batches
    to the device. The training order and augmentation are keyed by --seed, the epoch and the sample, and every
    epoch is whole optimizer steps of the plan's global batch (utils.plan.BatchPlan). cfg: the data group of a
    script's Config (train_subset, eval_subset, data_on_device, seed, augment, mixup, cutmix, mix_prob)."""
    train_split = take_prefix(data["train"], cfg.train_subset, "--train-subset")
    eval_split = take_prefix(data["test"], cfg.eval_subset, "--eval-subset")
    check_one_batch(train_split[1], plan.micro, accelerator.num_processes, plan.accumulation)
    if cfg.data_on_device and hasattr(train_split[0], "dataset"):
        raise UserError("--data-on-device keeps decoded images on the GPU; images decoded on the fly (--decode "
                        "workers) cannot stay there.")
    if cfg.data_on_device:  # GPU-resident: Accelerate's move to the device becomes a no-op
        train_split, eval_split = ([t.to(accelerator.device) for t in split] for split in (train_split, eval_split))
    if cfg.augment == "resized-crop" and not hasattr(train_split[0], "dataset"):
        raise UserError("--augment resized-crop crops whole images as they are decoded: load_data must return images "
                        "decoded on the fly (utils.onthefly.load_encoded), not decoded tensors.")
    if hasattr(train_split[0], "workers") and accelerator.num_processes > 1:  # main's count of loader workers on
        # every process (machines may have other core counts): a stream's plan is laid out by it
        train_split[0].workers = eval_split[0].workers = broadcast_object_list([train_split[0].workers])[0]
    mixing = Mixing(cfg.mixup, cfg.cutmix, cfg.mix_prob) if cfg.mixup or cfg.cutmix else None
    train = make_loader(*train_split, plan.micro, train=True, seed=cfg.seed, augment=cfg.augment != "none",
                        pad=crop_padding(data["image_size"]), global_batch=plan.global_batch, mixing=mixing,
                        processes=plan.processes)
    if hasattr(train.sampler, "save_with"):  # a stream's: the layout its epoch was planned in, in each checkpoint
        train.sampler.save_with(accelerator)
    return train, make_loader(*eval_split, plan.micro, train=False, processes=plan.processes)
