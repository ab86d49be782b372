"""The batch's transforms on uint8 pixels, drawn per image by (seed, epoch, sample).
--auto-augment's per-image policies: torchvision's TrivialAugmentWide (`ta_wide`), RandAugment (`ra`) and AugMix
(`augmix`), with the ops, magnitudes and spaces of torchvision.transforms.v2. Each image's ops are drawn on the host
(`policy_draws`), then `apply_policy` runs each op once per batch on the images that drew it: on the device, or in the
loader's workers for crops cut as they are decoded. Written by hand because torchvision's classes draw from the global
RNG and apply one op at one magnitude to a whole batch; each op gives torchvision's per-image result within 1 level
(tests/test_policies.py).
`BatchTransform` turns the loader's uint8 NHWC batch into the model's normalised float input: crop, flip, policy,
erasing and mixing. In NHWC an image row is one contiguous run, so a crop copies S rows, not S x S pixels."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from utils import UserError
from utils.data.draws import AUTO_AUGMENT, Draws, PolicyDraws, crop_padding, key_stream, splitmix64, uniform01

POLICIES = ("ta_wide", "ra", "augmix")
OPS = ("Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast",
       "Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize")
GEOMETRIC = OPS[1:6]
AUGMIX_WIDTH, AUGMIX_DEPTH = 3, 3  # torchvision's AugMix: 3 chains of 1-3 ops (chain_depth -1), alpha 1
BINS = {"ta_wide": 31, "ra": 31, "augmix": 10}  # each policy's magnitude bins, torchvision's


@dataclass(frozen=True)
class Policy:
    """--auto-augment and its strengths (RandAugment's op count and bin of 31; AugMix's severity of 10)."""
    name: str
    ra_ops: int = 2
    ra_magnitude: int = 9
    augmix_severity: int = 3


def augment_policy(cfg) -> Policy | None:
    """The policy of a script's data flags (its DataConfig group); None for --auto-augment none."""
    if cfg.auto_augment == "none":
        return None
    return Policy(cfg.auto_augment, cfg.ra_ops, cfg.ra_magnitude, cfg.augmix_severity)


def space(name: str, size: int) -> dict[str, tuple[np.ndarray | None, bool]]:
    """torchvision's augmentation space on S x S images: op -> (each bin's magnitude, or None; whether its sign is
    drawn), the bins from torch.linspace as torchvision's."""
    bins = BINS[name]
    shear, translate, rotate, color, bits, span = {
        "ta_wide": (0.99, 32.0, 135.0, 0.99, 8, 6),
        "ra": (0.3, 150.0 / 331.0 * size, 30.0, 0.9, 8, 4),
        "augmix": (0.3, size / 3.0, 30.0, 0.9, 4, 4)}[name]

    def line(top):
        return torch.linspace(0.0, top, bins).double().numpy()

    posterize = (bits - torch.arange(bins) / ((bins - 1) / span)).round().int().double().numpy()
    ops = {"Identity": (None, False), "ShearX": (line(shear), True), "ShearY": (line(shear), True),
           "TranslateX": (line(translate), True), "TranslateY": (line(translate), True), "Rotate": (line(rotate), True),
           "Brightness": (line(color), True), "Color": (line(color), True), "Contrast": (line(color), True),
           "Sharpness": (line(color), True), "Posterize": (posterize, False),
           "Solarize": (torch.linspace(1.0, 0.0, bins).double().numpy(), False), "AutoContrast": (None, False),
           "Equalize": (None, False)}
    if name == "augmix":
        del ops["Identity"]
    return ops


def draw_ops(seed: int, epoch: int, indices, policy: Policy, size: int):
    """Each sample's ops, from (seed, epoch, sample index) only: (op index into OPS, signed magnitude (both (layers,
    n)), AugMix's weights (n, 1 + chains) or None, layers per chain), drawn as torchvision's policies draw them; a
    signed op's magnitude negated with chance 1/2."""
    table, bins = space(policy.name, size), BINS[policy.name]
    ids = np.array([OPS.index(name) for name in table])  # the policy's ops, as indices into OPS
    values = np.stack([np.zeros(bins) if v is None else v for v, _ in table.values()])  # (ops, bins)
    signed = np.array([s for _, s in table.values()])
    n = len(indices)
    h = np.asarray(indices).astype(np.uint64) ^ key_stream(seed, epoch, AUTO_AUGMENT)

    def draw():
        nonlocal h
        h = splitmix64(h)
        return uniform01(h)

    def pick(k: int):
        return np.minimum((draw() * k).astype(np.int64), k - 1)

    chains, depth = (AUGMIX_WIDTH, AUGMIX_DEPTH) if policy.name == "augmix" else (1, 1)
    if policy.name == "ra":
        depth = policy.ra_ops
    weights = None
    if policy.name == "augmix":  # gamma(1) variates, normalised: m ~ Beta(1, 1), the chains' ~ Dirichlet(1, 1, 1)
        gamma = -np.log1p(-np.stack([draw() for _ in range(2 + chains)], axis=1))
        m = gamma[:, :2] / gamma[:, :2].sum(1, keepdims=True)
        weights = np.concatenate([m[:, :1], gamma[:, 2:] / gamma[:, 2:].sum(1, keepdims=True) * m[:, 1:]], axis=1)
    ops = np.zeros((chains * depth, n), dtype=np.int64)
    magnitudes = np.zeros((chains * depth, n))
    for chain in range(chains):
        length = pick(3) + 1 if policy.name == "augmix" else np.full(n, depth)
        for layer in range(depth):
            op = pick(len(ids))
            b = pick(bins) if policy.name == "ta_wide" else (
                pick(policy.augmix_severity) if policy.name == "augmix" else np.full(n, policy.ra_magnitude))
            negate = signed[op] & (draw() < 0.5)
            used = layer < length  # AugMix's chains past their depth: Identity
            ops[chain * depth + layer] = np.where(used, ids[op], 0)
            magnitudes[chain * depth + layer] = np.where(used, values[op, b] * np.where(negate, -1.0, 1.0), 0.0)
    return ops, magnitudes, weights, depth


def inverse_affine(center, angle, translate, shear) -> np.ndarray:
    """torchvision's _get_inverse_affine_matrix (scale 1) over arrays of images: (n, 6), in float64 as there."""
    rot, sx, sy = np.radians(angle), np.radians(shear[0]), np.radians(shear[1])
    (cx, cy), (tx, ty) = center, translate
    a = np.cos(rot - sy) / np.cos(sy)
    b = -(a * np.tan(sx) + np.sin(rot))
    c = np.sin(rot - sy) / np.cos(sy)
    d = np.cos(rot) - c * np.tan(sx)
    return np.stack([d, -b, cx - d * (cx + tx) + b * (cy + ty), -c, a, cy + c * (cx + tx) - a * (cy + ty)], axis=1)


def op_params(op: np.ndarray, magnitude: np.ndarray, size: int) -> np.ndarray:
    """Each image's parameters for its op, as torchvision's AutoAugment passes them: the inverse affine matrix of a
    geometric op, 1 + magnitude for a colour op, posterize's mask, solarize's threshold."""
    n, m = len(op), magnitude
    params = np.zeros((n, 6))
    is_op = {name: op == OPS.index(name) for name in OPS}
    corner = np.where(is_op["ShearX"] | is_op["ShearY"], -size * 0.5, 0.0)
    shear = np.degrees(np.arctan(m))
    geometric = np.isin(op, [OPS.index(name) for name in GEOMETRIC])
    params[geometric] = inverse_affine(
        (corner, corner),
        np.where(is_op["Rotate"], -(m % 360), 0.0),  # rotate_image's angle in [0, 360), negated as there
        (np.where(is_op["TranslateX"], np.trunc(m), 0.0), np.where(is_op["TranslateY"], np.trunc(m), 0.0)),
        (np.where(is_op["ShearX"], shear, 0.0), np.where(is_op["ShearY"], shear, 0.0)))[geometric]
    factor = 1.0 + m
    colour = is_op["Brightness"] | is_op["Color"] | is_op["Contrast"] | is_op["Sharpness"]
    params[colour, 0], params[colour, 1] = factor[colour], (1.0 - factor)[colour]
    bits = m.astype(np.int64).clip(0, 8)
    mask = np.where(bits >= 8, 255, ((1 << bits) - 1) << (8 - bits))
    params[is_op["Posterize"], 0] = mask[is_op["Posterize"]]
    params[is_op["Solarize"], 0] = 255 * m[is_op["Solarize"]]
    return params


def policy_draws(seed: int, epoch: int, indices, policy: Policy, size: int) -> PolicyDraws:
    """A training batch's policy draws, grouped by op for `apply_policy`; on the host (no device sync)."""
    ops, magnitudes, weights, depth = draw_ops(seed, epoch, indices, policy, size)
    orders, params, counts = [], [], []
    for op, magnitude in zip(ops, magnitudes):
        order = np.argsort(op, kind="stable")
        orders.append(order)
        params.append(op_params(op[order], magnitude[order], size))
        counts.append(tuple(np.bincount(op, minlength=len(OPS)).tolist()))
    return PolicyDraws(torch.from_numpy(np.stack(orders)), torch.from_numpy(np.stack(params)).float(), tuple(counts),
                       None if weights is None else torch.from_numpy(weights).float(), depth,
                       "bilinear" if policy.name == "augmix" else "nearest")


def affine(images: torch.Tensor, theta: torch.Tensor, mode: str) -> torch.Tensor:
    """torchvision's tensor affine (zero fill), one matrix per image; every constant made on the device or as a number,
    so no host copy and no sync."""
    m, _, h, w = images.shape
    dev = images.device
    xs = torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=dev)
    ys = torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=dev)
    base = torch.stack([xs.expand(h, w), ys.unsqueeze(1).expand(h, w), torch.ones(h, w, device=dev)], -1)
    columns = theta.view(m, 2, 3).transpose(1, 2)
    rescaled = torch.stack([columns[..., 0] / (0.5 * w), columns[..., 1] / (0.5 * h)], -1)
    grid = base.view(1, h * w, 3).matmul(rescaled).view(m, h, w, 2)
    out = F.grid_sample(images.float(), grid, mode=mode, padding_mode="zeros", align_corners=False)
    return out.round_().to(torch.uint8)


def blend(images: torch.Tensor, other: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """torchvision's _blend per image: image x factor + other x (1 - factor), clamped, truncated to uint8."""
    factor, rest = (params[:, k].view(-1, 1, 1, 1) for k in (0, 1))
    return images.float().mul_(factor).add_(other * rest).clamp_(0, 255).to(torch.uint8)


def gray(images: torch.Tensor) -> torch.Tensor:
    r, g, b = images.unbind(1)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).unsqueeze(1).floor_()


def sharpen(images: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """torchvision's adjust_sharpness per image: the interior blended with its 3 x 3 smoothing (rounded)."""
    kernel = torch.full((3, 1, 3, 3), 1.0 / 13.0, device=images.device)
    kernel[:, :, 1, 1] = 5.0 / 13.0
    out = images.float()
    blurred = F.conv2d(out, kernel, groups=3).round_()
    interior = out[..., 1:-1, 1:-1]
    interior.add_(blurred.sub_(interior).mul_(params[:, 1].view(-1, 1, 1, 1)))
    return out.clamp_(0, 255).to(torch.uint8)


def autocontrast(images: torch.Tensor) -> torch.Tensor:
    """torchvision's autocontrast per image and channel, with torch.where for its masked assignment (no sync)."""
    x = images.float()
    low, high = x.amin(dim=(-2, -1), keepdim=True), x.amax(dim=(-2, -1), keepdim=True)
    flat = high == low
    inv_scale = torch.where(flat, 1.0, (high - low).mul_(1.0 / 255))
    return x.sub_(torch.where(flat, 0.0, low)).div_(inv_scale).clamp_(0, 255).to(torch.uint8)


def run_op(name: str, images: torch.Tensor, params: torch.Tensor, mode: str) -> torch.Tensor:
    import torchvision.transforms.v2.functional as TF

    if name in GEOMETRIC:
        return affine(images, params, mode)
    if name == "Brightness":
        return blend(images, torch.zeros((), device=images.device), params)
    if name == "Color":
        return blend(images, gray(images), params)
    if name == "Contrast":
        return blend(images, gray(images).mean(dim=(1, 2, 3), keepdim=True), params)
    if name == "Sharpness":
        return sharpen(images, params)
    if name == "Posterize":
        return images & params[:, 0].to(torch.uint8).view(-1, 1, 1, 1)
    if name == "Solarize":
        return torch.where(images >= params[:, 0].view(-1, 1, 1, 1), 255 - images, images)
    if name == "AutoContrast":
        return autocontrast(images)
    if name == "Equalize":
        return TF.equalize(images)
    return images  # Identity


def apply_policy(images: torch.Tensor, draws: PolicyDraws) -> torch.Tensor:
    """uint8 (n, 3, S, S) with each image's drawn ops applied (AugMix: chains mixed by its weights)."""
    chains = len(draws.order) // draws.depth
    mixed = None if draws.weights is None else images.float() * draws.weights[:, 0].view(-1, 1, 1, 1)
    for chain in range(chains):
        out = images
        for layer in range(chain * draws.depth, (chain + 1) * draws.depth):
            order, counts = draws.order[layer], draws.counts[layer]
            if counts[0] == len(order):  # every image drew Identity
                continue
            ordered = out.index_select(0, order)
            parts = [run_op(name, part, params, draws.mode) for name, part, params, count in
                     zip(OPS, ordered.split(counts), draws.params[layer].split(counts), counts) if count]
            out = torch.empty_like(ordered).index_copy_(0, order, torch.cat(parts))
        if mixed is not None:
            mixed.add_(out * draws.weights[:, 1 + chain].view(-1, 1, 1, 1))
    result = out if mixed is None else mixed.to(torch.uint8)
    return result.contiguous(memory_format=torch.channels_last)


class BatchTransform:
    """uint8 (B, 3, S, S) on the device -> the normalised float batch; with a training batch's draws, first each image's
    crop (zero padding `pad`) and flip. Works in NHWC memory; holds no random state. `num_classes`: the soft targets'
    width under mixing."""

    def __init__(self, device: torch.device, channels_last: bool, *, mean: tuple[float, ...], std: tuple[float, ...],
                 pad: int = 4, num_classes: int | None = None):
        self.channels_last, self.pad, self.num_classes = channels_last, pad, num_classes
        # (x - mean) / std as one x * scale + shift over rows of W x 3 values (a (3,) operand: 5x slower on CPU)
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
        """A training batch -> (input, targets): the labels, or under mixing each image's label and its partner's
        weighted by their shares. Erasing on the normalised images, then mixing, as torchvision's recipes order them."""
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
        # each value's share of the partner (1 - lambda, or 1 in a cutmix box); the full shape: a broadcast is 2x slower
        share = (weight.view(n, 1, 1) + pasted).unsqueeze(3).expand(n, h, w, c).contiguous()
        mixed = torch.lerp(nhwc, theirs, share).permute(0, 3, 1, 2)
        if not self.channels_last:
            mixed = mixed.contiguous()
        own = F.one_hot(labels, self.num_classes).float()
        partner_share = weight + (box[:, 1] - box[:, 0]) * (box[:, 3] - box[:, 2]) / (h * w)
        return mixed, torch.lerp(own, own.index_select(0, partner), partner_share.view(n, 1))

    def erase(self, x: torch.Tensor, box: torch.Tensor, seed: int) -> torch.Tensor:
        """Each image's drawn box (y0, y1, x0, x1; empty: none) filled with standard normal values
        (RandomErasing(value="random")), from a device generator seeded by the batch's draws."""
        n, c, h, w = x.shape
        rows, cols = torch.arange(h, device=x.device).view(1, h, 1), torch.arange(w, device=x.device).view(1, 1, w)
        y0, y1, x0, x1 = (box[:, i].view(n, 1, 1) for i in range(4))
        inside = ((rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1)).unsqueeze(1)
        self.noise.manual_seed(seed)
        noise = torch.randn(n, h, w, c, generator=self.noise, device=x.device).permute(0, 3, 1, 2)  # channels-last
        erased = torch.where(inside, noise, x)
        return erased.contiguous(memory_format=torch.channels_last if self.channels_last else torch.contiguous_format)

    def crop_and_flip(self, images: torch.Tensor, draws: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Each image cropped at its drawn offset of its zero-padded self, mirrored if drawn. Written with plain tensor
        ops because torchvision's v2 transforms draw one crop per batch. The batch goes into a canvas whose zero border
        is written once, the images to mirror mirrored into its second half (mirroring is the costly step in NHWC); then
        one index_select of B x H row windows crops them all. The result is a view of a buffer the next call overwrites
        (fresh buffers cost page faults on CPU)."""
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
