"""A copy's own torch Dataset as a split's images (`load_data` may return map-style Datasets for train and test):
each item (image, label), the image a PIL image or a uint8 tensor (3 x S x S or S x S x 3), the label an integer.
`DatasetImages.read` reads every item once when the data is checked, in order: the contract (item types, label
range, one square size) is checked there with one line for the first item that breaks it, and the labels and
per-channel statistics are kept. Training and evaluation then read the items again, a batch at a time, in the
loader's worker processes (`ItemsDataset`), into the same uint8 batches the in-memory path gives: the sampler, the
draws from (seed, epoch, index), sharding and resume are the other kinds'. A Dataset must give the same item for an
index every time (augmentation is the template's, drawn per sample)."""

from __future__ import annotations

import numpy as np
import torch

from utils import UserError
from utils.data.images import Images, LoaderDataset, worker_share


def item_pixels(item, what: str, size: int | None = None) -> tuple[np.ndarray, int]:
    """One Dataset item as (S x S x 3 uint8 pixels, label); `size`: the side every item must have (None: any square).
    A broken contract: one line naming `what` (the split's Dataset and the item's index)."""
    from PIL import Image

    if not isinstance(item, tuple | list) or len(item) != 2:
        raise UserError(f"{what} must be a pair (image, label) (got {type(item).__name__}).")
    image, label = item
    if isinstance(image, Image.Image):
        pixels = np.asarray(image.convert("RGB"))
    elif isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.dim() == 3:
        pixels = (image.permute(1, 2, 0) if image.shape[0] == 3 and image.shape[2] != 3 else image).cpu().numpy()
    else:
        kind = (f"{str(image.dtype).removeprefix('torch.')} tensor {tuple(image.shape)}"
                if isinstance(image, torch.Tensor) else type(image).__name__)
        raise UserError(f"{what}'s image must be a PIL image or a uint8 tensor 3 x S x S or S x S x 3 (got {kind}).")
    if pixels.shape[2] != 3 or pixels.shape[0] != pixels.shape[1] or (size and pixels.shape[0] != size):
        want = f"{size} x {size}, as item 0 of the train split is" if size else "square"
        raise UserError(f"{what}'s image is {pixels.shape[1]} x {pixels.shape[0]} with {pixels.shape[2]} channels; "
                        f"every image must be RGB and {want}: resize in the Dataset (e.g. torchvision's "
                        f"transforms.Resize((S, S))) or pass arrays of one size.")
    if isinstance(label, torch.Tensor) and label.numel() == 1 and not label.is_floating_point():
        label = label.item()
    if isinstance(label, bool) or not isinstance(label, int | np.integer):
        raise UserError(f"{what}'s label must be an integer (got {type(label).__name__} {label!r}).")
    return pixels, int(label)


class DatasetImages(Images):
    """A Dataset's items as a split's images (see the module's docstring); the first `length` items."""

    def __init__(self, dataset: torch.utils.data.Dataset, size: int, what: str, length: int, sums: np.ndarray):
        self.dataset, self.image_size, self.what, self.length, self.sums = dataset, size, what, length, sums
        self.workers = worker_share()

    @classmethod
    def read(cls, dataset: torch.utils.data.Dataset, what: str, size: int | None = None
             ) -> tuple[DatasetImages, list[int]]:
        """Every item read once, checked (`size`: the side the items must have; None: item 0's) and its label kept;
        with the per-channel sums of the pixels for `channel_stats`."""
        try:
            n = len(dataset)
        except TypeError:
            raise UserError(f"{what} must be a map-style Dataset with a length (got {type(dataset).__name__}).") \
                from None
        if n == 0:
            raise UserError(f"{what} holds no items.")
        labels, sums = [], np.zeros((2, 3), dtype=np.float64)  # per channel: sum, sum of squares
        for i in range(n):
            pixels, label = item_pixels(dataset[i], f"{what}'s item {i}", size)
            size = size or pixels.shape[0]
            flat = pixels.reshape(-1, 3).astype(np.float64)
            sums += np.stack([flat.sum(0), (flat * flat).sum(0)])
            labels.append(label)
        return cls(dataset, size, what, n, sums), labels

    def __len__(self) -> int:
        return self.length

    def prefix(self, n: int) -> DatasetImages:
        return DatasetImages(self.dataset, self.image_size, self.what, n, self.sums)

    def loader_dataset(self, labels, train, seed, augment, pad, mixing) -> ItemsDataset:
        return ItemsDataset(self, labels, seed if train else None, augment, pad, mixing)

    def channel_stats(self):
        """Of every item of the split (whole: a prefix's are its Dataset's), in [0, 1]."""
        n = len(self.dataset) * self.image_size ** 2  # read() summed every item's pixels
        mean = self.sums[0] / n
        std = np.sqrt(np.clip(self.sums[1] / n - mean * mean, 0, None))
        return tuple((mean / 255).tolist()), tuple((std / 255).tolist())


class ItemsDataset(LoaderDataset):
    """A batch of a Dataset's items, read in a DataLoader worker into one (B, 3, S, S) uint8 view of NHWC memory, as
    BatchedTensorDataset gives the same images from memory; a training set's with its draws."""

    images: DatasetImages

    def __getitems__(self, indices: list[int]):
        host = np.asarray(indices, dtype=np.int64)
        size = self.images.image_size
        out = np.empty((len(host), size, size, 3), dtype=np.uint8)
        for k, i in enumerate(host):
            out[k] = item_pixels(self.images.dataset[int(i)], f"{self.images.what}'s item {i}", size)[0]
        return self.finish(torch.from_numpy(out).permute(0, 3, 1, 2), self.labels[torch.from_numpy(host)], host)
