"""Pixel work, all of it: an encoded image opened lazily (`open_image`) and decoded into its RGB view,
upright (EXIF orientation applied) and a JPEG at the smallest DCT scale that holds the view (`decoded`; --full-decode:
full size). The views: the cache's resize to S x S (`square_pixels`) and --augment resized-crop's, keyed by (seed,
epoch, sample) so any process crops a sample alike, boxes in the full-size upright image's coordinates:
  training    torchvision's RandomResizedCrop sampling (--crop-scale, --crop-ratio), resized (--interpolation) to
              S x S, flipped with chance 1/2 (`train_view`);
  evaluation  shorter side resized to int(S / --eval-crop), then the centre S x S (`eval_view`).
At full size the pixels are torchvision.transforms.v2.functional's on the PIL image. Written by hand because
torchvision's transforms draw from a global RNG, not a key, and decode the whole image first."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from PIL import Image

from utils import UserError, first_line
from utils.data.draws import key_stream, splitmix64, uniform01

TRIES = 10  # torchvision's RandomResizedCrop: tries before its fallback
# Pillow's bomb guard (179 megapixels) refuses a phone's 200-megapixel photo: off; MAX_PIXELS is checked instead
Image.MAX_IMAGE_PIXELS = None
try:  # iPhones' HEIC photos, through pi-heif's plugin: decoded upright, EXIF orientation reset to 1
    from pi_heif import register_heif_opener
except ImportError:  # an image folder then leaves .heic files out, said
    pass
else:
    register_heif_opener()
MAX_PIXELS = 2**30  # 1,074 megapixels: any camera's photo, a stitched panorama; 3 GiB as decoded RGB at full size


@dataclass(frozen=True)
class CropRecipe:
    """--crop-scale, --crop-ratio, --eval-crop and --interpolation (the size: --image-size)."""
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    eval_crop: float = 0.875
    interpolation: str = "bilinear"  # or "bicubic": torchvision's InterpolationMode by name


def crop_recipe(cfg) -> CropRecipe | None:
    """--augment resized-crop's recipe from a script's data flags (unset: the defaults); else None."""
    if cfg.augment != "resized-crop":
        return None
    return CropRecipe(cfg.crop_scale, cfg.crop_ratio, cfg.eval_crop or CropRecipe.eval_crop,
                      cfg.interpolation or CropRecipe.interpolation)


def resized_crop_draws(seed: int, epoch: int, indices, sizes, recipe: CropRecipe) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's crop box (top, left, height, width) and mirroring, from (seed, epoch, sample index, image size)
    only."""
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


def train_view(im, box, mirrored: bool, size: int, recipe: CropRecipe, reduce: bool = True) -> np.ndarray:
    """The training crop of an opened image: `box` of the upright image resized to S x S, mirrored if drawn."""
    import torchvision.transforms.v2.functional as TF

    top, left, height, width = map(int, box)
    im = region(im, (left, top, left + width, top + height), (size, size), recipe.interpolation, reduce)
    return np.asarray(TF.horizontal_flip(im) if mirrored else im)


def eval_view(im, size: int, recipe: CropRecipe, reduce: bool = True) -> np.ndarray:
    """The evaluation view: shorter side resized to int(S / eval_crop) (as torchvision's Resize(int)), then the
    centre S x S (an odd margin's extra pixel before the crop, as torchvision and timm)."""
    import torchvision.transforms.v2.functional as TF

    width, height = upright_size(im)
    out = eval_resize(width, height, size, recipe)
    return np.asarray(TF.center_crop(region(im, (0, 0, width, height), out, recipe.interpolation, reduce),
                                     [size, size]))


def eval_resize(width: int, height: int, size: int, recipe: CropRecipe) -> tuple[int, int]:
    """The (width, height) the evaluation view resizes an image to before its centre crop."""
    short = int(size / recipe.eval_crop)
    return (short, int(short * height / width)) if width <= height else (int(short * width / height), short)


def square_pixels(im, size: int, reduce: bool = True) -> np.ndarray:
    """An opened image as (S, S, 3) uint8, resized (bicubic) to S x S unless it is: the cache's and the on-the-fly
    path's without a crop recipe, bit for bit."""
    width, height = upright_size(im)
    return np.asarray(region(im, (0, 0, width, height), (size, size), "bicubic", reduce))


# EXIF orientation -> the transpose that shows it upright (as ImageOps.exif_transpose), and which upright axes (x, y)
# run backwards in the stored image
UPRIGHT = {2: ("FLIP_LEFT_RIGHT", (1, 0)), 3: ("ROTATE_180", (1, 1)), 4: ("FLIP_TOP_BOTTOM", (0, 1)),
           5: ("TRANSPOSE", (0, 0)), 6: ("ROTATE_270", (1, 0)), 7: ("TRANSVERSE", (1, 1)), 8: ("ROTATE_90", (0, 1))}
SCALES = (8, 4, 2, 1)  # libjpeg decodes a JPEG at 1/8, 1/4, 1/2 or full scale in the DCT domain
JPEG_FORMATS = ("JPEG", "MPO")  # MPO: a JPEG with more images after the first (a gain map)


def orientation(im) -> int:
    """An opened image's EXIF orientation (2-8: stored rotated or mirrored) from its header; 1: upright, none, or
    unreadable. A HEIC comes decoded upright and tagged 1 (pi-heif)."""
    if "exif" not in im.info:  # (a PNG's getexif() would decode the pixels to look after them)
        return 1
    try:
        tag = int(im.getexif().get(0x0112, 1))
    except Exception:  # noqa: BLE001 - a broken EXIF block: the pixels as stored
        return 1
    return tag if tag in UPRIGHT else 1


def upright_size(im) -> tuple[int, int]:
    """(width, height) of an opened image as it is shown (EXIF orientation applied)."""
    width, height = im.size
    return (height, width) if orientation(im) >= 5 else (width, height)


def shrink(box_width: float, box_height: float, out: tuple[int, int]) -> int:
    """The largest of SCALES at which the box still holds the output on both axes (1 if it does not)."""
    return next((s for s in SCALES if box_width >= s * out[0] and box_height >= s * out[1]), 1)


def decoded(im, box, out: tuple[int, int], reduce: bool = True):
    """An opened image decoded as RGB and upright: (the image, its scale s, `box` (left, top, right, bottom of the
    upright full-size image) in its coordinates). With `reduce`, a JPEG decodes at the smallest DCT scale 1/s
    (Image.draft) at which the box still holds `out`, and only down to the box's last stored row (`stored_end`,
    `first_rows`). A rotated or mirrored image comes as the part holding the box, cut before it is turned."""
    tag, (width, height), (full_width, full_height) = orientation(im), im.size, upright_size(im)
    jpeg = reduce and im.format in JPEG_FORMATS
    scale = shrink(box[2] - box[0], box[3] - box[1], out) if jpeg else 1
    request = (width // scale, height // scale) if scale > 1 else None
    if request:
        drafted = im.draft(None, request)
        scale = round(width / drafted[1][2]) if drafted else 1
    end = stored_end(tag, box, (full_width, full_height)) / scale if jpeg else math.inf
    rgb = first_rows(im, math.ceil(end), request) if end < im.size[1] else im
    rgb = rgb if rgb.mode == "RGB" else as_rgb(rgb)  # kept: as_rgb copies (a Dataset's own image stays open)
    if tag == 1:
        return rgb, scale, box if scale == 1 else tuple(v / scale for v in box)
    method, (back_x, back_y) = UPRIGHT[tag]
    w, h = rgb.size if tag < 5 else rgb.size[::-1]  # the upright image's size at this scale
    dx, dy = back_x * (w - full_width / scale), back_y * (h - full_height / scale)
    left, top, right, bottom = box[0] / scale + dx, box[1] / scale + dy, box[2] / scale + dx, box[3] / scale + dy
    x0, y0, x1, y1 = covering((left, top, right, bottom), (w, h))
    xs, ys = (w - x1, w - x0) if back_x else (x0, x1), (h - y1, h - y0) if back_y else (y0, y1)  # where it is stored
    part = (xs[0], ys[0], xs[1], ys[1]) if tag < 5 else (ys[0], xs[0], ys[1], xs[1])
    rgb = rgb if part == (0, 0, *rgb.size) else rgb.crop(part)
    return rgb.transpose(Image.Transpose[method]), scale, (left - x0, top - y0, right - x0, bottom - y0)


def covering(box, size: tuple[int, int]) -> tuple[int, int, int, int]:
    """The whole pixels (left, top, right, bottom) of an image of `size` that a real-valued box touches."""
    return math.floor(box[0]), math.floor(box[1]), min(math.ceil(box[2]), size[0]), min(math.ceil(box[3]), size[1])


def stored_end(tag: int, box, upright: tuple[int, int]) -> int:
    """Where the stored rows holding `box` of the upright image end: the box's end on the axis that runs down the stored
    image, or, where that axis runs backwards (upside down, a phone's portrait), its length less the box's start."""
    axis = 0 if tag >= 5 else 1  # a transposing orientation stores the upright x axis downwards
    return upright[axis] - box[axis] if tag != 1 and UPRIGHT[tag][1][axis] else box[2 + axis]


# first_rows paints the last row a crop needs this colour first: still this colour after the decode, it was not decoded
UNDECODED = {"RGB": (1, 254, 3), "L": 3, "CMYK": (1, 254, 3, 252)}


def first_rows(im, rows: int, request: tuple[int, int] | None):
    """An opened JPEG with only its first `rows` rows decoded: libjpeg decodes a baseline JPEG top down, so the rows
    below are never read (a progressive JPEG's scans are read whole). Where the last row is still undecoded (a broken
    header) or the file lacks its EOI marker (truncated), the image is decoded whole, failing as it would. Written by
    hand: Pillow has no call that decodes part of a JPEG."""
    fp, source = im.fp, encoded_source(im)
    if source is None or fp is None or len(im.tile) != 1 or im.tile[0][0] != "jpeg" or im.mode not in UNDECODED:
        return im  # (decoded already, or a file it cannot open again)
    at = fp.tell()
    fp.seek(-2, io.SEEK_END)
    whole = fp.read(2) == b"\xff\xd9"
    fp.seek(at)
    if not whole:
        return im
    name, (x0, y0, x1, _), offset, args = im.tile[0]
    im.im = Image.core.new(im.mode, im.size)  # its memory touched only where rows are decoded
    im.im.paste(UNDECODED[im.mode], (0, rows - 1, im.size[0], rows))  # the last row to decode
    im.tile = [(name, (x0, y0, x1, y0 + rows), offset, args)]
    try:
        im.load()
    except OSError:
        pass  # what the decoder says on stopping early; any other error is met by the whole decode below
    last = im.crop((0, rows - 1, im.size[0], rows)).tobytes()
    if last != Image.new(im.mode, (im.size[0], 1), UNDECODED[im.mode]).tobytes():
        return im
    again = open_encoded(source)
    if request:
        again.draft(None, request)
    return again


def encoded_source(image) -> str | bytes | None:
    """The file name or bytes a PIL image was opened lazily from; None once decoded (or another file)."""
    from PIL import ImageFile

    if isinstance(image, ImageFile.ImageFile) and image.tile:  # (tile: what load() has still to decode)
        if image.filename:
            return image.filename
        if isinstance(image.fp, io.BytesIO):
            return image.fp.getvalue()
    return None


def open_encoded(source):
    """An encoded image (bytes or a path) opened lazily: header read, pixels not."""
    return Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)


def as_rgb(im):
    """An image's pixels as RGB (grayscale repeated, CMYK converted, alpha dropped, palettes looked up); 16-bit
    grayscale by its top 8 bits, as a viewer shows it (Pillow's conversion clips it to white)."""
    if im.mode.startswith("I;16"):
        im = Image.fromarray((np.asarray(im) >> 8).astype(np.uint8))
    elif im.mode == "P" and "transparency" in im.info:  # the same colours; Pillow warns of each such image to RGB
        im = im.convert("RGBA")
    return im.convert("RGB")


def region(im, box, out: tuple[int, int], interpolation: str, reduce: bool = True):
    """`box` (integers) of an opened image, upright, resized to `out` with `interpolation`: at full size torchvision's
    crop and resize of the PIL image; reduced, the box of the reduced image resized by PIL's real box."""
    rgb, scale, box = decoded(im, box, out, reduce)
    resample = Image.Resampling[interpolation.upper()]
    if scale == 1:  # torchvision's TF.crop and TF.resize of a PIL image are these PIL calls
        box = tuple(map(int, box))  # (whole pixels at full size)
        if box != (0, 0, *rgb.size):
            rgb = rgb.crop(box)
        return rgb if rgb.size == out else rgb.resize(out, resample)
    left, top, right, bottom = box
    x0, y0, x1, y1 = covering(box, rgb.size)
    part = rgb.crop((x0, y0, x1, y1))
    return part.resize(out, resample, box=(left - x0, top - y0, min(right, x1) - x0, min(bottom, y1) - y0))


def open_image(source, rows, i: int):
    """Row i's PIL image from `source` (bytes or a path), lazily; one line naming the row if broken. A PIL image as it
    is."""
    from PIL import UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source
    try:
        im = open_encoded(source)
    except (UnidentifiedImageError, OSError, TypeError) as e:
        raise UserError(f"the {rows.split} split has an undecodable image at {rows.where(i)} ({first_line(e)}).") \
            from None
    return check_pixels(im, f"the {rows.split} split's image at {rows.where(i)}")


def check_pixels(im, what: str):
    """An opened image, or one line naming it when it has more than MAX_PIXELS pixels."""
    width, height = im.size
    if width * height > MAX_PIXELS:
        im.close()
        raise UserError(f"{what} is {width} x {height} pixels ({width * height / 1e6:,.0f} megapixels), more than the "
                        f"{MAX_PIXELS / 1e6:,.0f} that the data path decodes; shrink it or leave it out.")
    return im


def row_pixels(rows, i: int, im, view) -> np.ndarray:
    """view(row i's opened image), closed after; one line naming the row if its pixels do not decode."""
    try:
        with im:
            return view(im)
    except OSError as e:  # a header that reads but pixels that do not (a truncated file)
        raise UserError(f"the {rows.split} split has an undecodable image at {rows.where(i)} ({first_line(e)}).") \
            from None


def evaluation_view(size: int, recipe: CropRecipe | None, reduce: bool = True):
    """An opened image -> its (S, S, 3) evaluation view: the recipe's resize and centre crop, or the cache's resize.
    predict.py gives new images the same view."""
    return (partial(eval_view, size=size, recipe=recipe, reduce=reduce) if recipe else
            partial(square_pixels, size=size, reduce=reduce))


DEVICE_PIXELS = 2**28  # pixels decoded on the device per call (768 MiB as RGB): 21 camera photos of 12 MP, or one
# phone photo of 200 MP alone


def device_views(rows, indices, sources: list, opened: list, size: int, recipe: CropRecipe | None, boxes, mirrored,
                 device) -> torch.Tensor:
    """A batch's views decoded on `device` (--decode gpu: nvJPEG through TorchCodec's decode_jpeg, up to DEVICE_PIXELS a
    call; on a CPU its libjpeg-turbo, which the tests run), each JPEG whole and upright and cut by torchvision's tensor
    functions (`tensor_view`). Other formats, refused JPEGs and orientations TorchCodec reads otherwise go through the
    host's view. (B, S, S, 3) uint8 on `device`."""
    from torchcodec.decoders import decode_jpeg

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # this rank's GPU (Accelerate made it the current device)
        device = torch.device("cuda", torch.cuda.current_device())
    chunks, held = [[]], 0  # the batch's JPEGs in calls of at most DEVICE_PIXELS pixels (a larger one alone)
    for k, im in enumerate(opened):
        if im.format in JPEG_FORMATS:
            if chunks[-1] and held + math.prod(im.size) > DEVICE_PIXELS:
                chunks.append([])
                held = 0
            chunks[-1].append(k)
            held += math.prod(im.size)
    done = {}
    for chunk in filter(None, chunks):
        data = [torch.frombuffer(bytearray(encoded(sources[k])), dtype=torch.uint8) for k in chunk]
        try:
            done |= dict(zip(chunk, decode_jpeg(data, mode="RGB", device=device)))
        except RuntimeError:  # one the decoder refuses (a truncated file; nvJPEG's unsupported kinds): each alone
            for k, one in zip(chunk, data):
                try:
                    done[k] = decode_jpeg(one, mode="RGB", device=device)
                except RuntimeError:
                    pass  # the host's view decodes it, or says in one line why it cannot
    views = []
    for k, im in enumerate(opened):
        box, flip = (None, False) if boxes is None else (boxes[k], bool(mirrored[k]))
        pixels = done.pop(k, None)
        if pixels is not None and pixels.shape[-2:] == upright_size(im)[::-1]:  # upright, as the boxes were drawn
            im.close()
            views.append(tensor_view(pixels, size, recipe, box, flip))
            continue
        view = (partial(train_view, box=box, mirrored=flip, size=size, recipe=recipe, reduce=False) if box is not None
                else evaluation_view(size, recipe, reduce=False))
        views.append(torch.tensor(row_pixels(rows, int(indices[k]), im, view), device=device))
    return torch.stack(views)


def encoded(source, limit: int | None = None) -> bytes:
    """An encoded image's first `limit` bytes (None: all): a row's own, or its file's, read no further."""
    if isinstance(source, bytes):
        return source[:limit]
    with open(source, "rb") as f:
        return f.read(-1 if limit is None else limit)


def tensor_view(pixels: torch.Tensor, size: int, recipe: CropRecipe | None, box=None, mirrored: bool = False):
    """The host's view of an upright (3, H, W) uint8 image by torchvision's tensor functions: train_view's crop and flip
    with `box`, else evaluation_view's; (S, S, 3)."""
    import torchvision.transforms.v2.functional as TF

    mode = TF.InterpolationMode[(recipe.interpolation if recipe else "bicubic").upper()]
    if box is not None:
        top, left, height, width = map(int, box)
        out = TF.resized_crop(pixels, top, left, height, width, [size, size], mode, antialias=True)
        out = TF.horizontal_flip(out) if mirrored else out
    elif recipe is not None:
        width, height = eval_resize(pixels.shape[-1], pixels.shape[-2], size, recipe)
        out = TF.center_crop(TF.resize(pixels, [height, width], mode, antialias=True), [size, size])
    else:  # the cache's resize to S x S (bicubic; none at S x S already)
        out = pixels if pixels.shape[-2:] == (size, size) else TF.resize(pixels, [size, size], mode, antialias=True)
    return out.permute(1, 2, 0)
