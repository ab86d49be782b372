"""Images decoded on the fly (--decode workers, --decode stream): the source's images stay encoded (parquet rows in
datasets' memory-mapped table, an image folder's files, or a stream's shards) and the DataLoader's worker processes
decode each batch as the sampler asks for it. For images whose decoded copy would not fit the cache
(utils/data/decode.py) or that the crop recipe for natural images needs whole (--augment resized-crop,
utils/data/pixels.py). The sampler's contract holds as on the cached path: the order comes from the rows' sampler
(EpochSampler, or a stream's), each sample's crop, flip and mixing from (seed, epoch, sample index), so batches are
the same at any process count, worker count and after a resume. `EncodedImages` is this kind of `Images`
(utils/data/images.py); utils/data/builtin.py makes it."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from utils.data.images import Images, channel_stats
from utils.data.pixels import (
    CropRecipe,
    evaluation_view,
    resized_crop_draws,
    row_pixels,
    square_pixels,
    train_view,
    upright_size,
)
from utils.data.sources import EncodedRows

STATS_IMAGES = 512  # training images the per-channel mean and std are estimated from (the first, decoded at S)


class EncodedImages(Images):
    """A split's encoded images at --image-size S: where the cached path holds an (N, 3, S, S) uint8 tensor. The
    view of each image: `recipe` None: resized to S x S as the cache does (the small-image crops then run on the
    device, as there); a CropRecipe: the random-resized crop in training, resize and centre crop in evaluation.
    `rows`: a table's or a stream's (utils/data/sources.py's EncodedRows), which also gives the training order.
    `reduce`: JPEGs decoded at the scale each view needs (utils/data/pixels.py's decoded); False: --full-decode."""

    def __init__(self, rows: EncodedRows, size: int, recipe: CropRecipe | None, workers: int, reduce: bool = True):
        self.rows, self.image_size, self.recipe, self.workers, self.reduce = rows, size, recipe, workers, reduce
        self.crops_whole = recipe is not None

    def __len__(self) -> int:
        return len(self.rows)

    def prefix(self, n: int) -> EncodedImages:
        return EncodedImages(self.rows.take(torch.arange(n)), self.image_size, self.recipe, self.workers, self.reduce)

    def read(self, indices, key):
        """The batch decoded here (in a DataLoader worker) into one (B, S, S, 3) uint8 array: with the crop recipe and
        a training `key`, each image's keyed random-resized crop and flip cut as it is decoded (cropped: True), else
        its evaluation view (or the cache's resize, the small-image crops then drawn for the device)."""
        rows, size, recipe = self.rows, self.image_size, self.recipe
        out = np.empty((len(indices), size, size, 3), dtype=np.uint8)
        opened = [rows.open(source, int(i)) for source, i in zip(rows.fetch(indices), indices)]
        cropped = recipe is not None and key is not None
        if cropped:
            boxes, mirrored = resized_crop_draws(*key, indices, [upright_size(im) for im in opened], recipe)
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
        pixels = np.stack([row_pixels(sample, i, sample.open(s, i), view)
                           for i, s in enumerate(sample.fetch(range(len(sample))))])
        return channel_stats(torch.from_numpy(pixels).permute(0, 3, 1, 2))
