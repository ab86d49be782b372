"""Camera-size photos: JPEGs decoded at the DCT scale their view needs (utils/data/pixels.py's `decoded`), phone photos'
EXIF orientation, and exact training on a folder of 4000 x 3000 JPEGs through --decode workers and stream (real jobs
through train_cifar.py, 2 gloo ranks under cpu.yaml, fp32 with --deterministic: "the same" means bitwise)."""

from __future__ import annotations

import io
import math
import struct
import warnings
import zlib

import numpy as np
import pillow_heif
import pytest
import torch
from conftest import (
    CPU_YAML,
    DEVICES,
    NEEDS_TORCHCODEC,
    PROBE,
    TORCHCODEC,
    assert_same_parameters,
    encoded_rows,
    kill_job,
    oriented_exif,
    read_summary,
    run_train,
    script_env,
    start,
    wait_for_checkpoint,
    write_upscaled_cifar,
)
from PIL import Image, ImageOps

from utils import UserError
from utils.data import pixels
from utils.data.images import EncodedImages
from utils.data.pixels import CropRecipe, as_rgb, decoded, eval_view, resized_crop_draws, square_pixels, train_view

# EXIF orientation -> how to store an upright image so that the tag shows it upright again (the inverse of the
# transpose ImageOps.exif_transpose applies; the fixture checks it with exif_transpose itself)
STORED = {1: None, 2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_90",
          7: "TRANSVERSE", 8: "ROTATE_270"}


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """A photo-like RGB image: smooth colour fields (upscaled noise) with sensor-like grain on top."""
    rng = np.random.default_rng(seed)
    fields = Image.fromarray(rng.integers(0, 255, (max(2, height // 50), max(2, width // 50), 3), dtype=np.uint8))
    smooth = np.asarray(fields.resize((width, height), Image.Resampling.BICUBIC)).astype(np.int16)
    return Image.fromarray((smooth + rng.normal(0, 10, (height, width, 1))).clip(0, 255).astype(np.uint8))


def jpeg(im: Image.Image, **options) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="JPEG", **{"quality": 90, **options})
    return buf.getvalue()


def opened(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def test_the_decode_scale_is_the_smallest_whose_crop_still_holds_the_output_size():
    """Over 60 JPEGs of random (odd and even) sizes from 37 to 997 px and 24 keyed random-resized crop draws each (and
    the whole image), output sides 8-64: the reduced image is libjpeg's ceil(W / s) x ceil(H / s), the crop's box lies
    inside it and, reduced (s > 1), is at least the output size on both axes; s is the largest of 1, 2, 4, 8 for
    which that holds (a crop at least 2s times the output on both axes decodes at 1/2s unless s is 8; a crop smaller
    than the output at full size); every scale occurs."""
    rng = np.random.default_rng(1)
    recipe, seen = CropRecipe(), set()
    for n in range(60):
        width, height, out = int(rng.integers(37, 998)), int(rng.integers(37, 998)), int(rng.choice([8, 13, 32, 64]))
        if min(width, height) < out:
            continue
        data = jpeg(photo(width, height, n), quality=75)
        boxes, _ = resized_crop_draws(n, 0, np.arange(24), [(width, height)] * 24, recipe)
        for top, left, h, w in [*boxes.tolist(), (0, 0, height, width)]:
            rgb, s, (x0, y0, x1, y1) = decoded(opened(data), (left, top, left + w, top + h), (out, out))
            seen.add(s)
            assert rgb.size == (math.ceil(width / s), math.ceil(height / s))
            assert s == 1 or (x1 - x0 >= out and y1 - y0 >= out)
            assert 0 <= x0 and 0 <= y0 and x1 <= rgb.size[0] and y1 <= rgb.size[1]
            assert s == 8 or w < 2 * s * out or h < 2 * s * out
    assert seen == {1, 2, 4, 8}


@pytest.mark.parametrize("kind", ["baseline", "progressive", "cmyk", "grayscale"])
def test_a_reduced_decode_gives_the_full_decodes_view_within_a_bound(kind):
    """A 1600 x 1200 photo-like JPEG (quality 90) decoded at 1/8 scale gives each view within a bound of the full
    decode's: 16 random-resized 64 px training crops (with flips), the evaluation view and the cache's resize to 64 x
    64 differ by at most 1.0 level of 255 on average and 16 at most (measured: 0.3-0.7 and 2-11), for baseline,
    progressive, CMYK and grayscale JPEGs alike."""
    im = photo(1600, 1200)
    data = {"baseline": lambda: jpeg(im), "progressive": lambda: jpeg(im, progressive=True),
            "cmyk": lambda: jpeg(im.convert("CMYK")), "grayscale": lambda: jpeg(im.convert("L"))}[kind]()
    recipe = CropRecipe()
    boxes, mirrored = resized_crop_draws(0, 0, np.arange(16), [(1600, 1200)] * 16, recipe)
    assert decoded(opened(data), (0, 0, 1600, 1200), (64, 64))[1] == 8
    views = {"train": lambda reduce: np.stack([train_view(opened(data), boxes[k], mirrored[k], 64, recipe, reduce)
                                               for k in range(16)]),
             "eval": lambda reduce: eval_view(opened(data), 64, recipe, reduce),
             "square": lambda reduce: square_pixels(opened(data), 64, reduce)}
    for name, view in views.items():
        difference = np.abs(view(True).astype(int) - view(False).astype(int))
        assert difference.mean() <= 1.0 and difference.max() <= 16, (name, difference.mean(), difference.max())


@pytest.mark.parametrize("device", [None, *DEVICES])
def test_a_jpeg_with_a_second_image_decodes_as_the_jpeg_it_starts_with(device):
    """A 1600 x 1200 photo saved with a second, small image after it (what Pillow opens as MPO: a phone's Ultra HDR
    gain map, a camera's depth map or preview): a batch of it gives the same training crops, evaluation view and S x S
    resize as the same photo saved as a plain JPEG, bitwise, decoded reduced on the host (at 1/8 scale, as a JPEG)
    and, with TorchCodec, on the device."""
    im = photo(1600, 1200)
    buf = io.BytesIO()
    im.save(buf, format="MPO", save_all=True, append_images=[Image.new("RGB", (160, 120), (255, 0, 0))], quality=90)
    mpo, plain = buf.getvalue(), jpeg(im)
    assert opened(mpo).format == "MPO" and decoded(opened(mpo), (0, 0, 1600, 1200), (64, 64))[1] == 8
    if device is not None and not TORCHCODEC:
        pytest.skip("needs TorchCodec")
    for recipe, key in ((CropRecipe(), (3, 1)), (CropRecipe(), None), (None, None)):
        got, want = (EncodedImages(encoded_rows([data] * 4), 64, recipe, 0, device=device).read(np.arange(4), key)[0]
                     for data in (mpo, plain))
        assert torch.equal(got.cpu(), want.cpu()), (recipe, key)


def stored(upright: Image.Image, tag: int, fmt: str) -> bytes:
    """`upright` stored as a camera with orientation `tag` stores it (a PNG: checked to show upright by PIL's
    exif_transpose). HEIF and AVIF (lossless, as far as their YCbCr allows) keep the orientation in their irot and imir
    boxes, as an iPhone's HEIC does, written by the encoders from the EXIF tag (pillow-heif, Pillow)."""
    im = upright.transpose(Image.Transpose[STORED[tag]]) if STORED[tag] else upright
    buf = io.BytesIO()
    if fmt == "HEIF":
        pillow_heif.from_pillow(im).save(buf, format="HEIF", exif=oriented_exif(tag), quality=-1, chroma=444)
        return buf.getvalue()
    options = {"JPEG": {"quality": 100, "subsampling": 0}, "AVIF": {"quality": 100}}.get(fmt, {})
    im.save(buf, format=fmt, exif=oriented_exif(tag), **options)
    shown = ImageOps.exif_transpose(Image.open(io.BytesIO(buf.getvalue())))
    assert fmt != "PNG" or np.array_equal(np.asarray(shown), np.asarray(upright))
    return buf.getvalue()


def views(data: bytes, reduce: bool) -> tuple[np.ndarray, np.ndarray]:
    """The training crop (sample 0, keyed by seed 3, epoch 1) and the evaluation view at 48 px of an image file, read
    as a --decode workers batch reads it (EncodedImages.read: the crop box drawn from the photo's shown size)."""
    rows = encoded_rows([data])
    images, first = EncodedImages(rows, 48, CropRecipe(scale=(0.25, 1.0)), 0, reduce), np.zeros(1, dtype=np.int64)
    return images.read(first, (3, 1))[0][0].numpy(), images.read(first, None)[0][0].numpy()


@pytest.mark.parametrize("reduce", [True, False], ids=["reduced", "full"])
def test_a_phone_photos_exif_orientation_is_applied_in_training_evaluation_and_prediction(reduce, tmp_path):
    """A 957 x 715 photo stored with each EXIF orientation 1-8 (its pixels transposed as a camera stores them; PIL's
    exif_transpose shows each upright): as PNGs, the training crops and evaluation views of all eight equal those of
    the upright photo bitwise, with and without reduced decoding; as JPEGs (quality 100, 4:4:4, each stored
    transposed and so encoded anew), within 0.5 levels of 255 on average of the upright JPEG's at full size (measured:
    0.06), 2.0 decoded reduced (measured: up to 1.5; 4.0-8.5 with the reduced image's part pixel on the wrong end of
    a reversed axis); as an iPhone's HEIC (lossless, the orientation in its irot and imir boxes, which libheif applies
    as it decodes) bitwise; as AVIF (quality 100; Pillow reads those boxes as an EXIF orientation) within 0.2
    (measured: 0.09; a transposed photo left unturned, or turned twice, differs by tens of levels); predict.py's view
    of each file is its evaluation view."""
    import predict

    upright = photo(957, 715, seed=5)
    for fmt, tolerance in (("PNG", 0.0), ("JPEG", 2.0 if reduce else 0.5), ("HEIF", 0.0), ("AVIF", 0.2)):
        files = [stored(upright, tag, fmt) for tag in STORED]
        seen = [views(data, reduce) for data in files]
        for k, (train, evaluation) in enumerate(seen):
            for got, want in ((train, seen[0][0]), (evaluation, seen[0][1])):
                assert np.abs(got.astype(int) - want.astype(int)).mean() <= tolerance, (fmt, k + 1)
        summary = {"image_size": 48, "eval_crop": CropRecipe.eval_crop, "interpolation": "bilinear",
                   "config": {"full_decode": not reduce}}
        for k, data in enumerate(files):
            (tmp_path / "photo").write_bytes(data)
            assert np.array_equal(predict.read_view(tmp_path / "photo", predict.run_view(summary)), seen[k][1])


@pytest.mark.parametrize("kind", ["baseline", "progressive", "cmyk", "grayscale"])
def test_a_crop_decodes_the_jpegs_rows_down_to_its_own_only_and_gives_the_pixels_of_decoding_every_row(kind,
                                                                                                        monkeypatch):
    """A 1203 x 901 photo-like JPEG stored with each EXIF orientation 1-8: 12 keyed random-resized crops each at
    32, 100 and 224 px (DCT scales 1/8 to full) are bitwise the crops of the same decode of every row, for baseline,
    progressive, CMYK and grayscale JPEGs; and a crop that lies in the stored image's top third, in a photo stored
    upright (orientation 1), upside down (3) or on its side (6, a phone's portrait photo), leaves the stored rows below
    it undecoded (each differs from the whole decode's; the rows above do not)."""
    upright, recipe = photo(1203, 901, seed=2), CropRecipe()
    upright = {"cmyk": upright.convert("CMYK"), "grayscale": upright.convert("L")}.get(kind, upright)
    boxes, mirrored = resized_crop_draws(7, 0, np.arange(12), [(1203, 901)] * 12, recipe)
    every_row = pixels.first_rows
    for tag in STORED:
        im = upright.transpose(Image.Transpose[STORED[tag]]) if STORED[tag] else upright
        data = jpeg(im, exif=oriented_exif(tag), progressive=kind == "progressive")
        for size in (32, 100, 224):
            crops = {}
            for rows in ("own", "every"):
                monkeypatch.setattr(pixels, "first_rows", every_row if rows == "own" else lambda im, *_: im)
                crops[rows] = [train_view(opened(data), boxes[k], mirrored[k], size, recipe) for k in range(12)]
            assert all(np.array_equal(a, b) for a, b in zip(crops["own"], crops["every"])), (tag, size)
    decoded_rows = []  # the stored images first_rows decodes
    monkeypatch.setattr(pixels, "first_rows", lambda *a: decoded_rows.append(every_row(*a)) or decoded_rows[-1])
    # (tag, a box of the upright image in the stored image's top third, where its stored rows end)
    for tag, box, end in ((1, (0, 0, 1203, 300), 300), (3, (0, 601, 1203, 901), 300), (6, (803, 0, 1203, 901), 400)):
        im = upright.transpose(Image.Transpose[STORED[tag]]) if STORED[tag] else upright
        data = jpeg(im, exif=oriented_exif(tag), progressive=kind == "progressive")
        decoded_rows.clear()
        assert decoded(opened(data), box, (256, 256))[1] == 1 and len(decoded_rows) == 1, tag
        rows, whole = (np.asarray(as_rgb(x)) for x in (decoded_rows[0], Image.open(io.BytesIO(data))))
        assert np.array_equal(rows[:end], whole[:end]), tag
        assert (rows[end:] != whole[end:]).any(axis=(1, 2)).all(), tag


@pytest.mark.parametrize("damage", ["truncated", "broken Huffman table"])
def test_a_truncated_or_broken_camera_jpeg_is_one_line_naming_its_row_decoded_reduced_or_full(damage):
    """A 4000 x 3000 JPEG cut after half its bytes, or with a Huffman table libjpeg refuses: reading its batch stops
    with the same one line, decoded reduced or at full size, as evaluation views and as training crops (8 crops of
    8-10% of the area; the truncated file's first crop lies in its top half, which the file holds whole)."""
    data = jpeg(photo(4000, 3000))
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:  # the first Huffman table's count of 1-bit codes, 255: its counts sum past 256
        at = data.index(b"\xff\xc4")
        data = data[:at + 5] + b"\xff" + data[at + 6:]
    recipe = CropRecipe(scale=(0.08, 0.1))
    boxes, _ = resized_crop_draws(0, 1, np.arange(8), [(4000, 3000)] * 8, recipe)
    assert boxes[0, 0] + boxes[0, 2] < 1500
    lines = []
    for reduce, key in ((True, None), (False, None), (True, (0, 1)), (False, (0, 1))):
        with pytest.raises(UserError) as error:
            EncodedImages(encoded_rows([data] * 8), 224, recipe, 0, reduce).read(np.arange(8), key)
        lines.append(str(error.value))
    assert len(set(lines)) == 1, lines
    why = "image file is truncated" if damage == "truncated" else "broken data stream"
    assert lines[0].startswith(f"the train split has an undecodable image at row 0 (OSError: {why}"), lines[0]


QUADRANTS = ((200, 30, 30), (30, 200, 30), (30, 30, 200), (220, 220, 40))  # top-left, top-right, bottom-left, -right


def quadrants(width: int, height: int) -> Image.Image:
    """An image of four flat colours, one per quadrant (QUADRANTS): cheap to make and to encode at any size."""
    im = Image.new("RGB", (width, height), QUADRANTS[0])
    for k, colour in enumerate(QUADRANTS[1:], 1):
        im.paste(colour, (width // 2 * (k % 2), height // 2 * (k // 2), width, height))
    return im


def header_only_png(width: int, height: int) -> bytes:
    """A PNG whose header says width x height, with a few bytes of pixel data: what a decompression bomb shows."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def test_a_200_megapixel_phone_photo_is_read_in_training_evaluation_and_prediction(tmp_path):
    """A 16320 x 12240 JPEG (a phone's 200-megapixel mode; Pillow's own limit refuses more than 179 megapixels) of
    four flat quadrants: read without a warning in a training batch (a 48 px crop of the keyed box), its evaluation
    view (48 px) and predict.py's view of the file; the evaluation view's four corners are the four quadrants'
    colours within 3 levels of 255, and predict.py's view is the evaluation view."""
    import predict

    path = tmp_path / "phone.jpg"
    quadrants(16320, 12240).save(path, quality=90)
    images = EncodedImages(encoded_rows([path]), 48, CropRecipe(), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow's DecompressionBombWarning included
        crop, cropped = images.read(np.arange(1), (0, 0))
        evaluation = images.read(np.arange(1), None)[0][0].numpy()
        summary = {"image_size": 48, "eval_crop": CropRecipe.eval_crop, "interpolation": "bilinear"}
        predicted = predict.read_view(path, predict.run_view(summary))
    assert cropped and crop.shape == (1, 48, 48, 3)
    corners = evaluation[[0, 0, -1, -1], [0, -1, 0, -1]].astype(int)
    assert np.abs(corners - np.array(QUADRANTS)).max() <= 3, corners
    assert np.array_equal(predicted, evaluation)


def test_an_image_whose_header_claims_more_than_max_pixels_is_one_line_in_training_prediction_and_a_dataset(tmp_path):
    """A PNG whose header says 40000 x 40000 (1,600 megapixels, more than MAX_PIXELS) stops reading it with one line
    naming it and its size, before any pixel is decoded: in a training batch, in predict.py, and as a copy's Dataset
    item."""
    import predict
    from utils.data.sources import DatasetRows

    path = tmp_path / "bomb.png"
    path.write_bytes(header_only_png(40000, 40000))
    tail = "is 40000 x 40000 pixels (1,600 megapixels), more than the 1,074 that the data path decodes; shrink it or " \
           "leave it out."
    with pytest.raises(UserError) as error:
        EncodedImages(encoded_rows([path]), 48, CropRecipe(), 0).read(np.arange(1), (0, 0))
    assert str(error.value) == f"the train split's image at {path} {tail}"
    with pytest.raises(UserError) as error:
        predict.read_view(path, predict.run_view({"image_size": 48}))
    assert str(error.value) == f"{path} {tail}"
    with pytest.raises(UserError) as error:
        DatasetRows.read([(Image.open(path), 0)], "train", "load_data()['train']", 48)
    assert str(error.value) == f"load_data()['train']'s item 0's image {tail}"


# ----------------------------------------------------------------------------------------------------
# Decoded on the device (--decode gpu)
# ----------------------------------------------------------------------------------------------------
# The device path's code is the same on a CPU (TorchCodec's libjpeg-turbo) as on a GPU (nvJPEG): the CPU runs here,
# the GPU where one is (bench/gpu_check.sh runs these tests on it), with a wider bound for nvJPEG's own IDCT.
BOUND = {"cpu": (0.01, 1), "cuda": (1.0, 16)}  # (mean, max) levels of 255 from Pillow's full decode's views


def host_and_device(data: list[bytes], size: int, recipe: CropRecipe | None, device: str, key) -> tuple:
    """A batch of encoded images read as --decode workers reads it at full size (Pillow) and as --decode gpu reads
    it on `device`: the two (B, S, S, 3) uint8 arrays."""
    rows, indices = encoded_rows(data), np.arange(len(data))
    host, cropped = EncodedImages(rows, size, recipe, 0, reduce=False).read(indices, key)
    on_device, also_cropped = EncodedImages(rows, size, recipe, 0, reduce=False, device=device).read(indices, key)
    assert cropped == also_cropped and on_device.device.type == device
    return host.numpy(), on_device.cpu().numpy()


@NEEDS_TORCHCODEC
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["baseline", "progressive", "cmyk", "grayscale", "png"])
def test_a_batch_decoded_on_the_device_gives_pillows_views_within_a_bound(kind, device):
    """A batch of 8 photo-like 1600 x 1200 images (JPEG quality 90, or PNG), read through --decode gpu's path on
    `device`: the training crops (random-resized, keyed, with flips; bilinear and bicubic), the evaluation view and
    the cache's resize to S x S equal those of the full decode by Pillow within BOUND: on a CPU at most 1 level of
    255 and 0.01 on average (measured: 0.001-0.002); PNGs (decoded by Pillow on the host, then copied) bitwise."""
    im = photo(1600, 1200)
    data = {"baseline": lambda: jpeg(im), "progressive": lambda: jpeg(im, progressive=True),
            "cmyk": lambda: jpeg(im.convert("CMYK")), "grayscale": lambda: jpeg(im.convert("L")),
            "png": lambda: png(im)}[kind]()
    mean, most = (0.0, 0) if kind == "png" else BOUND[device]
    for recipe, key in ((CropRecipe(), (3, 1)), (CropRecipe(interpolation="bicubic"), (3, 2)), (CropRecipe(), None),
                        (None, None)):
        host, on_device = host_and_device([data] * 8, 64, recipe, device, key)
        difference = np.abs(host.astype(int) - on_device.astype(int))
        assert difference.mean() <= mean and difference.max() <= most, (recipe, key, difference.mean(),
                                                                         difference.max())


@NEEDS_TORCHCODEC
@pytest.mark.parametrize("device", DEVICES)
def test_the_device_decodes_a_batchs_jpegs_in_calls_of_at_most_device_pixels_with_the_same_views(device, monkeypatch):
    """A batch of 400 x 300 (120,000 pixels) and 800 x 600 (480,000) JPEGs and a PNG, with DEVICE_PIXELS at 300,000:
    TorchCodec's decode_jpeg gets the JPEGs in batch order, in calls of at most 300,000 pixels (the 800 x 600 ones
    alone), and the views equal those of one call for the whole batch bitwise."""
    import torchcodec.decoders

    from utils.data import pixels

    sizes = [(400, 300), (400, 300), (800, 600), (400, 300), (400, 300), (400, 300), (800, 600)]
    data = [jpeg(photo(w, h, seed=k)) for k, (w, h) in enumerate(sizes)] + [png(photo(400, 300))]
    rows, indices = encoded_rows(data), np.arange(len(data))
    whole = EncodedImages(rows, 48, CropRecipe(), 0, device=device).read(indices, (3, 1))[0].cpu()
    calls, real = [], torchcodec.decoders.decode_jpeg
    monkeypatch.setattr(torchcodec.decoders, "decode_jpeg", lambda data, **kw: calls.append(len(data)) or
                        real(data, **kw))
    monkeypatch.setattr(pixels, "DEVICE_PIXELS", 300_000)
    parts = EncodedImages(rows, 48, CropRecipe(), 0, device=device).read(indices, (3, 1))[0].cpu()
    assert calls == [2, 1, 2, 1, 1]  # 240,000; 480,000; 240,000; 120,000 (with the next: 600,000); 480,000
    assert torch.equal(parts, whole)


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


@NEEDS_TORCHCODEC
@pytest.mark.parametrize("device", DEVICES)
def test_a_phone_photos_exif_orientation_is_applied_when_decoded_on_the_device(device):
    """A 957 x 715 JPEG photo stored with each EXIF orientation 1-8: decoded on the device, its training crop and
    evaluation view equal the host's full decode's (which the test above shows upright) within BOUND."""
    upright_photo = photo(957, 715, seed=5)
    files = [stored(upright_photo, tag, "JPEG") for tag in STORED]
    for recipe, key in ((CropRecipe(scale=(0.25, 1.0)), (3, 1)), (CropRecipe(scale=(0.25, 1.0)), None)):
        host, on_device = host_and_device(files, 48, recipe, device, key)
        for k in range(len(files)):
            difference = np.abs(host[k].astype(int) - on_device[k].astype(int))
            assert difference.mean() <= BOUND[device][0] and difference.max() <= BOUND[device][1], (k + 1, key)


@NEEDS_TORCHCODEC
@pytest.mark.parametrize("device", DEVICES)
def test_a_truncated_jpeg_decoded_on_the_device_is_the_same_one_line(device):
    """A 4000 x 3000 JPEG cut after half its bytes, in a batch with a whole one: the device path stops with the same
    one line as the workers' path, naming its row."""
    whole, data = jpeg(photo(400, 300)), jpeg(photo(4000, 3000))[: 1 << 19]
    with pytest.raises(UserError) as error:
        EncodedImages(encoded_rows([whole, data]), 224, CropRecipe(), 0, False, device).read(np.arange(2), None)
    assert str(error.value).startswith("the train split has an undecodable image at row 1 (OSError: image file is "
                                       "truncated")


# ----------------------------------------------------------------------------------------------------
# Exact training on camera-size JPEGs
# ----------------------------------------------------------------------------------------------------
TWO_RANKS = ["--config_file", str(CPU_YAML), "--main_process_port", "0"]
ONE_PROCESS = ["--num_processes", "1", "--cpu", "--main_process_port", "0"]
# 16 training photos, global batch 8 -> 2 optimizer steps per epoch, 3 epochs; 32 px crops (decoded at 1/8 scale)
JOB = ["--model", "resnet8", "--image-size", "32", "--augment", "resized-crop", "--batch-size", "4",
       "--global-batch-size", "8", "--epochs", "3", "--checkpoint-every-steps", "2", "--lr", "0.01", "--grad-clip",
       "0", "--no-channels-last", "--deterministic", "--tracker", "none"]


@pytest.fixture(scope="module")
def camera_photos(cifar_dir, tmp_path_factory):
    """16 training and 4 test photos of 4000 x 3000 (CIFAR-10 upscaled, JPEG quality 90; every third stored sideways
    with EXIF orientation 6) in 2 train-*.parquet shards and a test file: read through datasets' table (--decode
    workers) or streamed (--decode stream)."""
    return write_upscaled_cifar(tmp_path_factory.mktemp("camera"), cifar_dir, n_train=16, n_test=4,
                                sizes=((4000, 3000),), parquet_shards=2, photos=3)


@pytest.mark.slow
@pytest.mark.parametrize("decode", ["workers", "stream"])
def test_camera_photos_train_exactly_on_any_process_count_and_after_kill_9(camera_photos, decode, tmp_path):
    """On 4000 x 3000 JPEGs cropped to 32 px (--decode workers through datasets' table, --decode stream from the same
    parquet shards), fp32, `--deterministic`: a 2-rank job (2 loader workers each) killed with kill -9 after its step-2
    checkpoint (held at step 3 until killed) and resumed with --resume auto ends with the uninterrupted 2-rank run's
    trainable parameters bitwise; through workers, so does 1 process x 1 worker (2 accumulation steps). (A stream's
    order is planned for its layout: docs/data.md.)"""
    def job(out, *extra):
        return ["--data-dir", str(camera_photos), "--decode", decode, "--output-dir", str(out), *JOB, *extra]

    two, one, killed = tmp_path / "two", tmp_path / "one", tmp_path / "killed"
    runs = ((two, TWO_RANKS, "2"), (one, ONE_PROCESS, "1")) if decode == "workers" else ((two, TWO_RANKS, "2"),)
    for out, launch, workers in runs:
        result = run_train(job(out, "--data-workers", workers), launch=launch)
        assert result.returncode == 0, result.stderr[-4000:]
        assert read_summary(out)["global_step"] == 6 and read_summary(out)["dataset"]["decode"] == decode
    if decode == "workers":
        assert (read_summary(one)["grad_accum"], read_summary(two)["world_size"]) == (2, 2)
        assert_same_parameters(one, two)
    proc = start(job(killed, "--data-workers", "2"), TWO_RANKS, script=PROBE, env=script_env(PROBE_HOLD_AT_STEP="3"))
    wait_for_checkpoint(killed, proc, 2)
    kill_job(proc)
    result = run_train(job(killed, "--data-workers", "2", "--resume", "auto"), launch=TWO_RANKS)
    assert result.returncode == 0, result.stderr[-4000:]
    assert read_summary(killed)["resumed_from"].endswith("step-00000002")
    assert_same_parameters(killed, two)
