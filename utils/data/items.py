"""A copy's own torch Dataset as a split's images (`load_data` may return map-style Datasets for train and test):
each item (image, label), the image a PIL image or a uint8 tensor (3 x H x W or H x W x 3) of any size and aspect
when --image-size is given (else square, every item the train split's first item's size), the label an integer.
`DatasetRows.read` reads every item once when the data is checked, in order, without decoding its pixels (a PIL
image opened lazily, `Image.open(path)`, reads its header only): the contract is checked there with one line for
the first item that breaks it, and the labels are kept. Training and evaluation then read the items again, a batch
at a time, in the loader's worker processes, as the built-in image folders are (utils/data/encoded.py): resized to
S x S, or under --augment resized-crop cut by the keyed random-resized crop and evaluated on the centre crop; the
sampler, the draws from (seed, epoch, index), sharding and resume are the other kinds'. A Dataset must give the same
item for an index every time (augmentation is the template's, drawn per sample)."""

from __future__ import annotations

import io

import numpy as np
import torch

from utils import UserError
from utils.data.sources import EncodedRows


def item_image(item, what: str, size: int | None = None):
    """One Dataset item's (image as a PIL image, label); `size`: the side every image must have (None: any size).
    Nothing is decoded that the item did not decode. A broken contract: one line naming `what` (the split's Dataset
    and the item's index)."""
    from PIL import Image

    if not isinstance(item, tuple | list) or len(item) != 2:
        raise UserError(f"{what} must be a pair (image, label) (got {type(item).__name__}).")
    image, label = item
    if isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.dim() == 3 and 3 in (
            image.shape[0], image.shape[2]):
        hwc = image.permute(1, 2, 0) if image.shape[0] == 3 and image.shape[2] != 3 else image
        image = Image.fromarray(np.ascontiguousarray(hwc.cpu().numpy()))
    elif not isinstance(image, Image.Image):
        kind = (f"{str(image.dtype).removeprefix('torch.')} tensor {tuple(image.shape)}"
                if isinstance(image, torch.Tensor) else type(image).__name__)
        raise UserError(f"{what}'s image must be a PIL image or a uint8 tensor 3 x H x W or H x W x 3 (got {kind}).")
    w, h = image.size
    if size and (w, h) != (size, size):
        raise UserError(f"{what}'s image is {w} x {h}; without --image-size every image must be {size} x {size}, as "
                        f"item 0 of the train split is: pass --image-size S to resize (or crop) every image to S.")
    if isinstance(label, torch.Tensor) and label.numel() == 1 and not label.is_floating_point():
        label = label.item()
    if isinstance(label, bool) or not isinstance(label, int | np.integer):
        raise UserError(f"{what}'s label must be an integer (got {type(label).__name__} {label!r}).")
    return image, int(label)


class DatasetRows(EncodedRows):
    """A Dataset's items as a split's rows, the items `order` of it (a prefix: --train-subset, --eval-subset)."""

    def __init__(self, dataset: torch.utils.data.Dataset, split: str, what: str, labels: torch.Tensor,
                 order: np.ndarray):
        self.dataset, self.split, self.what, self.labels, self.order = dataset, split, what, labels, order
        self.names = None

    @classmethod
    def read(cls, dataset: torch.utils.data.Dataset, split: str, what: str, size: int | None,
             fixed: int | None = None) -> tuple[DatasetRows, int]:
        """Every item read once and checked, its label kept: (the rows, S). `size`: --image-size (None: the items
        must be square, all of `fixed`'s side, else the first item's)."""
        try:
            n = len(dataset)
        except TypeError:
            raise UserError(f"{what} must be a map-style Dataset with a length (got {type(dataset).__name__}).") \
                from None
        if n == 0:
            raise UserError(f"{what} holds no items.")
        labels, side = [], size or fixed
        for i in range(n):
            image, label = item_image(dataset[i], f"{what}'s item {i}", None if size else side)
            if side is None:
                side = image.size[0]
                if image.size[0] != image.size[1]:
                    raise UserError(f"{what}'s item {i}'s image is {image.size[0]} x {image.size[1]}; without "
                                    f"--image-size every image must be square: pass --image-size S to resize (or "
                                    f"crop) every image to S.")
            labels.append(label)
        return cls(dataset, split, what, torch.tensor(labels, dtype=torch.int64), np.arange(n)), side

    def __len__(self) -> int:
        return len(self.order)

    def take(self, order: torch.Tensor) -> DatasetRows:
        return DatasetRows(self.dataset, self.split, self.what, self.labels[order], self.order[order.numpy()])

    def where(self, i: int) -> str:
        return f"item {int(self.order[i])} of {self.what}"

    def fetch(self, indices) -> list:
        return [self.dataset[int(self.order[i])][0] for i in np.asarray(indices, dtype=np.int64)]

    def open(self, source, i: int):
        """An item's image as a new PIL image, so that the Dataset's own object is never closed or changed: an image
        the Dataset opened lazily (`Image.open(path)` or of bytes; nothing decoded yet) opened again from its file or
        bytes, so that a JPEG decodes at the scale its view needs as the built-in folders' do
        (utils/data/pixels.py); a tensor's pixels wrapped; any other PIL image converted to RGB."""
        from PIL import Image, ImageFile

        image, _ = item_image((source, 0), f"{self.what}'s item {int(self.order[i])}")
        if isinstance(image, ImageFile.ImageFile) and image.tile:  # (tile: what load() has still to decode)
            if image.filename:
                return Image.open(image.filename)
            if isinstance(image.fp, io.BytesIO):
                return Image.open(io.BytesIO(image.fp.getvalue()))
        return image.convert("RGB")
