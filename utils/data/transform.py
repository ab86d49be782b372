"""The last step of every batch, on the training device: `BatchTransform` turns the loader's uint8 (B, 3, S, S)
batch (NHWC memory, after the 4x smaller than float transfer) into the model's normalised float input, with each
image's drawn crop and flip and the batch's mixing. In NHWC a row of an image is one contiguous run of bytes, so a
crop is a copy of S rows, not of S x S pixels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from utils import UserError
from utils.data.draws import Draws, PolicyDraws
from utils.data.images import crop_padding
from utils.data.policies import apply_policy


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
        self.noise = torch.Generator(device)  # random erasing's values, seeded per batch by its draws

    @classmethod
    def for_data(cls, data: dict, device: torch.device, channels_last: bool) -> BatchTransform:
        """The transform for `checked_data`'s dict: its mean and std, its image size's crop padding, its classes."""
        return cls(device, channels_last, mean=data["mean"], std=data["std"], pad=crop_padding(data["image_size"]),
                   num_classes=len(data["classes"]))

    def __call__(self, images: torch.Tensor, draws: tuple[torch.Tensor, torch.Tensor] | None = None,
                 policy: PolicyDraws | None = None) -> torch.Tensor:
        if images.dtype != torch.uint8:  # float images would be divided by 255 x std: training on near-zero inputs
            raise UserError(f"the loader gave {str(images.dtype).removeprefix('torch.')} images; the transform takes "
                            f"uint8 images (0-255), as utils/data's loaders give them (docs/customizing.md).")
        if draws is not None:
            images = self.crop_and_flip(images, draws)
        if policy is not None:  # --auto-augment, after the crop and flip, on uint8 as torchvision's policies
            images = apply_policy(images, policy)
        n, c, h, w = images.shape
        rows = images.permute(0, 2, 3, 1).reshape(n * h, w * c)  # a view for channels-last input
        if w not in self.row_scale_shift:
            self.row_scale_shift[w] = self.scale.repeat(w), self.shift.repeat(w)
        scale, shift = self.row_scale_shift[w]
        x = torch.addcmul(shift, rows, scale).view(n, h, w, c).permute(0, 3, 1, 2)  # float, channels-last
        return x if self.channels_last else x.contiguous()

    def train(self, images: torch.Tensor, labels: torch.Tensor, draws: Draws | None = None):
        """A training batch -> (the model's input, the loss's targets): the labels, or with mixing draws
        (`mix_draws`) class probabilities (num_classes wide), each image's label and its partner's weighted by the
        share of the partner in the mixed image. Mixed after the crop, flip and normalisation, as torchvision's
        MixUp and CutMix mix a batch of augmented tensors. Random erasing (`erase_draws`) before the mixing, on the
        normalised images, as torchvision's reference recipes place RandomErasing in each image's transform."""
        x = self(images, *(None, None) if draws is None else (draws.flip_crop, draws.policy))
        if draws is not None and draws.erasing is not None:
            x = self.erase(x, *draws.erasing)
        if draws is None or draws.mixing is None:
            return x, labels
        partner, weight, box = draws.mixing
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

    def erase(self, x: torch.Tensor, box: torch.Tensor, seed: int) -> torch.Tensor:
        """Each image's drawn box (y0, y1, x0, x1; empty: not erased) filled with standard normal values, as
        torchvision's RandomErasing(value="random") fills it on a normalised image; the values from a generator on
        the device seeded by the batch's draws, so they are the same at any process count and after a resume."""
        n, c, h, w = x.shape
        rows, cols = torch.arange(h, device=x.device).view(1, h, 1), torch.arange(w, device=x.device).view(1, 1, w)
        y0, y1, x0, x1 = (box[:, i].view(n, 1, 1) for i in range(4))
        inside = ((rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1)).unsqueeze(1)
        self.noise.manual_seed(seed)
        noise = torch.randn(n, h, w, c, generator=self.noise, device=x.device).permute(0, 3, 1, 2)  # channels-last
        erased = torch.where(inside, noise, x)
        return erased.contiguous(memory_format=torch.channels_last if self.channels_last else torch.contiguous_format)

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
