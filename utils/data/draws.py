"""The keyed draws: every random choice of the data path is a hash of (seed, epoch, purpose) and the sample's index, so
any process draws the same for a sample at any process and worker count and after a resume. A leaf: it imports nothing
of the project."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays: a counter-based hash (the draw for key k from k alone)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


ERASING, FORWARD, AUTO_AUGMENT = 4, 5, 6  # key_stream's purposes: random erasing; the model's own randomness;
# the per-image policies (utils/data/transform.py)


def key_stream(seed: int, epoch: int, purpose: int) -> np.ndarray:
    """A (1,) uint64 key of (seed, epoch, purpose): 0 the shuffle, 1 augmentation, 2 mixing, 3 resized crops; later
    purposes (ERASING, FORWARD, AUTO_AUGMENT) hash purpose 0's key again with their number."""
    if purpose > 3:
        return splitmix64(key_stream(seed, epoch, 0) ^ np.uint64(purpose))
    return splitmix64(np.array([(seed % 2**32) << 32 | (epoch % 2**30) << 2 | purpose], dtype=np.uint64))


def crop_padding(size: int) -> int:
    """The zero padding of the random crop: 4 pixels at 32 x 32, in proportion at other sizes."""
    return max(1, round(size / 8))


def augment_draws(seed: int, epoch: int, indices, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each training sample's crop and flip from (seed, epoch, sample index): (the batch positions to mirror, each
    image's crop offset into the (2 pad + 1)^2 (dy, dx)). On the host: the mirrored count sets kernel shapes, so drawing
    it on a GPU would sync."""
    h = splitmix64(np.asarray(indices).astype(np.uint64) ^ key_stream(seed, epoch, 1))
    mirrored = np.flatnonzero(h >> np.uint64(63))  # the top bit: a fair coin
    crop = (h & np.uint64(0xFFFFFFFF)) % np.uint64((2 * pad + 1) ** 2)  # the low 32 bits: uniform to 2e-8
    return torch.from_numpy(mirrored.astype(np.int64)), torch.from_numpy(crop.astype(np.int64))


@dataclass(frozen=True)
class PolicyDraws:
    """A batch's --auto-augment draws for `apply_policy`, in layers (AugMix: chain after chain): per layer the images
    sorted by op (`order`), how many drew each op (`counts`, on the host: it sets shapes) and each image's `params`;
    `weights`: AugMix's (None: the last layer is the result); `mode`: the geometric ops' interpolation."""
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
    """A training batch's draws, beside (images, labels): `flip_crop` (None when cropped already or off), `mixing`,
    `erasing`, `forward` (the seed of the model's own randomness: drop path, dropout, keyed by micro-batch) and
    `policy`. Moved and pinned with the batch (`to`, `pin_memory`); ints stay on the host (no sync)."""
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
    """Each sample's mixing from (seed, epoch, sample index) and its micro-batch: (partner in the batch, never itself;
    mixup weight 1 - lambda, else 0; cutmix box (y0, y1, x0, x1), else empty). lambda ~ Beta(alpha, alpha); the box is
    torchvision's. On the host (no sync)."""
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
    """Each sample's erasing box (y0, y1, x0, x1) with chance `prob`, else empty, and the batch's noise seed:
    torchvision's RandomErasing.get_params (10 tries in ERASE_SCALE and ERASE_RATIO), keyed by (seed, epoch, sample)."""
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
    """The seed of a micro-batch's forward from (seed, epoch, first sample), so a model's drop path and dropout draw the
    same masks on any rank of any world size and after a resume."""
    first = np.asarray(indices[:1]).astype(np.uint64)
    return int(splitmix64(first ^ key_stream(seed, epoch, FORWARD))[0] >> np.uint64(1)) if len(first) else 0
