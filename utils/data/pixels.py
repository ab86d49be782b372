"""Pixel work, all of it: an encoded image opened (`open_image`, lazily: its header first) and turned into its
RGB view with one line for a broken one (`row_pixels`); the views: the cache's and the small-image path's resize to
S x S (`square_pixels`), and the crop recipe for natural images (--augment resized-crop), each draw keyed by (seed,
epoch, sample) as the small-image crops of utils/data/draws.py are, so a sample is cropped the same way by whichever
process and worker decodes it, at any process count, before and after a resume:
  training    a random-resized crop (area a uniform share of the image in --crop-scale, aspect ratio log-uniform in
              --crop-ratio; torchvision's RandomResizedCrop sampling, its 10 tries and its centre-crop fallback),
              resized (--interpolation, antialiased) to S x S, and a horizontal flip with chance 1/2 (`train_view`);
  evaluation  the image resized so its shorter side is int(S / --eval-crop), then its centre S x S (`eval_view`;
              `evaluation_view` picks the view of a run, which predict.py gives new images too).
The draws are here; the pixels are torchvision.transforms.v2.functional's on the PIL image (the same operations as
torchvision's RandomResizedCrop, RandomHorizontalFlip, Resize and CenterCrop), in the loader's workers
(utils/data/encoded.py). Written by hand only because torchvision's transforms draw from a global RNG, not from a key.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from functools import partial

import numpy as np

from utils import UserError, first_line
from utils.data.draws import key_stream, splitmix64, uniform01

TRIES = 10  # torchvision's RandomResizedCrop: tries before its fallback


@dataclass(frozen=True)
class CropRecipe:
    """--crop-scale, --crop-ratio, --eval-crop and --interpolation (the size: --image-size)."""
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    eval_crop: float = 0.875
    interpolation: str = "bilinear"  # or "bicubic": torchvision's InterpolationMode by name

    def resize(self, im, size):  # torchvision's resize of a PIL image (antialiased, as PIL always is)
        import torchvision.transforms.v2.functional as TF

        return TF.resize(im, size, interpolation=TF.InterpolationMode(self.interpolation), antialias=True)


def crop_recipe(cfg) -> CropRecipe | None:
    """The crop recipe of a script's data flags (its DataConfig group): --augment resized-crop's, with --crop-scale,
    --crop-ratio, --eval-crop and --interpolation (unset: the defaults); None for the other --augment choices."""
    if cfg.augment != "resized-crop":
        return None
    return CropRecipe(cfg.crop_scale, cfg.crop_ratio, cfg.eval_crop or CropRecipe.eval_crop,
                      cfg.interpolation or CropRecipe.interpolation)


def resized_crop_draws(seed: int, epoch: int, indices, sizes, recipe: CropRecipe) -> tuple[np.ndarray, np.ndarray]:
    """For each sample in `indices` with image size (width, height) in `sizes`: its crop box (top, left, height,
    width) in the image and whether it is mirrored, a function of (seed, epoch, sample index, image size) only."""
    n = len(indices)
    width, height = (np.array([s[k] for s in sizes], dtype=np.float64) for k in (0, 1))
    h = np.asarray(indices, dtype=np.uint64) ^ key_stream(seed, epoch, 3)
    draws = []
    for _ in range(4 * TRIES + 1):  # per try: area share, log aspect ratio, top, left; then the flip
        h = splitmix64(h)
        draws.append(h)
    area, log_lo, log_hi = width * height, math.log(recipe.ratio[0]), math.log(recipe.ratio[1])
    boxes, found = np.zeros((n, 4), dtype=np.int64), np.zeros(n, dtype=bool)
    for t in range(TRIES):
        share = recipe.scale[0] + uniform01(draws[4 * t]) * (recipe.scale[1] - recipe.scale[0])
        aspect = np.exp(log_lo + uniform01(draws[4 * t + 1]) * (log_hi - log_lo))
        w = np.round(np.sqrt(area * share * aspect)).astype(np.int64)
        hh = np.round(np.sqrt(area * share / aspect)).astype(np.int64)
        fits = ~found & (w > 0) & (w <= width) & (hh > 0) & (hh <= height)
        top = np.floor(uniform01(draws[4 * t + 2]) * (height - hh + 1)).astype(np.int64)
        left = np.floor(uniform01(draws[4 * t + 3]) * (width - w + 1)).astype(np.int64)
        boxes[fits] = np.stack([top, left, hh, w], axis=1)[fits]
        found |= fits
    for k in np.flatnonzero(~found):  # torchvision's fallback: the centre crop at the nearest allowed aspect ratio
        boxes[k] = centre_fallback(int(width[k]), int(height[k]), recipe.ratio)
    return boxes, (draws[-1] >> np.uint64(63)).astype(bool)


def centre_fallback(width: int, height: int, ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    if width / height < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif width / height > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def train_view(im, box, mirrored: bool, size: int, recipe: CropRecipe) -> np.ndarray:
    """The training crop of an RGB PIL image: box (top, left, height, width) resized to size x size, mirrored if
    drawn so; (S, S, 3) uint8."""
    import torchvision.transforms.v2.functional as TF

    im = recipe.resize(TF.crop(im, *map(int, box)), [size, size])
    return np.asarray(TF.horizontal_flip(im) if mirrored else im)


def eval_view(im, size: int, recipe: CropRecipe) -> np.ndarray:
    """The evaluation view of an RGB PIL image: shorter side resized to int(S / eval_crop), then the centre S x S
    (torchvision's centre crop: an odd margin puts the extra pixel before the crop, as timm's transforms do;
    transformers' image processors put it after)."""
    import torchvision.transforms.v2.functional as TF

    return np.asarray(TF.center_crop(recipe.resize(im, [int(size / recipe.eval_crop)]), [size, size]))


def square_pixels(im, size: int) -> np.ndarray:
    """An RGB PIL image as (S, S, 3) uint8, resized (bicubic) to S x S unless it is that size: how every image enters
    the cache, and the on-the-fly path's images without --augment resized-crop (utils/data/encoded.py), bit for bit."""
    from PIL import Image

    if im.size != (size, size):
        im = im.resize((size, size), Image.Resampling.BICUBIC)
    return np.asarray(im)


def open_image(source, split: str, where: str):
    """The PIL image of a row (lazy: only its header is read until the pixels are asked for); one line if broken."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
    except (UnidentifiedImageError, OSError, TypeError) as e:
        raise UserError(f"the {split} split has an undecodable image at {where} ({first_line(e)}).") from None


def row_pixels(rows, i: int, im, view) -> np.ndarray:
    """view(the RGB image) of row i's opened image (open_image), closed after; one line naming the row if its pixels
    cannot be decoded. What every decode goes through: the cache's (utils/data/decode.py) and the workers'
    (utils/data/encoded.py)."""
    try:
        with im:
            return view(im.convert("RGB"))  # grayscale repeated into 3 channels, RGBA's alpha dropped, palettes too
    except OSError as e:  # a header that reads but pixels that do not (a truncated file)
        raise UserError(f"the {rows.split} split has an undecodable image at {rows.where(i)} ({first_line(e)}).") \
            from None


def evaluation_view(size: int, recipe: CropRecipe | None):
    """An RGB PIL image -> its (S, S, 3) uint8 evaluation view: resized and centre-cropped by the crop recipe, or
    without one resized to S x S as the cache does. predict.py gives new images the same view."""
    return partial(eval_view, size=size, recipe=recipe) if recipe else partial(square_pixels, size=size)
