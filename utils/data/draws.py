"""The keyed draws: every random choice of the data path (the epoch's order, each image's crop, flip and mixing,
a resized crop's box, a stream's shard order) is a hash of (seed, epoch, purpose) and the sample's index, so any
process draws the same for a sample at any process count, worker count and after a resume. A leaf: it imports
nothing of the project."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic): a counter-based hash, so the draw for key k is
    computed from k alone, in any order, by any process."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


ERASING, FORWARD, AUTO_AUGMENT = 4, 5, 6  # key_stream's purposes: random erasing; the model's own randomness;
# the per-image policies (utils/data/transform.py)


def key_stream(seed: int, epoch: int, purpose: int) -> np.ndarray:
    """A (1,) uint64 key of (seed, epoch, purpose): 0 the epoch's shuffle (EpochSampler's, or a stream's: its shards'
    order, utils/data/stream.py), 1 its augmentation, 2 its mixing, 3 its resized crops (utils/data/pixels.py), each
    in two bits of the hashed word; purposes past them (ERASING, FORWARD, AUTO_AUGMENT) hash purpose 0's key again
    with their number."""
    if purpose > 3:
        return splitmix64(key_stream(seed, epoch, 0) ^ np.uint64(purpose))
    return splitmix64(np.array([(seed % 2**32) << 32 | (epoch % 2**30) << 2 | purpose], dtype=np.uint64))


def crop_padding(size: int) -> int:
    """The zero padding of the random crop: 4 pixels at 32 x 32, in proportion at other sizes."""
    return max(1, round(size / 8))


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
class PolicyDraws:
    """A batch's --auto-augment draws, as utils/data/transform.py's `apply_policy` takes them. The ops run in layers
    (AugMix: chain after chain, each `depth` layers); in layer l, `order[l]` lists the batch's images sorted by the
    op they drew and `counts[l]` (on the host: it sets the shapes) how many drew each op of policies.OPS;
    `params[l]` is each sorted image's parameters (the inverse affine matrix of a geometric op, its factor, bit mask
    or threshold). `weights`: AugMix's (n, 1 + chains) weights of the image and of each chain (None: the last
    layer's images are the result). `mode`: the geometric ops' interpolation (torchvision's: nearest; bilinear for
    AugMix)."""
    order: torch.Tensor
    params: torch.Tensor
    counts: tuple[tuple[int, ...], ...]
    weights: torch.Tensor | None
    depth: int
    mode: str

    def moved(self, move) -> PolicyDraws:
        return PolicyDraws(move(self.order), move(self.params), self.counts,
                           None if self.weights is None else move(self.weights), self.depth, self.mode)


@dataclass(frozen=True)
class Draws:
    """A training batch's draws, as its loader gives them beside (images, labels) and BatchTransform.train takes
    them: `flip_crop`, augment_draws' (the positions in the batch to mirror, each image's crop offset), None when
    the images come cropped and flipped already (--augment resized-crop) or augmentation is off; `mixing`,
    mix_draws' (partner, weight, box) under --mixup / --cutmix, else None; `erasing`, erase_draws' (box, noise
    seed) under --random-erase, else None; `forward`, forward_seed's: what the training loop seeds torch's
    generators with before the model's forward, so that the model's own randomness (drop path, dropout) is keyed by
    the micro-batch; `policy`, --auto-augment's PolicyDraws (None: off, or applied in the loader's workers already).
    Moved to the device with its batch (`to`: Accelerate's send_to_device calls it) and pinned with it (`pin_memory`:
    the DataLoader's pinning calls it); the seeds and counts, ints, stay on the host (no sync)."""
    flip_crop: tuple[torch.Tensor, torch.Tensor] | None = None
    mixing: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    erasing: tuple[torch.Tensor, int] | None = None
    forward: int = 0
    policy: PolicyDraws | None = None

    def to(self, device, non_blocking: bool = False) -> Draws:
        return self._each(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Draws:
        return self._each(torch.Tensor.pin_memory)

    def _each(self, move) -> Draws:
        moved = (None if part is None else tuple(map(move, part)) for part in (self.flip_crop, self.mixing))
        erasing = None if self.erasing is None else (move(self.erasing[0]), self.erasing[1])  # (box, noise seed)
        return Draws(*moved, erasing, self.forward, None if self.policy is None else self.policy.moved(move))


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


ERASE_TRIES, ERASE_SCALE, ERASE_RATIO = 10, (0.02, 0.33), (0.3, 3.3)  # torchvision's RandomErasing defaults


def erase_draws(seed: int, epoch: int, indices, size: int, prob: float) -> tuple[torch.Tensor, int]:
    """Each training sample's random erasing (--random-erase), a function of (seed, epoch, sample index): with chance
    `prob`, a box (y0, y1, x0, x1) of its S x S image, else an empty one; and the seed of the batch's noise, from its
    first sample (the micro-batches are the same at any process count, see EpochSampler). torchvision's
    RandomErasing.get_params: up to 10 tries of an area share uniform in ERASE_SCALE and an aspect ratio log-uniform
    in ERASE_RATIO, the first box strictly inside the image taken at a uniform position; none fits: not erased."""
    n = len(indices)
    h = np.asarray(indices).astype(np.uint64) ^ key_stream(seed, epoch, ERASING)
    hashes = []
    for _ in range(1 + 4 * ERASE_TRIES):  # whether to erase; per try: area share, log aspect ratio, top, left
        h = splitmix64(h)
        hashes.append(h)
    apply, log_lo, log_hi = uniform01(hashes[0]) < prob, np.log(ERASE_RATIO[0]), np.log(ERASE_RATIO[1])
    boxes, found = np.zeros((n, 4), dtype=np.int64), ~apply
    for t in range(ERASE_TRIES):
        share, aspect, top, left = (uniform01(hashes[1 + 4 * t + k]) for k in range(4))
        area = size * size * (ERASE_SCALE[0] + share * (ERASE_SCALE[1] - ERASE_SCALE[0]))
        ratio = np.exp(log_lo + aspect * (log_hi - log_lo))
        eh, ew = (np.round(np.sqrt(area * r)).astype(np.int64) for r in (ratio, 1 / ratio))
        fits = ~found & (eh < size) & (ew < size)
        y0, x0 = (np.floor(u * (size - e + 1)).astype(np.int64) for u, e in ((top, eh), (left, ew)))
        boxes[fits] = np.stack([y0, y0 + eh, x0, x0 + ew], axis=1)[fits]
        found |= fits
    return torch.from_numpy(boxes), int(hashes[-1][0] >> np.uint64(1)) if n else 0


def forward_seed(seed: int, epoch: int, indices) -> int:
    """The seed of a training micro-batch's forward, from (seed, epoch) and its first sample: the micro-batches are
    the same at any process count (EpochSampler), so a model that draws masks from torch's generator (timm's and
    transformers' drop path, torchvision's stochastic depth, dropout) draws the same ones for a micro-batch on any
    rank of any world size, and again after a resume."""
    first = np.asarray(indices[:1]).astype(np.uint64)
    return int(splitmix64(first ^ key_stream(seed, epoch, FORWARD))[0] >> np.uint64(1)) if len(first) else 0
