"""The data path in one process: decoding, the cache, the batched dataset and on-device augmentation."""

from __future__ import annotations

import io
import os
import re
import stat
import time
from types import SimpleNamespace

import numpy as np
import pillow_heif
import pytest
import torch
from accelerate import Accelerator
from conftest import (
    CIFAR_CLASSES,
    DEVICES,
    digests,
    encoded_rows,
    export_png_folder,
    small_tmpfs,
    write_cifar_dir,
    write_image_folder,
    write_mixed_folder,
    write_parquet,
)
from PIL import Image

from utils import UserError
from utils.data import decode, loaders, sources
from utils.data.decode import default_cache_dir, load_source
from utils.data.draws import Draws, Mixing, augment_draws, crop_padding, erase_draws, forward_seed, mix_draws
from utils.data.images import WORKER_START
from utils.data.loaders import make_loader
from utils.data.stream import find_shards
from utils.data.transform import BatchTransform

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # per channel, CIFAR-10's training images, in [0, 1]

@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def test_decoded_tensors_equal_pil_decoding_of_the_parquet_rows(cifar_dir, cache_dir, accelerator):
    import pyarrow.parquet as pq

    data = load_source(str(cifar_dir), cache_dir=str(cache_dir))
    train_file = sorted(cifar_dir.glob("train-*.parquet"))[0]
    table = pq.read_table(train_file).slice(0, 50)
    images, labels = data["train"]
    assert images.dtype == torch.uint8 and images.shape[1:] == (3, 32, 32)
    assert len(images) == pq.read_metadata(train_file).num_rows
    for i, row in enumerate(table.to_pylist()):
        expected = np.array(Image.open(io.BytesIO(row["img"]["bytes"]))).transpose(2, 0, 1)
        assert torch.equal(images[i], torch.from_numpy(expected))
        assert labels[i].item() == row["label"]


def test_the_decoded_cache_gets_the_mode_the_umask_gives_any_new_file(tmp_path, accelerator):
    """A cache in a cluster's shared data folder must be readable by the other users (mkstemp alone makes 0600)."""
    src = write_cifar_dir(tmp_path / "src", n_train=40, n_test=12)
    for umask, expected in [(0o022, 0o644), (0o007, 0o660)]:
        cache = tmp_path / f"cache-{umask:o}"
        old = os.umask(umask)
        try:
            load_source(str(src), cache_dir=str(cache))
        finally:
            os.umask(old)
        (written,) = cache.glob("images-*.safetensors")
        assert stat.S_IMODE(written.stat().st_mode) == expected, oct(written.stat().st_mode)


def test_second_load_reads_the_cache_and_a_changed_source_is_decoded_again(tmp_path, accelerator, monkeypatch):
    src = write_cifar_dir(tmp_path / "src", n_train=40, n_test=12)
    cache = tmp_path / "cache"
    first = load_source(str(src), cache_dir=str(cache))
    assert len(list(cache.glob("images-*.safetensors"))) == 1

    calls = []
    real_decode = decode.decode_all
    monkeypatch.setattr(decode, "decode_all", lambda rows, *rest: calls.extend(rows) or real_decode(rows, *rest))
    second = load_source(str(src), cache_dir=str(cache))
    assert calls == []  # served from the cache
    assert all(torch.equal(a, b) for s in ("train", "test") for a, b in zip(first[s], second[s]))
    assert all(d[s][0].is_contiguous(memory_format=torch.channels_last)
               for d in (first, second) for s in ("train", "test"))

    write_cifar_dir(src, n_train=48, n_test=12)  # replace the source files
    third = load_source(str(src), cache_dir=str(cache))
    assert calls == ["train", "test"]
    assert len(third["train"][1]) == 48
    assert len(list(cache.glob("images-*.safetensors"))) == 2


def _mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose memory map holds the tensor's first byte (from /proc/self/maps), None for anonymous memory."""
    address = tensor.data_ptr()
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        start, end = (int(a, 16) for a in fields[0].split("-"))
        if start <= address < end:
            return fields[5].strip() if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def test_every_process_reads_the_images_through_a_memory_map_of_the_cache_file_even_the_one_that_decoded(
        tmp_path, accelerator):
    """Every process, the decoding one included, reads the images through a memory map of the one cache file. No
    process holds a copy of the images: the page cache holds them once per machine, and a dataset larger than memory
    is read from disk. The decoding process too maps the file it wrote (it decoded into the map)."""
    src = write_cifar_dir(tmp_path / "src", n_train=40, n_test=12)
    decoded = load_source(str(src), cache_dir=str(tmp_path / "cache"))  # the first run: decodes
    (cache,) = (tmp_path / "cache").glob("images-*.safetensors")
    read = load_source(str(src), cache_dir=str(tmp_path / "cache"))  # a later run or another process: reads
    for data in (decoded, read):
        for split in ("train", "test"):
            assert _mapped_file(data[split][0]) == str(cache), split
    assert _mapped_file(torch.zeros(1 << 20, dtype=torch.uint8)) is None  # the check tells anonymous memory apart
    train = make_loader(*read["train"], batch_size=8, train=True).dataset  # and the loader keeps the map, no copy
    assert _mapped_file(train.images.tensor) == str(cache)


def test_a_cache_folder_that_cannot_be_written_decodes_into_a_temporary_file_and_says_so(tmp_path, accelerator,
                                                                                          capsys):
    """A read-only filesystem (root could write into a folder without write bits): the images are decoded into a
    temporary file that is deleted once mapped; the folder stays empty and the next run decodes again."""
    src = write_cifar_dir(tmp_path / "src", n_train=40, n_test=12)
    expected = load_source(str(src), cache_dir=str(tmp_path / "writable"))
    with small_tmpfs(tmp_path / "read-only", "1m,ro") as folder:
        data = load_source(str(src), cache_dir=str(folder))
        said = capsys.readouterr().out
        assert f"warning: cache folder {folder} is not writable; decoding into a temporary file" in said
        assert list(folder.iterdir()) == []
    for split in ("train", "test"):
        assert torch.equal(data[split][0], expected[split][0]) and torch.equal(data[split][1], expected[split][1])
        assert _mapped_file(data[split][0]).endswith(".tmp (deleted)")  # mapped, not copied; gone from the disk


def test_any_number_of_decode_workers_writes_the_same_cache_file_byte_for_byte(tmp_path, accelerator, monkeypatch):
    """1, 2 or 3 decode workers write the same cache file, byte for byte. An image folder without a test split:
    shuffled and held out by row orders before decoding, decoded in chunks of 16 rows by this process (1 worker) or
    by more than one and at most 2 or 3 worker processes (a pool hands chunks to whichever worker is idle, so not
    every worker need take one; each chunk here takes at least 0.1 s, so a second worker started within a second
    does)."""
    parquet = load_source(str(write_cifar_dir(tmp_path / "src", n_train=200, n_test=8)), cache_dir=str(tmp_path / "c0"))
    export_png_folder(tmp_path / "folder", {"train": parquet["train"]})
    monkeypatch.setattr(decode, "DECODE_CHUNK", 16)
    pids = tmp_path / "pids.txt"
    real = decode._decode_rows

    def recorded(*args):  # runs in the workers: each appends its pid to a file
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.1)  # a chunk outlasts a forked worker's start, even on a busy machine
        return real(*args)

    monkeypatch.setattr(decode, "_decode_rows", recorded)
    files, seen = [], []
    for workers in (1, 2, 3):
        pids.write_text("")
        data = load_source(str(tmp_path / "folder"), cache_dir=str(tmp_path / f"c{workers}"), decode_workers=workers)
        assert (len(data["train"][1]), len(data["test"][1])) == (180, 20)  # 0.1 held out
        assert digests(torch.cat([data["train"][0], data["test"][0]]), torch.cat([data["train"][1],
                       data["test"][1]])) == digests(*parquet["train"])  # the same (image, label) pairs
        (cache,) = (tmp_path / f"c{workers}").glob("images-*.safetensors")
        files.append(cache.read_bytes())
        seen.append(set(pids.read_text().split()))
    assert files[1] == files[0] and files[2] == files[0]
    assert seen[0] == {str(os.getpid())} and len(seen[1]) == 2 and 2 <= len(seen[2]) <= 3
    assert str(os.getpid()) not in seen[1] | seen[2]


def test_an_undecodable_image_stops_a_parallel_decode_with_the_first_bad_rows_line(tmp_path, accelerator,
                                                                                   monkeypatch):
    write_image_folder(tmp_path / "folder", [f"c{k}" for k in range(6)])
    noise = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(noise, format="PNG")
    for k in (1, 4):  # two truncated files (their headers read) in different chunks: the one met first is named
        (tmp_path / "folder" / "train" / f"c{k}" / "0.png").write_bytes(noise.getvalue()[:1500])
    monkeypatch.setattr(decode, "DECODE_CHUNK", 1)
    messages = []
    for workers in (1, 3):
        with pytest.raises(UserError, match=r"^the train split has an undecodable image at .*/c[14]/0\.png \(OSError: "
                                            r"image file is truncated\)\.$") as e:
            load_source(str(tmp_path / "folder"), cache_dir=str(tmp_path / f"cache{workers}"), decode_workers=workers)
        messages.append(str(e.value))
        assert not list((tmp_path / f"cache{workers}").glob("*"))  # no cache, no temporary file
    assert messages[0] == messages[1]


def test_truncated_cache_is_ignored_and_rewritten(tmp_path, accelerator, capsys):
    src = write_cifar_dir(tmp_path / "src", n_train=20, n_test=10)
    cache = tmp_path / "cache"
    good = load_source(str(src), cache_dir=str(cache))["train"][0].clone()  # a copy: the tensor maps the file,
    (path,) = cache.glob("images-*.safetensors")  # and reading a map past the end of a truncated file is SIGBUS
    path.write_bytes(path.read_bytes()[:100])
    capsys.readouterr()
    again = load_source(str(src), cache_dir=str(cache))
    assert f"warning: ignoring unreadable cache {path} (" in capsys.readouterr().out
    assert torch.equal(again["train"][0], good)
    assert path.stat().st_size > 100


def test_cache_goes_next_to_the_data_when_writable_else_to_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    writable = tmp_path / "data"
    writable.mkdir()
    assert default_cache_dir(str(writable)) == writable / ".decoded"
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / ".decoded").write_text("a file where the cache folder would go")
    assert default_cache_dir(str(blocked)) == tmp_path / "xdg" / "accelerate-cifar"
    read_only = tmp_path / "read_only"  # like ../shared in CI: no write bits (root could still write)
    read_only.mkdir()
    read_only.chmod(0o555)
    assert default_cache_dir(str(read_only)) == tmp_path / "xdg" / "accelerate-cifar"
    assert not (read_only / ".decoded").exists()
    assert default_cache_dir(None) == tmp_path / "xdg" / "accelerate-cifar"


def test_prepared_loader_yields_whole_uint8_batches_covering_the_epoch(accelerator):
    images = torch.arange(103, dtype=torch.uint8).view(-1, 1, 1, 1).expand(-1, 3, 32, 32).contiguous()
    labels = torch.arange(103) % 10
    train = accelerator.prepare(make_loader(images, labels, batch_size=10, train=True))
    seen = []
    for epoch in range(2):
        train.set_epoch(epoch)
        batches = list(train)
        assert len(batches) == 10 and all(x.shape == (10, 3, 32, 32) and x.dtype == torch.uint8 for x, _, _ in batches)
        # augment off: no crop, flip, mixing or erasing; the forward's seed only, from each batch's first sample
        first = [int(x[0, 0, 0, 0]) for x, _, _ in batches]
        assert [(d.flip_crop, d.mixing, d.erasing) for _, _, d in batches] == [(None, None, None)] * 10
        assert [d.forward for _, _, d in batches] == [forward_seed(0, epoch, [i]) for i in first]
        order = torch.cat([x[:, 0, 0, 0] for x, _, _ in batches]).tolist()
        assert all(torch.equal(y, x[:, 0, 0, 0].long() % 10) for x, y, _ in batches)  # labels stay with images
        assert len(set(order)) == 100  # no repeats; the last 3 of 103 are dropped (whole batches only)
        seen.append(order)
    assert seen[0] != seen[1]  # reshuffled per epoch
    # a global batch of 30 (e.g. 10 x 3 accumulation steps): only whole ones, 90 images, the same permutation's prefix
    steps = accelerator.prepare(make_loader(images, labels, batch_size=10, train=True, global_batch=30))
    steps.set_epoch(1)
    assert torch.cat([x[:, 0, 0, 0] for x, _, _ in steps]).tolist() == seen[1][:90]
    evaluation = accelerator.prepare(make_loader(images, labels, batch_size=10, train=False))
    assert torch.cat([x[:, 0, 0, 0] for x, _ in evaluation]).tolist() == list(range(103))
    pixels = torch.randint(0, 256, (103, 3, 32, 32), dtype=torch.uint8)  # NCHW in; batches come out channels-last
    batches = [x for x, _ in accelerator.prepare(make_loader(pixels, labels, batch_size=10, train=False))]
    assert torch.equal(torch.cat(batches), pixels)
    assert all(x.is_contiguous(memory_format=torch.channels_last) for x in batches)


def _all_crops(image: torch.Tensor, pad: int = 4) -> list[torch.Tensor]:
    """Index y * 9 + x: the crop at offset (y, x) of the zero-padded image; 81 + that: its mirror image."""
    padded = torch.nn.functional.pad(image, (pad, pad, pad, pad))
    crops = [padded[:, y:y + 32, x:x + 32] for y in range(2 * pad + 1) for x in range(2 * pad + 1)]
    return crops + [c.flip(-1) for c in crops]


def _on(device, draws):
    return tuple(d.to(device) for d in draws)


@pytest.mark.parametrize("device", DEVICES)
def test_crop_and_flip_gives_each_image_exactly_its_drawn_crop_or_that_crops_mirror(device):
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, generator=gen)
    transform = BatchTransform(torch.device(device), channels_last=False, mean=MEAN, std=STD)
    mirrored, crop = augment_draws(seed=1, epoch=0, indices=range(100, 164), pad=4)
    out = transform.crop_and_flip(images.to(device), _on(device, (mirrored, crop))).cpu()
    for i, (src, got) in enumerate(zip(images, out, strict=True)):
        hits = [k for k, c in enumerate(_all_crops(src)) if torch.equal(c, got)]
        dy, dx = divmod(int(crop[i]), 9)
        # mirroring the padded image, then cropping at (dy, dx), is the mirror of the crop at (dy, 8 - dx)
        want = 81 + dy * 9 + (8 - dx) if i in mirrored else dy * 9 + dx
        assert hits == [want], (i, hits, want)
    assert 10 < len(mirrored) < 54 and len(set(crop.tolist())) > 20  # both kinds, and offsets vary in the batch


@pytest.mark.parametrize("device", DEVICES)
def test_each_image_is_mirrored_with_probability_half_and_shifted_uniformly(device):
    # Pixel values name their coordinates: channel 0 = row + 1, channel 1 = column + 1. The centre pixel of a
    # crop then tells the shift, and its right-hand neighbour tells whether the crop is mirrored.
    r = torch.arange(1, 33, dtype=torch.uint8)
    image = torch.stack([r.view(32, 1).expand(32, 32), r.view(1, 32).expand(32, 32),
                         torch.zeros(32, 32, dtype=torch.uint8)])
    batch = image.expand(64, 3, 32, 32).to(device)
    transform = BatchTransform(torch.device(device), channels_last=True, mean=MEAN, std=STD)
    # 50 batches of 64 consecutive sample indices, as the draws of one epoch of 3,200 images (seed 3, epoch 2)
    outs = [transform.crop_and_flip(batch, _on(device, augment_draws(3, 2, range(64 * k, 64 * k + 64), 4)))
            .to("cpu", copy=True) for k in range(50)]  # each call reuses its buffer
    outs = torch.stack(outs).long()  # (50, 64, 3, 32, 32)
    mirrored = outs[:, :, 1, 16, 17] < outs[:, :, 1, 16, 16]
    dy = outs[:, :, 0, 16, 16] - 13  # row 16 of the crop = padded row 16 + dy = image row 12 + dy
    dx = torch.where(mirrored, outs[:, :, 1, 16, 16] - 12, outs[:, :, 1, 16, 16] - 13)
    assert abs(mirrored.float().mean().item() - 0.5) < 0.035  # 3,200 images: 4 standard errors
    by_position = mirrored.float().mean(0)  # the same law at every position of the batch
    assert 0.3 < by_position[:8].mean() < 0.7 and 0.3 < by_position[-8:].mean() < 0.7
    for shift in (dy, dx):
        counts = torch.bincount(shift.flatten(), minlength=9)
        assert len(counts) == 9 and counts.min() > 250 and counts.max() < 460  # uniform over 0..8: 356 each


def test_normalised_output_and_draws_keyed_by_seed_epoch_and_index_whatever_batch_they_come_in():
    images = torch.randint(0, 256, (32, 3, 32, 32), dtype=torch.uint8)
    transform = BatchTransform(torch.device("cpu"), channels_last=True, mean=MEAN, std=STD)
    plain = transform(images)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD).view(1, 3, 1, 1) * 255
    assert torch.allclose(plain, (images.float() - mean) / std, rtol=0, atol=1e-6)  # x * (1/std) - mean/std, rounded
    assert plain.is_contiguous(memory_format=torch.channels_last)

    def by_index(seed, epoch, indices):
        mirrored, crop = augment_draws(seed, epoch, indices, pad=4)
        return {i: (k in mirrored, int(crop[k])) for k, i in enumerate(indices)}

    alone = by_index(5, 0, list(range(40)))
    assert by_index(5, 0, [39, 7, 20]) == {i: alone[i] for i in (39, 7, 20)}  # another batch, order or rank: same
    assert sum(by_index(6, 0, list(range(40)))[i] != alone[i] for i in alone) > 30  # another seed: other draws
    assert sum(by_index(5, 1, list(range(40)))[i] != alone[i] for i in alone) > 30  # another epoch: other draws
    augmented = transform(images, augment_draws(5, 0, range(32), 4))
    assert not torch.equal(augmented, plain) and augmented.shape == plain.shape


@pytest.mark.cuda
def test_the_transform_on_cuda_gives_the_cpu_outputs_for_the_same_draws():
    """Same images, same draws: CUDA's crops are the CPU's byte for byte, through every op the transform runs there
    (index_select on the unfold view with out=, index_copy, flip, non-contiguous copies), and the normalised floats
    agree to rounding. Batches of two sizes, so the canvas is rebuilt once."""
    gen = torch.Generator().manual_seed(0)
    cpu = BatchTransform(torch.device("cpu"), channels_last=True, mean=MEAN, std=STD)
    cuda = BatchTransform(torch.device("cuda"), channels_last=True, mean=MEAN, std=STD)
    for n in (128, 128, 37):
        images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=gen)
        images = images.contiguous(memory_format=torch.channels_last)  # as the loader delivers them
        draws = augment_draws(4, n, range(n), 4)
        on_cpu = cpu.crop_and_flip(images, draws).clone()
        on_cuda = cuda.crop_and_flip(images.cuda(non_blocking=True), _on("cuda", draws))
        assert torch.equal(on_cuda.cpu(), on_cpu)
        assert 0 < len(draws[0]) < n  # some mirrored, some not
        assert torch.allclose(cuda(on_cuda).cpu(), cpu(on_cpu), rtol=0, atol=1e-5)


def test_decoding_needs_no_network(tmp_path, accelerator, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = write_cifar_dir(tmp_path / "src", n_train=10, n_test=10, fmt="JPEG")
    data = load_source(str(src), cache_dir=str(tmp_path / "cache"))
    assert data["test"][0].shape == (10, 3, 32, 32)
    assert os.listdir(tmp_path / "cache")


def test_a_training_split_smaller_than_one_global_batch_stops_with_one_sentence():
    loaders.check_one_batch(torch.zeros(128), batch_size=32, processes=2, accumulation=2)  # exactly one: fine
    with pytest.raises(UserError) as e:
        loaders.check_one_batch(torch.zeros(127), batch_size=32, processes=2, accumulation=2)
    assert str(e.value) == ("127 training images do not fill one global batch of 128 (32 on each of 2 processes x 2 "
                            "accumulation steps).")


# Image folders (train/<class>/*.png, test/<class>/...), read through datasets' imagefolder builder ---------------
def test_an_image_folder_of_cifar_pngs_decodes_to_the_parquets_tensors_and_labels(cifar_dir, cache_dir, tmp_path,
                                                                                   accelerator):
    parquet = load_source(str(cifar_dir), cache_dir=str(cache_dir))
    prefix = {"train": (parquet["train"][0][:2000], parquet["train"][1][:2000]),
              "test": (parquet["test"][0][:500], parquet["test"][1][:500])}
    export_png_folder(tmp_path / "folder", prefix, split_names={"test": "validation"})  # validation/: a test split
    folder = load_source(str(tmp_path / "folder"), cache_dir=str(tmp_path / "cache"))
    for split, (images, labels) in prefix.items():
        assert folder[split][0].shape == images.shape and folder[split][0].is_contiguous(
            memory_format=torch.channels_last)
        assert digests(*folder[split]) == digests(images, labels)  # the same (image, label) pairs, bit for bit
        # The folder lists its files class by class; decoding shuffles them once (fixed seed), so a prefix is
        # class-balanced, as in the Hub's files: each class 5-20% of the first 200 images (unshuffled: 100% airplanes)
        counts = torch.bincount(folder[split][1][:200], minlength=10)
        assert counts.min() >= 10 and counts.max() <= 40, counts.tolist()
    again = load_source(str(tmp_path / "folder"), cache_dir=str(tmp_path / "cache"))  # from the cache
    assert all(torch.equal(again[s][i], folder[s][i]) for s in ("train", "test") for i in (0, 1))
    assert len(list((tmp_path / "cache").glob("images-*.safetensors"))) == 1  # cached like a parquet source


def _folder_error(tmp_path, accelerator) -> str:
    with pytest.raises(UserError) as e:
        load_source(str(tmp_path / "folder"), cache_dir=str(tmp_path / "cache"))
    return str(e.value)


def test_image_folder_bad_input_is_named_in_one_sentence(tmp_path, accelerator):
    folder = tmp_path / "folder"
    write_image_folder(folder, CIFAR_CLASSES)
    (folder / "train" / "zebra").mkdir()
    assert _folder_error(tmp_path, accelerator) == f"the class folder {folder / 'train' / 'zebra'} holds no image " \
                                                   f"({', '.join(sources.IMAGE_SUFFIXES)})."
    (folder / "train" / "zebra").rename(folder / "test" / "zebra")
    Image.new("RGB", (32, 32)).save(folder / "test" / "zebra" / "0.png")
    assert _folder_error(tmp_path, accelerator) == f"--data-dir {folder}: test/ has classes that train/ has " \
                                                   f"not (zebra): a model trained on train/ cannot predict them."
    (folder / "test" / "zebra" / "0.png").unlink()
    (folder / "test" / "zebra").rmdir()
    broken = folder / "train" / "airplane" / "1.png"
    broken.write_bytes(b"not a png")
    message = _folder_error(tmp_path, accelerator)
    assert message.startswith(f"the train split has an undecodable image at {broken} ("), message
    broken.unlink()
    (folder / "test").rename(folder / "elsewhere")  # no test split: a part of train is held out, but never a class's
    with pytest.raises(UserError, match=r"^--val-fraction 0\.1 of 10 training images in 10 classes holds out 0 \(each "
                                        r"class its share, never its last training image\); both the training and "
                                        r"the held-out part need at least one image: give the data a test split, or "
                                        r"more images\.$"):  # only image
        load_source(str(folder), cache_dir=str(tmp_path / "cache"))
    for k, name in enumerate(CIFAR_CLASSES):
        Image.new("RGB", (32, 32), color=k * 20).save(folder / "train" / name / "1.png")
    assert load_source(str(folder), cache_dir=str(tmp_path / "cache"))["test"][0].shape == (2, 3, 32, 32)  # of 20
    with pytest.raises(UserError, match=r"^--val-fraction 0\.02 of 20 training images in 10 classes holds out 0 "):
        load_source(str(folder), cache_dir=str(tmp_path / "cache"), val_fraction=0.02)


def test_a_val_or_dev_folder_or_valid_parquet_is_the_evaluation_split_and_an_unread_folder_beside_train_is_named(
        tmp_path, accelerator, capsys):
    """ImageNet's and most image sets' layout, train/ and val/: the 30 images of val/ (or dev/) are evaluated on, each
    with its class, not 0.1 of train held out while val/ lies unread; a parquet folder's valid-*.parquet and tar
    shards *-val-*.tar likewise. The names are datasets' split keywords (a validation split's before a test split's).
    A folder beside train/ that names no split (holdout/) is named in one warning line before 0.1 of train is held
    out."""
    from datasets.data_files import SPLIT_KEYWORDS

    assert sources.EVAL_SPLITS == tuple(SPLIT_KEYWORDS["validation"] + SPLIT_KEYWORDS["test"])
    train = (torch.randint(0, 256, (60, 3, 8, 8), dtype=torch.uint8), torch.arange(60) % 3)
    held = (torch.randint(0, 256, (30, 3, 8, 8), dtype=torch.uint8), torch.arange(30) % 3)
    for name in ("val", "dev", "holdout"):
        root = tmp_path / name
        export_png_folder(root, {"train": train, "test": held}, split_names={"test": name})
        data = load_source(str(root), cache_dir=str(tmp_path / "cache"))
        said = capsys.readouterr().out
        if name == "holdout":
            assert len(data["test"][1]) == 6 and len(data["train"][1]) == 54, said  # 0.1 of each class's 20
            assert (f"warning: --data-dir {root} holds holdout/ beside train/, which is not read: an evaluation "
                    f"split's folder is named test/, validation/ or val/.") in said.splitlines()
        else:
            assert digests(*data["test"]) == digests(*held) and digests(*data["train"]) == digests(*train)
            assert "warning" not in said and sources.locate(str(root), None, None).eval_split == name
    parquet = tmp_path / "parquet"
    write_parquet(parquet / "train-00000-of-00001.parquet", 20, seed=1)
    write_parquet(parquet / "valid-00000-of-00001.parquet", 7, seed=2)
    assert len(load_source(str(parquet), cache_dir=str(tmp_path / "cache"))["test"][1]) == 7
    shards = tmp_path / "shards"  # --decode stream's shards, listed
    shards.mkdir()
    for name in ("cifar-train-0.tar", "cifar-val-0.tar"):
        (shards / name).write_bytes(b"")
    assert find_shards(str(shards)) == {split: [str(shards / f"cifar-{split}-0.tar")] for split in ("train", "val")}


def test_a_validation_split_is_evaluated_before_a_test_split_and_eval_split_names_another(tmp_path, accelerator,
                                                                                         capsys):
    """train/, val/ and test/ (Kaggle's layout: test/ holds its photos unlabelled, loose): val/ is evaluated on, each
    image with its class, and test/ is not read, a line saying how to score it at the end; --eval-split test then stops
    with the one line of a loose image, and scores test/ once it has class folders. A parquet folder with train,
    validation and test files: validation, and test by --eval-split; tar shards alike. An --eval-split the source
    lacks, --eval-split train, or --eval-split beside --val-fraction: one line each."""
    images = {split: (torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8), torch.arange(n) % 3)
              for split, n in (("train", 30), ("val", 12), ("test", 9))}
    root = tmp_path / "photos"
    export_png_folder(root, {s: images[s] for s in ("train", "val")})
    (root / "test").mkdir()
    Image.new("RGB", (8, 8)).save(root / "test" / "unlabelled.png")

    def load(**where):
        source = sources.locate(str(root), None, where.get("val_fraction"), where.get("eval_split"))
        return load_source(str(root), cache_dir=str(tmp_path / "cache"), source=source)

    capsys.readouterr()
    assert digests(*load()["test"]) == digests(*images["val"])
    assert ("evaluating on the val split; test left for a final score: evaluate_checkpoint.py RUN/best.safetensors "
            "--eval-split test") in capsys.readouterr().out.splitlines()
    with pytest.raises(UserError, match=rf"^{root / 'test' / 'unlabelled.png'} is not in a class folder"):
        load(eval_split="test")
    (root / "test" / "unlabelled.png").unlink()
    export_png_folder(root, {"test": images["test"]})
    assert digests(*load(eval_split="test")["test"]) == digests(*images["test"])
    assert "left for a final score" not in capsys.readouterr().out  # the split named: no advice on the others
    for where, said in ((dict(eval_split="holdout"), f"--eval-split holdout: --data-dir {root} holds no holdout/ "
                                                     f"folder beside train/."),
                        (dict(eval_split="train"), "--eval-split train: the training split is trained on; name the "
                                                   "source's evaluation split (validation, test, ...), or hold a part "
                                                   "of train out with --val-fraction."),
                        (dict(eval_split="test", val_fraction=0.2), "pass either --eval-split (test, a split of the "
                                                                    "source) or --val-fraction (0.2, a part of train "
                                                                    "held out), not both.")):
        with pytest.raises(UserError) as e:
            load(**where)
        assert str(e.value) == said
    parquet = tmp_path / "parquet"
    for split, (n, seed) in {"train": (20, 1), "validation": (7, 2), "test": (5, 3)}.items():
        write_parquet(parquet / f"{split}-00000-of-00001.parquet", n, seed=seed)
    for eval_split, n in ((None, 7), ("test", 5)):
        source = sources.locate(str(parquet), None, None, eval_split)
        assert len(load_source(str(parquet), cache_dir=str(tmp_path / "cache"), source=source)["test"][1]) == n
    shards = tmp_path / "shards"  # --decode stream's shards, listed: the validation shard, or the one named
    shards.mkdir()
    for split in ("train", "val", "test"):
        (shards / f"cifar-{split}-0.tar").write_bytes(b"")
    for eval_split, chosen in ((None, "val"), ("test", "test")):
        assert find_shards(str(shards), eval_split=eval_split) == {s: [str(shards / f"cifar-{s}-0.tar")]
                                                                   for s in ("train", chosen)}


def test_a_folder_of_class_folders_alone_is_the_train_split_with_a_part_held_out_by_class(tmp_path, accelerator):
    """torchvision's ImageFolder layout, <class>/*.png with no train/ (datasets reads it as the train split): its 90
    images are read, each with its class, 0.1 of each class's 30 held out for evaluation (3 each, 81 trained on), the
    two parts disjoint and together every image. A folder holding test/ but no train/ stops with one line pointing at
    predict.py; an empty train/ with one line naming it."""
    images = (torch.randint(0, 256, (90, 3, 8, 8), dtype=torch.uint8), torch.arange(90) % 3)
    export_png_folder(tmp_path / "photos", {"all": images}, split_names={"all": "."})
    data = load_source(str(tmp_path / "photos"), cache_dir=str(tmp_path / "cache"))
    assert data["classes"] == tuple(CIFAR_CLASSES[:3])
    assert torch.bincount(data["test"][1]).tolist() == [3, 3, 3] and len(data["train"][1]) == 81
    assert sorted(digests(*data["train"]) + digests(*data["test"])) == digests(*images)
    (tmp_path / "photos" / "test").mkdir()
    with pytest.raises(UserError, match=rf"^--data-dir {tmp_path / 'photos'} holds test/ but no train/ beside it: "
                                        rf"training reads train/<class>/\.\.\.; a trained run scores a folder of class "
                                        rf"folders with predict\.py RUN {tmp_path / 'photos' / 'test'} --output"):
        load_source(str(tmp_path / "photos"), cache_dir=str(tmp_path / "cache"))
    (tmp_path / "photos" / "test").rename(tmp_path / "photos" / "train")
    with pytest.raises(UserError, match=rf"^{tmp_path / 'photos' / 'train'} holds no class folder: "):
        load_source(str(tmp_path / "photos"), cache_dir=str(tmp_path / "cache"))


def test_evaluation_images_that_are_training_images_pixel_for_pixel_are_counted_and_the_first_named(
        tmp_path, cifar_dir, cache_dir, capsys):
    """An image folder whose test/ holds, beside 12 new PNGs, a byte copy of one training PNG and the same pixels as
    another saved as BMP: one warning line counts 2 of the 15 evaluation images and names the first pair of files, on
    the decoding run and again from the cache; a copy resized by one pixel is not counted. The folder without those
    copies, and the 50,000 + 10,000 images of the real CIFAR-10 copy (where the tests have it), get no such line."""
    rng = torch.Generator().manual_seed(0)
    pairs = {split: (torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=rng), torch.arange(n) % 2)
             for split, n in (("train", 40), ("test", 12))}
    export_png_folder(tmp_path / "photos", pairs)
    clean = load_source(str(tmp_path / "photos"), image_size=8, cache_dir=str(tmp_path / "cache"))
    assert "pixel for pixel" not in capsys.readouterr().out and len(clean["test"][1]) == 12
    train, test = tmp_path / "photos" / "train", tmp_path / "photos" / "test"
    (test / "airplane" / "copy.png").write_bytes((train / "airplane" / "00004.png").read_bytes())
    Image.open(train / "automobile" / "00007.png").save(test / "automobile" / "same.bmp")
    Image.open(train / "automobile" / "00009.png").resize((8, 9)).save(test / "automobile" / "taller.png")
    copies = [(test / "airplane" / "copy.png", train / "airplane" / "00004.png"),  # the first: in the rows' order
             (test / "automobile" / "same.bmp", train / "automobile" / "00007.png")]
    for run in ("decodes", "reads the cache"):
        data = load_source(str(tmp_path / "photos"), image_size=8, cache_dir=str(tmp_path / "cache"))
        said = [line for line in capsys.readouterr().out.splitlines() if "pixel for pixel" in line]
        assert said in ([f"warning: 2 of the 15 evaluation images are also training images, pixel for pixel (the "
                         f"first: {copy} and {original}); the evaluation counts them as unseen."]
                        for copy, original in copies), run
    assert len(data["test"][1]) == 15
    load_source(str(cifar_dir), cache_dir=str(cache_dir))
    assert "pixel for pixel" not in capsys.readouterr().out


def test_evaluation_files_that_are_training_files_byte_for_byte_are_counted_without_the_cache(tmp_path, cifar_dir,
                                                                                                 capsys):
    """Without the cache (--decode workers: no pixel digests), an image folder whose test/ holds, beside 12 new PNGs,
    byte copies of two training PNGs and of a 64 x 64 BMP: one warning line counts 3 of the 17 evaluation images and
    names the first pair of files (one copy left: "1 of the 15 ... is also a training image"). The same pixels saved
    as BMP, and a BMP of the same size whose first 4 KB equal a training BMP's but whose pixels differ after them, are
    not counted. A table's cells of bytes are compared alike: an evaluation row equal to two training rows is paired
    with the first. The folder without copies, and the real CIFAR-10 copy (where the tests have it), get no such
    line."""
    from utils.data.builtin import load_encoded

    rng = torch.Generator().manual_seed(0)
    pairs = {split: (torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=rng), torch.arange(n) % 2)
             for split, n in (("train", 40), ("test", 12))}
    export_png_folder(tmp_path / "photos", pairs)
    assert len(load_encoded(str(tmp_path / "photos"), image_size=8)["test"][1]) == 12
    assert "byte for byte" not in capsys.readouterr().out
    train, test = tmp_path / "photos" / "train", tmp_path / "photos" / "test"
    big = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(big).save(train / "airplane" / "big.bmp")
    big[0, 0] ^= 255  # a BMP stores its rows bottom-up: the top row is at its end
    Image.fromarray(big).save(test / "airplane" / "other.bmp")
    original, other = (train / "airplane" / "big.bmp").read_bytes(), (test / "airplane" / "other.bmp").read_bytes()
    assert len(original) == len(other) > 4096 and original[:4096] == other[:4096] and original != other
    copies = [(test / "airplane" / "copy.png", train / "airplane" / "00004.png"),
              (test / "automobile" / "copy.png", train / "automobile" / "00007.png"),
              (test / "airplane" / "big.bmp", train / "airplane" / "big.bmp")]
    for copy, source in copies:
        copy.write_bytes(source.read_bytes())
    Image.open(train / "automobile" / "00009.png").save(test / "automobile" / "same.bmp")
    data = load_encoded(str(tmp_path / "photos"), image_size=8)
    said = [line for line in capsys.readouterr().out.splitlines() if "byte for byte" in line]
    assert said in ([f"warning: 3 of the 17 evaluation images are also training images, byte for byte (the first: "
                     f"{copy} and {source}); the evaluation counts them as unseen."] for copy, source in copies)
    assert len(data["test"][1]) == 17
    (test / "airplane" / "big.bmp").unlink()
    (test / "automobile" / "copy.png").unlink()
    load_encoded(str(tmp_path / "photos"), image_size=8)
    assert [line for line in capsys.readouterr().out.splitlines() if "byte for byte" in line] == [
        f"warning: 1 of the 15 evaluation images is also a training image, byte for byte (the first: "
        f"{copies[0][0]} and {copies[0][1]}); the evaluation counts them as unseen."]
    cells = [bytes([k]) * 300 for k in range(4)]
    assert sources.byte_copies(encoded_rows([cells[0], cells[1], cells[2], cells[1]]),
                               encoded_rows([cells[3], cells[1], bytes([1]) * 299], "test")) == [(1, 1)]
    load_encoded(str(cifar_dir))
    assert "byte for byte" not in capsys.readouterr().out


def test_an_image_folder_labelled_by_a_metadata_file_reads_each_listed_image_with_its_listed_class(tmp_path,
                                                                                                      accelerator,
                                                                                                      capsys):
    """datasets' image folder with metadata: train/metadata.csv (file_name in a subfolder, a column `species`, the
    rows in shuffled order) and test/metadata.jsonl (file_name, label) name 60 and 15 PNGs of 3 classes: every image
    is read once with its listed class, the same (image, label) pairs as those PNGs in class folders give; an image
    beside them that no row names is left out with a one-line warning. A missing file, a name listed twice, a row
    without a label and a file without a label column are each one line."""
    import csv
    import json

    pairs = {split: (torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8), torch.arange(n) % 3)
             for split, n in (("train", 60), ("test", 15))}
    export_png_folder(tmp_path / "folders", pairs)
    reference = load_source(str(tmp_path / "folders"), cache_dir=str(tmp_path / "cache"))
    flat = tmp_path / "flat"
    for split, (images, labels) in pairs.items():
        rows = []
        for k in torch.randperm(len(labels), generator=torch.Generator().manual_seed(0)).tolist():
            name = f"pics/{k:03d}.png" if split == "train" else f"{k:03d}.png"
            (flat / split / name).parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[k].permute(1, 2, 0).numpy()).save(flat / split / name)
            rows.append((name, CIFAR_CLASSES[int(labels[k])]))
        if split == "train":
            with open(flat / split / "metadata.csv", "w", newline="") as f:
                csv.writer(f).writerows([("file_name", "species"), *rows])
        else:
            (flat / split / "metadata.jsonl").write_text("".join(json.dumps({"file_name": n, "label": c}) + "\n"
                                                                 for n, c in rows))
    Image.new("RGB", (8, 8)).save(flat / "train" / "pics" / "unlisted.png")
    data = load_source(str(flat), cache_dir=str(tmp_path / "cache"))
    assert data["classes"] == reference["classes"] == tuple(CIFAR_CLASSES[:3])
    for split, (images, labels) in pairs.items():
        assert digests(*data[split]) == digests(*reference[split]) == digests(images, labels)
    assert f"warning: 1 image in {flat / 'train'} is not named in metadata.csv: left out." in capsys.readouterr().out
    listing = flat / "train" / "metadata.csv"
    text = listing.read_text()
    first = text.splitlines()[1].split(",")[0]
    for broken, line in ((text.replace(first, "pics/gone.png"), f"{listing} names 1 file not in {flat / 'train'} "
                                                                f"(the first: pics/gone.png)."),
                         (text + f"{first},bird\n", f"{listing} names {first} more than once."),
                         (text + "pics/unlisted.png,\n", f"{listing} names pics/unlisted.png without a species."),
                         (text.replace("species", "kind").replace("file_name", "file_name,other", 1),
                          f"{listing} has columns ['file_name', 'other', 'kind']; expected file_name and a label "
                          f"column named 'label' or 'labels' or 'fine_label'.")):
        listing.write_text(broken)
        with pytest.raises(UserError) as e:
            load_source(str(flat), cache_dir=str(tmp_path / "cache"))
        assert str(e.value) == line


def test_an_image_folder_names_its_classes_from_its_folders(tmp_path, accelerator):
    write_image_folder(tmp_path / "folder", ("dogs", "cats", "birds"))
    data = load_source(str(tmp_path / "folder"), cache_dir=str(tmp_path / "cache"))
    assert data["classes"] == ("birds", "cats", "dogs")  # the folders' names, sorted; label k is classes[k]
    by_label = {int(label): int(image[0, 0, 0]) for image, label in zip(*data["train"])}
    assert by_label == {0: 40, 1: 20, 2: 0}  # write_image_folder paints class folder k (given order) with k * 20
    assert load_source(str(tmp_path / "folder"), cache_dir=str(tmp_path / "cache"))["classes"] == data["classes"]


def test_iphone_heic_and_avif_photos_are_read_and_raw_files_left_out_with_a_one_line_warning(tmp_path, accelerator,
                                                                                             capsys):
    """Beside one PNG per class and split (red 0, 20, 40 by class): an iPhone's .HEIC photo (grey 100) and a JPEG
    saved from a browser as .jfif (grey 60) in train/ant/, an .avif in train/cow/ (grey 140), a camera's raw .dng in
    test/cow/ and .NEF in train/bee/, a JPEG XL .jxl (no Pillow plugin) in train/cow/. The load reads the 6 training
    and 3 test images, each with its class (their red: the lossy ones within 2 levels of their grey), and warns in
    one line that it left out 3 photos (1 .dng, 1 .jxl, 1 .nef); a class folder holding only raw files stops with
    one line that says so; predict.py lists every file (a row each, the raw file with Pillow's reason)."""
    import predict

    folder = write_image_folder(tmp_path / "folder", ("ant", "bee", "cow"))
    pillow_heif.from_pillow(Image.new("RGB", (32, 32), (100,) * 3)).save(folder / "train" / "ant" / "IMG_0001.HEIC")
    Image.new("RGB", (32, 32), (60,) * 3).save(folder / "train" / "ant" / "download.jfif", format="JPEG")
    Image.new("RGB", (32, 32), (140,) * 3).save(folder / "train" / "cow" / "1.avif")
    (folder / "test" / "cow" / "DSC_0003.dng").write_bytes(b"II*\0" + bytes(64))
    (folder / "train" / "bee" / "DSC_0004.NEF").write_bytes(b"II*\0" + bytes(64))
    (folder / "train" / "cow" / "2.jxl").write_bytes(b"\xff\x0a" + bytes(64))
    data = load_source(str(folder), cache_dir=str(tmp_path / "cache"))
    assert (len(data["train"][1]), len(data["test"][1])) == (6, 3)
    greys = {}
    for image, label in zip(*data["train"]):
        greys.setdefault(int(label), []).append(image[0].float().mean().item())  # red: write_image_folder's grey
    want = {0: [0, 60, 100], 1: [20], 2: [40, 140]}
    assert {k: len(v) for k, v in greys.items()} == {k: len(v) for k, v in want.items()}, greys
    assert all(abs(got - grey) <= 2 for k in want for got, grey in zip(sorted(greys[k]), want[k])), greys
    warned = [line for line in capsys.readouterr().out.splitlines()  # (its splits share their PNGs: said apart)
              if line.startswith("warning:") and "pixel for pixel" not in line]
    assert warned == [f"warning: left out 3 photos under --data-dir {folder} in formats the data path does not read "
                      f"(1 .dng, 1 .jxl, 1 .nef); convert them to JPEG to use them."]
    (folder / "train" / "bee" / "0.png").unlink()
    assert _folder_error(tmp_path, accelerator) == (
        f"the class folder {folder / 'train' / 'bee'} holds no image ({', '.join(sources.IMAGE_SUFFIXES)}); it holds "
        f"photos in formats the data path does not read (1 .nef): convert them to JPEG.")
    files, names = predict.find_images(str(folder / "train"))
    assert names == ["ant/0.png", "ant/IMG_0001.HEIC", "ant/download.jfif", "bee/DSC_0004.NEF", "cow/0.png",
                     "cow/1.avif", "cow/2.jxl"]
    assert predict.why_unreadable(files[3], predict.run_view({"image_size": 32})).startswith(
        "UnidentifiedImageError: cannot identify image file")
    assert abs(predict.read_view(files[1], predict.run_view({"image_size": 32})).mean() - 100) <= 2


def test_an_image_folders_class_is_its_top_folder_at_any_depth_and_hidden_folders_are_left_out(tmp_path, accelerator):
    """Photos kept in albums inside the class folders (train/cat/2024/, train/cat/2023/trip/, and one directly in
    train/dog/, itself a link to a folder elsewhere; train/cat/2024/up a link back to train/cat): every image, once,
    takes the class of the folder under train/ that holds it (checked by the grey each class is painted: ant 0, cat
    20, dog 40), where datasets' image folder would name the class by the album; Jupyter's
    hidden .ipynb_checkpoints folders (one beside the classes, one inside a class) are neither a class nor images, nor
    is the ._e.png that macOS writes beside e.png on a foreign disk; an image directly in train/ is one line."""
    folder, elsewhere = tmp_path / "folder", tmp_path / "elsewhere"
    layout = {"ant": ["a.png", "2024/b.png"], "cat": ["2024/c.png", "2023/trip/d.png"], "dog": ["e.png", "2023/f.png"]}
    for split in ("train", "test"):
        for k, (name, paths) in enumerate(layout.items()):
            home = (elsewhere if name == "dog" else folder) / split / name  # dog/: a link to a folder elsewhere
            for path in paths:
                (home / path).parent.mkdir(parents=True, exist_ok=True)
                Image.new("RGB", (8, 8), (20 * k,) * 3).save(home / path)
        (folder / split / "dog").symlink_to(elsewhere / split / "dog")
        (folder / split / "cat" / "2024" / "up").symlink_to(folder / split / "cat")  # a link back up: walked once
    for hidden in (folder / "train" / ".ipynb_checkpoints", folder / "train" / "cat" / ".ipynb_checkpoints"):
        hidden.mkdir()
        Image.new("RGB", (8, 8), (250, 250, 250)).save(hidden / "x-checkpoint.png")
    (folder / "train" / "dog" / "._e.png").write_bytes(b"\0\5\26\7" + bytes(60))  # macOS's AppleDouble file
    data = load_source(str(folder), cache_dir=str(tmp_path / "cache"))
    assert data["classes"] == ("ant", "cat", "dog")
    for split in ("train", "test"):
        images, labels = data[split]
        assert sorted((int(label), int(image[0, 0, 0])) for image, label in zip(images, labels)) == [
            (0, 0), (0, 0), (1, 20), (1, 20), (2, 40), (2, 40)]
    Image.new("RGB", (8, 8)).save(folder / "train" / "loose.png")
    assert _folder_error(tmp_path, accelerator) == (f"{folder / 'train' / 'loose.png'} is not in a class folder: an "
                                                    f"image folder's images go in {folder / 'train'}/<class>/, at any "
                                                    f"depth beneath it.")


def test_a_16_bit_grayscale_image_is_read_by_its_top_8_bits_not_clipped_to_white(tmp_path, accelerator):
    """16-bit grayscale PNGs and TIFFs (Pillow's I;16) of gradients over 0-65535: the decode cache, a batch decoded in
    the loader's workers and a copy's Dataset items (loaded PIL images) give the pixels of 8-bit grayscale PNGs of
    each value's top 8 bits (value >> 8), bitwise; Pillow's own conversion to RGB makes 99.6% of them 255."""
    from utils.data.images import EncodedImages
    from utils.data.sources import DatasetRows

    ramp = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16)
    ramps = {"up": ramp, "down": ramp[::-1].copy()}
    for depth, top in (("16", lambda a: a), ("8", lambda a: (a >> 8).astype(np.uint8))):
        for split in ("train", "test"):
            for name, a in ramps.items():
                (tmp_path / depth / split / name).mkdir(parents=True)
                Image.fromarray(top(a)).save(tmp_path / depth / split / name / "0.png")
                Image.fromarray(top(a)).save(tmp_path / depth / split / name / "1.tif")
    wide = Image.open(tmp_path / "16" / "train" / "up" / "0.png")
    assert wide.mode == "I;16" and (np.asarray(wide.convert("RGB")) == 255).mean() > 0.99
    got = load_source(str(tmp_path / "16"), cache_dir=str(tmp_path / "c16"))["train"]
    want = load_source(str(tmp_path / "8"), cache_dir=str(tmp_path / "c8"))["train"]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    files = sorted((tmp_path / "16" / "train").rglob("*.*"))
    eight = [tmp_path / "8" / f.relative_to(tmp_path / "16") for f in files]
    read = [EncodedImages(encoded_rows(paths), 32, None, 0).read(np.arange(4), None)[0] for paths in (files, eight)]
    assert torch.equal(read[0], read[1])
    loaded = [(Image.open(f), 0) for f in files]
    for im, _ in loaded:
        im.load()
    rows, _ = DatasetRows.read(loaded, "train", "load_data()['train']", 32)
    assert torch.equal(EncodedImages(rows, 32, None, 0).read(np.arange(4), None)[0], read[1])


def test_a_palette_png_with_transparency_is_read_as_its_palette_colours_without_a_warning(tmp_path):
    """A 32 x 32 palette PNG with transparency (a sticker, an icon): a batch decoded in the loader's workers gives
    each pixel its palette entry's colour (looked up here in the palette itself), with warnings as errors (Pillow
    warns of each such image converted to RGB directly)."""
    import warnings

    from utils.data.images import EncodedImages

    rng = np.random.default_rng(0)
    im = Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).convert("P")
    im.save(tmp_path / "sticker.png", transparency=bytes([0] * 16 + [255] * 240))
    stored = Image.open(tmp_path / "sticker.png")
    assert stored.mode == "P" and isinstance(stored.info["transparency"], bytes)
    colours = np.array(stored.getpalette(), dtype=np.uint8).reshape(-1, 3)[np.asarray(stored)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = EncodedImages(encoded_rows([tmp_path / "sticker.png"]), 32, None, 0).read(np.arange(1), None)[0]
    assert np.array_equal(batch[0].numpy(), colours)


def test_images_of_mixed_sizes_and_modes_are_resized_to_rgb_image_size_or_stop_asking_for_it(tmp_path, accelerator):
    folder = write_mixed_folder(tmp_path / "folder")
    message = _folder_error(tmp_path, accelerator)
    assert message.startswith("the images do not share one square size (") and message.endswith(
        "pass --image-size S to resize every image to S x S (photos of many sizes and shapes: --image-size S "
        "--augment resized-crop, the natural-image recipe, crops each as it is decoded)."), message
    data = load_source(str(folder), cache_dir=str(tmp_path / "cache"), image_size=24)
    images, labels = data["train"]
    assert images.shape == (9, 3, 24, 24) and images.is_contiguous(memory_format=torch.channels_last)
    gray = [im for im, k in zip(images, labels) if k == 1 and im[0, 0, 0] == im[1, 0, 0] == im[2, 0, 0] == 60]
    assert len(gray) == 1 and (gray[0] == 60).all()  # grayscale 60 became RGB (60, 60, 60), every pixel
    assert {tuple(im[:, 12, 12].tolist()) for im, k in zip(images, labels) if k == 2} == {
        (120, 120, 120), (120, 10, 200), (120, 100, 50)}  # RGBA lost its alpha; the plain colours survive the resize
    pixels = images.permute(0, 2, 3, 1).reshape(-1, 3).double() / 255
    assert data["mean"] == pytest.approx(tuple(pixels.mean(0).tolist()), abs=1e-9)  # of the training images
    assert data["std"] == pytest.approx(tuple(pixels.std(0, correction=0).tolist()), abs=1e-9)


def test_cifar10_normalisation_from_the_data_is_the_published_constants(cifar_dir, cache_dir, accelerator):
    """The mean to 3 decimals; the standard deviation of this JPEG re-encoding of CIFAR-10 (../shared's copy) is up
    to 0.0018 lower than the lossless original's published values: JPEG smooths the pixels."""
    data = load_source(str(cifar_dir), cache_dir=str(cache_dir))
    if len(data["train"][1]) != 50_000:
        pytest.skip("needs the real CIFAR-10 training split")
    assert data["mean"] == pytest.approx((0.4914, 0.4822, 0.4465), abs=5e-4)
    assert data["std"] == pytest.approx((0.2470, 0.2435, 0.2616), abs=2.5e-3)
    assert all(ours < published for ours, published in zip(data["std"], (0.2470, 0.2435, 0.2616)))


def test_the_crop_padding_is_4_pixels_at_32_and_in_proportion_at_other_sizes():
    assert [crop_padding(s) for s in (8, 32, 48, 96)] == [1, 4, 6, 12]


def test_integer_labels_without_class_names_make_classes_named_by_their_numbers(tmp_path, accelerator):
    src = tmp_path / "src"
    src.mkdir()
    write_parquet(src / "train-00000-of-00001.parquet", 12, labels=[2, 0, 1] * 4, class_names=None)
    write_parquet(src / "test-00000-of-00001.parquet", 3, labels=[1, 1, 0], class_names=None)
    data = load_source(str(src), cache_dir=str(tmp_path / "cache"))
    assert data["classes"] == ("0", "1", "2") and data["train"][1].tolist() == [2, 0, 1] * 4
    assert data["dataset"] == {"source": str(src), "kind": "parquet", "fingerprint": data["dataset"]["fingerprint"],
                               "eval_split": "test"}
    assert load_source(str(src), cache_dir=str(tmp_path / "cache"))["classes"] == ("0", "1", "2")  # cached


def test_image_and_label_columns_are_found_by_name_and_a_missing_one_is_named():
    import datasets

    pixels = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    pngs = []
    for arr in pixels:
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG")
        pngs.append({"bytes": buf.getvalue(), "path": None})
    features = datasets.Features({"image": datasets.Image(), "fine_label": datasets.ClassLabel(names=CIFAR_CLASSES)})
    ds = datasets.Dataset.from_dict({"image": pngs, "fine_label": [3, 0, 9]}, features=features)
    images, labels, names = decoded(ds, "train")
    assert torch.equal(images, torch.from_numpy(pixels).permute(0, 3, 1, 2)) and labels.tolist() == [3, 0, 9]
    assert names == CIFAR_CLASSES
    renamed = ds.rename_column("fine_label", "target")
    with pytest.raises(UserError, match=r"^the test split has columns \['image', 'target'\]; expected a label column "
                                        r"named 'label' or 'labels' or 'fine_label' "
                                        r"\(or name it with --label-column\)\.$"):
        decoded(renamed, "test")
    images, labels, _ = decoded(renamed, "test", columns=("image", "target"))  # --label-column target
    assert torch.equal(images, torch.from_numpy(pixels).permute(0, 3, 1, 2)) and labels.tolist() == [3, 0, 9]
    with pytest.raises(UserError, match=r"^the test split has no column 'photo' \(--image-column\); its columns: "
                                        r"\['image', 'target'\]\.$"):
        decoded(renamed, "test", columns=("photo", None))
    with pytest.raises(UserError, match=r"^the test split's column 'target' is ClassLabel\(.*\), not images\.$"):
        decoded(renamed, "test", columns=("target", "target"))


# Sources without an evaluation split, and Hub datasets by name -----------------------------------------------------
def test_a_source_without_an_evaluation_split_holds_out_a_fixed_part_of_train_and_says_so(tmp_path, accelerator,
                                                                                          capsys):
    src = tmp_path / "src"
    src.mkdir()
    write_parquet(src / "train-00000-of-00001.parquet", 40, seed=3)
    whole = decoded(datasets_parquet(src / "train-00000-of-00001.parquet"), "train")  # the 40, in order
    data = load_source(str(src), cache_dir=str(tmp_path / "cache"))
    assert capsys.readouterr().out.splitlines()[-1] == (
        "no evaluation split: evaluating on 4 of the 40 training images, held out by --val-fraction 0.1 (each class "
        "its share, by a fixed shuffle: the same on every process and run); training on the other 36")
    assert data["dataset"]["eval_split"] == "0.1 of train, held out by class"
    (train_x, train_y), (held_x, held_y) = data["train"], data["test"]
    assert len(train_y) == 36 and len(held_y) == 4 and train_x.is_contiguous(memory_format=torch.channels_last)
    # Disjoint, together the whole split, each part in the file's order: find each image's row in the file.
    row_of = {digests(im[None], y[None])[0]: i for i, (im, y) in enumerate(zip(*whole[:2]))}
    train_rows = [row_of[digests(im[None], y[None])[0]] for im, y in zip(train_x, train_y)]
    held_rows = [row_of[digests(im[None], y[None])[0]] for im, y in zip(held_x, held_y)]
    assert sorted(train_rows + held_rows) == list(range(40)) and train_rows == sorted(train_rows)
    assert held_rows == sorted(held_rows) and held_rows != list(range(36, 40)) and held_rows != list(range(4))
    pixels = train_x.permute(0, 2, 3, 1).reshape(-1, 3).double() / 255  # normalised with the training part only
    assert data["mean"] == pytest.approx(tuple(pixels.mean(0).tolist()), abs=1e-9)
    again = load_source(str(src), cache_dir=str(tmp_path / "other-cache"))  # decoded afresh: another machine
    assert all(torch.equal(again[s][i], data[s][i]) for s in ("train", "test") for i in (0, 1))
    # An explicit fraction holds out of train even beside a test split, which then is not used.
    write_parquet(src / "test-00000-of-00001.parquet", 8, seed=4)
    quarter = load_source(str(src), cache_dir=str(tmp_path / "cache"), val_fraction=0.25)
    assert len(quarter["train"][1]) == 30 and len(quarter["test"][1]) == 10
    assert "no evaluation split used: evaluating on 10 of the 40" in capsys.readouterr().out
    assert load_source(str(src), cache_dir=str(tmp_path / "cache"))["dataset"]["eval_split"] == "test"
    with pytest.raises(UserError, match=r"^--val-fraction must be between 0 and 1 \(got 1\)\.$"):
        load_source(str(src), cache_dir=str(tmp_path / "cache"), val_fraction=1.0)


def test_a_held_out_part_is_stratified_by_class_on_rows_sorted_by_class_with_a_rare_class(tmp_path, accelerator):
    """40 training rows sorted by class, 20 of class 0, 12 of class 1, 6 of class 2 and 2 of class 3, with
    --val-fraction 0.25: 10 held out, each class its share (5, 3, 1.5, 0.5) rounded down (5, 3, 1, 0) and the one
    left over to the larger of the two classes with the largest remainder (class 2: 5, 3, 2, 0), so every class keeps
    its training rows and the held-out part has each class in its proportion. With 1 row of class 3 and
    --val-fraction 0.5 (20 of 39 held out; shares 10, 6, 3, 0.5), the row left over goes not to class 3 (its only
    row) but to the largest class (11, 6, 3, 0). The same rows on every load."""
    src = tmp_path / "src"
    src.mkdir()
    labels = [0] * 20 + [1] * 12 + [2] * 6 + [3] * 2
    write_parquet(src / "train-00000-of-00001.parquet", 40, seed=5, labels=labels)
    data = load_source(str(src), cache_dir=str(tmp_path / "cache"), val_fraction=0.25)
    assert torch.bincount(data["test"][1], minlength=4).tolist() == [5, 3, 2, 0]
    assert torch.bincount(data["train"][1], minlength=4).tolist() == [15, 9, 4, 2]
    again = load_source(str(src), cache_dir=str(tmp_path / "other-cache"), val_fraction=0.25)
    assert torch.equal(again["test"][0], data["test"][0])
    (src / "train-00000-of-00001.parquet").unlink()
    write_parquet(src / "train-00000-of-00001.parquet", 39, seed=5, labels=labels[:39])  # one row of class 3
    rare = load_source(str(src), cache_dir=str(tmp_path / "cache"), val_fraction=0.5)  # 10, 6, 3, 0.5 of 20
    assert torch.bincount(rare["test"][1], minlength=4).tolist() == [11, 6, 3, 0]


def decoded(ds, split: str, columns=(None, None)):
    """(N, 3, H, W) uint8 images, int64 labels and class names of a datasets.Dataset's rows, as read_rows finds its
    columns, each image decoded here by PIL (the expected pixels: not through utils/data's decode)."""
    rows = sources.read_rows(ds, split, columns)
    pixels = [np.asarray(Image.open(io.BytesIO(s) if isinstance(s, bytes) else s).convert("RGB"))
              for s in rows.fetch(range(len(rows)))]
    return torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2), rows.labels, rows.names


def datasets_parquet(path):
    import datasets

    return datasets.load_dataset("parquet", data_files=str(path), split="train")


def test_a_hub_dataset_named_by_dataset_loads_its_splits_columns_and_class_names(tmp_path, accelerator):
    # A Hub repository's layout (data/<split>-*.parquet), loaded by name through datasets.load_dataset as --dataset
    # NAME is; a local path stands in for the Hub id here (no network).
    repo = tmp_path / "user" / "flowers"
    (repo / "data").mkdir(parents=True)
    names = ("daisy", "rose", "tulip")
    write_parquet(repo / "data" / "train-00000-of-00001.parquet", 30, seed=5, class_names=names,
                  columns=("image", "labels"), size=(16, 16))
    write_parquet(repo / "data" / "validation-00000-of-00001.parquet", 9, seed=6, class_names=names,
                  columns=("image", "labels"), size=(16, 16))
    data = load_source(None, cache_dir=str(tmp_path / "cache"), dataset=str(repo))
    assert data["classes"] == names and data["train"][0].shape == (30, 3, 16, 16) and len(data["test"][1]) == 9
    assert data["dataset"] == {"source": str(repo), "kind": "hub", "fingerprint": data["dataset"]["fingerprint"],
                               "eval_split": "validation"}
    expected = decoded(datasets_parquet(repo / "data" / "validation-00000-of-00001.parquet"), "validation")
    assert torch.equal(data["test"][0], expected[0]) and torch.equal(data["test"][1], expected[1])
    write_parquet(repo / "data" / "test-00000-of-00001.parquet", 5, seed=7, class_names=names,
                  columns=("image", "labels"), size=(16, 16))  # the same files, and either split evaluated on:
    for eval_split, n in ((None, 9), ("test", 5), (None, 9)):  # each its own cache
        source = sources.locate(None, str(repo), None, eval_split)
        data = load_source(None, cache_dir=str(tmp_path / "cache"), dataset=str(repo), source=source)
        assert (len(data["test"][1]), data["dataset"]["eval_split"]) == (n, eval_split or "validation")
    with pytest.raises(UserError, match=r"^pass either --data-dir \(d\) or --dataset \(uoft-cs/cifar100\), "
                                        r"not both\.$"):
        load_source("d", cache_dir=None, dataset="uoft-cs/cifar100")


# --mixup / --cutmix ---------------------------------------------------------------------------------------------
def _torchvision_partner_shares(kind, alpha: float, draws: int) -> np.ndarray:
    """The partner's share of the label that torchvision.transforms.v2's MixUp or CutMix gives, `draws` times (one
    lambda per call): the independent reference for the laws of mix_draws."""

    torch.manual_seed(0)
    mix = kind(alpha=alpha, num_classes=2)
    images, labels = torch.zeros(2, 3, 32, 32), torch.tensor([0, 1])
    return np.array([mix(images, labels)[1][0, 1].item() for _ in range(draws)])  # image 0's partner: image 1


def test_mixing_draws_follow_torchvisions_mixup_and_cutmix_laws_per_image():
    from scipy.stats import ks_2samp
    from torchvision.transforms import v2

    mixing = Mixing(mixup=0.2, cutmix=1.0, prob=0.8)
    partner, weight, box = (torch.cat(t) for t in zip(*(mix_draws(3, 0, range(b, b + 128), 32, mixing)
                                                         for b in range(0, 128 * 40, 128))))
    n = len(partner)  # 5,120 images
    positions = torch.arange(n) % 128
    assert not (partner == positions).any() and partner.min() == 0 and partner.max() == 127  # another image, any
    cut = (box[:, 1] > box[:, 0]) & (box[:, 3] > box[:, 2])
    mixed_up = weight > 0
    assert not (cut & mixed_up).any()
    mixed = cut | mixed_up  # (a cutmix box may clip to nothing, and a mixup lambda be 1: rare, counted as unmixed)
    assert abs(mixed.float().mean().item() - 0.8) < 4 * (0.8 * 0.2 / n) ** 0.5  # --mix-prob, 4 standard errors
    assert abs(cut.sum().item() / mixed.sum().item() - 0.5) < 4 * (0.25 / mixed.sum().item()) ** 0.5  # one or other
    area = ((box[:, 1] - box[:, 0]) * (box[:, 3] - box[:, 2]) / 32**2)[cut].numpy()
    assert ks_2samp(weight[mixed_up].numpy(), _torchvision_partner_shares(v2.MixUp, 0.2, 3000)).pvalue > 1e-3
    reference_area = _torchvision_partner_shares(v2.CutMix, 1.0, 3000)
    assert ks_2samp(area, reference_area[reference_area > 0]).pvalue > 1e-3
    assert abs(area.mean() - reference_area[reference_area > 0].mean()) < 0.03
    # keyed by (seed, epoch, image): the same batch again gives the same draws; another epoch, others
    again = mix_draws(3, 0, range(128), 32, mixing)
    assert all(torch.equal(a, b[:128]) for a, b in zip(again, (partner, weight, box)))
    assert not torch.equal(mix_draws(3, 1, range(128), 32, mixing)[2], box[:128])


@pytest.mark.parametrize("channels_last", [True, False])
def test_mixed_pixels_and_soft_targets_are_exact_for_drawn_images(channels_last):
    gen = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8, generator=gen)
    labels = torch.arange(16) % 10
    transform = BatchTransform(torch.device("cpu"), channels_last=channels_last, mean=MEAN, std=STD, num_classes=10)
    draws = Draws(augment_draws(7, 0, range(16), 4), mix_draws(7, 0, range(16), 32, Mixing(0.4, 1.0)))
    inputs, targets = transform.train(images, labels, draws)
    plain = transform(images, draws.flip_crop).clone()  # cropped, flipped, normalised, unmixed
    partner, weight, box = draws.mixing
    kinds = set()
    for i in range(16):
        p, (y0, y1, x0, x1) = int(partner[i]), box[i].tolist()
        expected_target = torch.zeros(10)
        if weight[i] > 0:  # mixup: the blend, to float rounding
            kinds.add("mixup")
            torch.testing.assert_close(inputs[i], (1 - weight[i]) * plain[i] + weight[i] * plain[p], rtol=0,
                                       atol=1e-5)
            share = float(weight[i])
        else:  # cutmix: the partner's pixels inside the box, its own outside, exactly (a lambda near 1: no box)
            kinds.add("cutmix" if (y1 - y0) * (x1 - x0) else "unmixed")
            expected = plain[i].clone()
            expected[:, y0:y1, x0:x1] = plain[p][:, y0:y1, x0:x1]
            assert torch.equal(inputs[i], expected)
            share = (y1 - y0) * (x1 - x0) / 32**2
        expected_target[labels[i]] += 1 - share
        expected_target[labels[p]] += share
        torch.testing.assert_close(targets[i], expected_target, rtol=0, atol=1e-6)
    assert {"mixup", "cutmix"} <= kinds
    assert inputs.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    unmixed_inputs, unmixed_targets = transform.train(images, labels, Draws(draws.flip_crop))  # labels as they are
    assert torch.equal(unmixed_inputs, plain) and unmixed_targets is labels


def _torchvision_erasing(draws: int, size: int = 32) -> np.ndarray:
    """torchvision.transforms.v2's RandomErasing's boxes, (y0, y1, x0, x1) per call (its get_params; empty where none
    of its tries fits), `draws` times: the independent reference for erase_draws."""
    from torchvision.transforms import v2

    torch.manual_seed(0)
    erasing, image, boxes = v2.RandomErasing(p=1.0, value=0), torch.zeros(3, size, size), []
    for _ in range(draws):
        drawn = erasing.make_params([image])
        y0, x0, h, w = drawn["i"], drawn["j"], drawn["h"], drawn["w"]
        fits = h < size and w < size  # a try that fits is strictly inside; none: the whole image, left as it is
        boxes.append((y0, y0 + h, x0, x0 + w) if fits else (0, 0, 0, 0))
    return np.array(boxes)


def test_erasing_draws_follow_torchvisions_random_erasing_per_image():
    """--random-erase's draws: the chance an image is erased is the flag's (4 standard errors) times the share of
    draws whose box fits, as torchvision's; the boxes' areas, aspect ratios and top rows follow torchvision's
    RandomErasing (Kolmogorov-Smirnov, p > 1e-3, against 4,000 of its draws); keyed by (seed, epoch, image), so an
    image gets its box in whatever batch it comes; the noise seed is the batch's first image's."""
    from scipy.stats import ks_2samp

    batches = [erase_draws(5, 0, range(b, b + 128), 32, 0.5) for b in range(0, 128 * 40, 128)]
    box = torch.cat([b for b, _ in batches]).numpy()
    n, erased = len(box), (box[:, 1] > box[:, 0])
    reference = _torchvision_erasing(4000)
    fits = reference[:, 1] > reference[:, 0]
    expected = 0.5 * fits.mean()
    assert abs(erased.mean() - expected) < 4 * (expected * (1 - expected) / n) ** 0.5
    assert (box[:, 1] <= 32).all() and (box[:, 3] <= 32).all() and (box[:, 1] - box[:, 0] < 32).all()
    ours, theirs = box[erased], reference[fits]
    for name, value in (("area", lambda b: (b[:, 1] - b[:, 0]) * (b[:, 3] - b[:, 2])),
                        ("aspect", lambda b: np.log((b[:, 1] - b[:, 0]) / (b[:, 3] - b[:, 2]))),
                        ("top", lambda b: b[:, 0])):
        assert ks_2samp(value(ours), value(theirs)).pvalue > 1e-3, name
    shuffled = np.random.default_rng(0).permutation(128)
    again, seed = erase_draws(5, 0, shuffled, 32, 0.5)
    assert torch.equal(again, torch.from_numpy(box[shuffled])) and seed != batches[0][1]
    assert erase_draws(5, 0, range(128), 32, 0.5)[1] == batches[0][1]
    assert not torch.equal(erase_draws(5, 1, range(128), 32, 0.5)[0], batches[0][0])
    assert not erase_draws(5, 0, range(128), 32, 0.0)[0].any()


@pytest.mark.parametrize("channels_last", [True, False])
def test_erased_boxes_hold_standard_normal_noise_and_every_other_pixel_is_the_unerased_batchs(channels_last):
    """Under --random-erase each drawn box of the normalised image holds values of mean 0 and standard deviation 1
    (to 0.05 over its about 10,000 values), every other value is the unerased transform's exactly, the same draws
    give the same noise, and the output keeps the memory format."""
    images = torch.randint(0, 256, (32, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    labels = torch.arange(32) % 10
    transform = BatchTransform(torch.device("cpu"), channels_last=channels_last, mean=MEAN, std=STD, num_classes=10)
    flip_crop, erasing = augment_draws(7, 0, range(32), 4), erase_draws(7, 0, range(32), 32, 0.5)
    inputs, targets = transform.train(images, labels, Draws(flip_crop, None, erasing))
    plain = transform(images, flip_crop).clone()
    inside = torch.zeros_like(plain, dtype=torch.bool)
    for i, (y0, y1, x0, x1) in enumerate(erasing[0].tolist()):
        inside[i, :, y0:y1, x0:x1] = True
    assert 8 <= inside[:, 0].flatten(1).any(1).sum() <= 24 and targets is labels
    assert torch.equal(inputs[~inside], plain[~inside])
    noise = inputs[inside]
    assert noise.numel() > 3000 and abs(noise.mean().item()) < 0.05 and abs(noise.std().item() - 1) < 0.05
    assert torch.equal(transform.train(images, labels, Draws(flip_crop, None, erasing))[0], inputs)
    assert inputs.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


# A copy's own torch Dataset (utils/data/sources.py) ------------------------------------------------------------------
class Items(torch.utils.data.Dataset):
    """(image, label) items as given; the checks below break one of them."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_a_dataset_item_of_the_wrong_type_label_or_size_stops_with_one_line_naming_the_item():
    """Each broken item of a load_data Dataset is one line naming the split, the item's index and what is wrong: not a
    pair, a float tensor, a label out of range, a label that is not an integer, an image of another size than the
    train split's first, a non-square image."""
    from PIL import Image

    from utils.data.contract import checked_data

    good = [(torch.zeros(3, 8, 8, dtype=torch.uint8), k % 2) for k in range(4)]
    pil = [(Image.new("RGB", (8, 8)), 1)] * 3

    def error(train, test=pil) -> str:
        with pytest.raises(UserError) as e:
            checked_data({"train": Items(train), "test": Items(test), "classes": ["a", "b"]})
        return str(e.value)

    assert error([*good[:2], torch.zeros(3, 8, 8)]) == (
        "load_data: the train Dataset's item 2 must be a pair (image, label) (got Tensor).")
    assert error([*good[:1], (torch.zeros(3, 8, 8), 0)]) == (
        "load_data: the train Dataset's item 1's image must be a PIL image or a uint8 tensor 3 x H x W or H x W x 3 "
        "(got float32 tensor (3, 8, 8)).")
    assert error([*good, (good[0][0], 2)]) == (
        "load_data: the train split has label 2 at row 4; with 2 classes, labels are 0-1.")
    assert error([*good, (good[0][0], 0.0)]) == (
        "load_data: the train Dataset's item 4's label must be an integer (got float 0.0).")
    assert error(good, [(Image.new("RGB", (8, 8)), 0), (Image.new("RGB", (9, 9)), 0)]) == (
        "load_data: the test Dataset's item 1's image is 9 x 9; without --image-size every image must be 8 x 8, as "
        "item 0 of the train split is: pass --image-size S to resize every image to S x S (photos of many sizes "
        "and shapes: --image-size S --augment resized-crop, the natural-image recipe, crops each as it is decoded).")
    assert error([(torch.zeros(3, 8, 6, dtype=torch.uint8), 0)]) == (
        "load_data: the train Dataset's item 0's image is 6 x 8; without --image-size every image must be square: "
        "pass --image-size S to resize every image to S x S (photos of many sizes and shapes: --image-size S "
        "--augment resized-crop, the natural-image recipe, crops each as it is decoded).")
    data = checked_data({"train": Items(good), "test": Items(pil), "classes": ["a", "b"]})
    assert data["image_size"] == 8 and data["train"][1].tolist() == [0, 1, 0, 1] and len(data["test"][0]) == 3
    assert data["mean"] == (0.0, 0.0, 0.0)


def test_a_copys_dataset_whose_evaluation_items_are_training_items_gets_one_warning_naming_the_first_pair(tmp_path):
    """A copy's Datasets of 8 x 8 images: evaluation items that are training items, a file byte for byte (opened
    lazily from its path), a training file's bytes opened lazily from memory, and a tensor pixel for pixel, are
    counted in one warning line naming the first pair. Not counted: the same pixels saved again as BMP (other bytes),
    a tensor that differs from a training tensor in one pixel below its middle row, and new images. Splits without
    such items get no line."""
    from utils.data.contract import checked_data

    rng = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (16, 8, 8, 3), dtype=torch.uint8, generator=rng)
    for k in range(16):
        Image.fromarray(pixels[k].numpy()).save(tmp_path / f"{k:02d}.png")
    train = [(Image.open(tmp_path / f"{k:02d}.png"), k % 2) for k in range(8)]  # opened lazily: nothing decoded
    train += [(Image.open(io.BytesIO((tmp_path / "08.png").read_bytes())), 0)]
    train += [(pixels[k].permute(2, 0, 1).clone(), k % 2) for k in (9, 10)]  # decoded: uint8 tensors
    (tmp_path / "copy.png").write_bytes((tmp_path / "03.png").read_bytes())
    Image.open(tmp_path / "05.png").save(tmp_path / "05.bmp")
    changed = pixels[10].permute(2, 0, 1).clone()
    changed[0, 6, 2] ^= 1  # row 6: below the middle row (4) that the first round compares
    new = [(Image.open(tmp_path / f"{k:02d}.png"), k % 2) for k in range(11, 16)]
    test = [(Image.open(tmp_path / "copy.png"), 1), (Image.open(io.BytesIO((tmp_path / "02.png").read_bytes())), 0),
            (pixels[9].permute(2, 0, 1).clone(), 1), (Image.open(tmp_path / "05.bmp"), 1), (changed, 0), *new]
    said = []
    checked_data({"train": Items(train), "test": Items(test), "classes": ["a", "b"]}, say=said.append)
    assert [line for line in said if line.startswith("warning:")] == [
        "warning: 3 of the 10 evaluation images are also training images, byte for byte or pixel for pixel (the "
        "first: item 0 of load_data: the test Dataset and item 3 of load_data: the train Dataset); the evaluation "
        "counts them as unseen."]
    fresh = [(Image.open(tmp_path / f"{k:02d}.png"), k % 2) for k in range(8)] + train[8:]  # none decoded yet
    said.clear()
    checked_data({"train": Items(fresh), "test": Items([(Image.open(tmp_path / "05.bmp"), 1), (changed, 0), *new]),
                  "classes": ["a", "b"]}, say=said.append)
    assert not [line for line in said if line.startswith("warning:")]


@pytest.mark.skipif(WORKER_START is None, reason="this Python forks the loader's workers: nothing is pickled")
def test_a_dataset_that_does_not_pickle_stops_with_one_line_where_workers_start_from_a_forkserver():
    """On Python before 3.11.10 the loader's workers start from a forkserver and receive the Dataset pickled: one
    holding a lambda is one line naming the split and saying what to do, before any worker starts."""
    from utils.data.contract import checked_data

    unpicklable = Items([(torch.zeros(3, 8, 8, dtype=torch.uint8), 0)] * 2)
    unpicklable.transform = lambda image: image
    with pytest.raises(UserError) as e:
        checked_data({"train": unpicklable, "test": Items(unpicklable.items), "classes": ["a", "b"]})
    assert str(e.value).startswith("load_data: the train Dataset cannot be pickled (")
    assert str(e.value).endswith("on Python before 3.11.10 the loader's workers start from a forkserver and receive "
                                 "it pickled: define its class at the top level of a module and keep no open file, "
                                 "lock or lambda in it, or use Python 3.11.10 or newer.")


def test_the_mean_and_std_are_load_datas_else_the_models_else_the_training_images_and_said_with_where_from():
    """One rule for the normalisation, said at start in one line: load_data's own mean and std win (over a pretrained
    model's, which the line names as not used), else the model's, else the training images' own (here half the
    pixels 0 and half 255: mean 0.5, std 0.5); summary.json's data facts record which."""
    from utils.data.contract import checked_data, data_facts

    images = torch.zeros(4, 3, 2, 2, dtype=torch.uint8)
    images[:2] = 255
    data = {"train": (images, [0, 1, 0, 1]), "test": (images, [0, 1, 0, 1]), "classes": ["a", "b"]}
    own, model = {"mean": (0.1, 0.2, 0.3), "std": (0.4, 0.5, 0.6)}, {"mean": (0.7,) * 3, "std": (0.8,) * 3}
    cases = ((data | own, model, own, "load_data",
              "normalising with load_data's mean (0.1000, 0.2000, 0.3000) and std (0.4000, 0.5000, 0.6000); the "
              "pretrained model's (mean (0.7000, 0.7000, 0.7000) and std (0.8000, 0.8000, 0.8000)) are not used: "
              "load_data's own win"),
             (data, model, model, "pretrained model",
              "normalising with the pretrained model's mean (0.7000, 0.7000, 0.7000) and std (0.8000, 0.8000, 0.8000)"),
             (data, {}, {"mean": (0.5,) * 3, "std": (0.5,) * 3}, "training images",
              "normalising with the training images' mean (0.5000, 0.5000, 0.5000) and std (0.5000, 0.5000, 0.5000)"))
    for given, model_stats, want, source, line in cases:
        said = []
        checked = checked_data(given, model_stats=model_stats, say=said.append)
        assert (checked["mean"], checked["std"]) == (want["mean"], want["std"]) and said == [line]
        assert data_facts(checked)["image_stats_from"] == source


def test_the_start_says_the_images_and_classes_that_train_and_warns_of_classes_without_a_training_image():
    """One line of the training and evaluation images (and the split evaluated on, where the source names it), the
    classes and the fewest and most training images a class has (by name); each class as many: that count. A class
    without a training image (a --train-subset too small, a load_data whose labels miss a class) is a warning naming it,
    the first 5 of many; a class without an evaluation image, another."""
    said = []
    loaders.say_counts(torch.tensor([0, 1, 1, 2, 2, 2]), torch.arange(3), ("ant", "bee", "cow"), said.append)
    loaders.say_counts(torch.tensor([0, 1, 0, 1]), torch.arange(2), ("ant", "bee"), said.append, "val")
    loaders.say_counts(torch.tensor([1, 1, 7]), torch.arange(5), tuple("abcdefgh"), said.append)
    assert said == [
        "data: 6 training and 3 evaluation images of 3 classes (1 training image of ant to 3 of cow)",
        "data: 4 training and 2 evaluation images (val) of 2 classes (2 training images each)",
        "data: 3 training and 5 evaluation images of 8 classes (0 training images of a to 2 of b)",
        "warning: 6 of the 8 classes have no training image (a, c, d, e, f and 1 more): the model cannot learn them",
        "warning: 3 of the 8 classes have no evaluation image (f, g, h): their accuracy is not measured"]


def test_a_channel_the_same_in_every_training_pixel_is_normalised_unscaled_not_divided_by_zero():
    """Training images whose green channel is 0 in every pixel (red and blue vary): their own std of green is 0, so it
    is taken as 1 and said in the normalising line; a batch comes out of the transform finite, green all 0 and red
    and blue as (x - mean) / std. load_data's own std of 0 is one line."""
    from utils.data.contract import checked_data

    images = torch.zeros(4, 3, 2, 2, dtype=torch.uint8)
    images[:2, 0], images[:, 2, 0] = 255, 51  # red: half 255, half 0; blue: rows of 51 and 0
    data = {"train": (images, [0, 1, 0, 1]), "test": (images, [0, 1, 0, 1]), "classes": ["a", "b"]}
    said = []
    checked = checked_data(data, say=said.append)
    assert checked["std"] == (0.5, 1.0, 0.1) and checked["mean"] == (0.5, 0.0, 0.1)
    assert said == ["normalising with the training images' mean (0.5000, 0.0000, 0.1000) and std (0.5000, 1.0000, "
                    "0.1000); the green channel is the same in every training pixel: std 1 there, not 0"]
    x = BatchTransform.for_data(checked, torch.device("cpu"), channels_last=False)(images)
    assert torch.isfinite(x).all() and (x[:, 1] == 0).all()
    assert torch.allclose(x[:, 0], (images[:, 0] / 255 - 0.5) / 0.5) and torch.allclose(x[:, 2], (images[:, 2] / 255
                                                                                                 - 0.1) / 0.1)
    with pytest.raises(UserError, match=r"^load_data's std \(0\.2000, 0\.0000, 0\.2000\) is not above 0 for green: "
                                        r"the inputs are divided by it\.$"):
        checked_data(data | {"mean": (0.5,) * 3, "std": (0.2, 0.0, 0.2)})


def test_a_dataset_on_the_device_and_arrays_under_resized_crops_are_refused_with_one_line(tmp_path):
    """--data-on-device needs decoded images: one line for a Dataset; --augment resized-crop needs images decoded as
    they are cropped: one line for arrays."""
    from utils.data.contract import checked_data
    from utils.data.loaders import build_loaders
    from utils.plan import BatchPlan

    items = Items([(torch.zeros(3, 8, 8, dtype=torch.uint8), k % 2) for k in range(8)])
    arrays = (torch.zeros(8, 3, 8, 8, dtype=torch.uint8), [k % 2 for k in range(8)])
    plan = BatchPlan(micro=4, processes=1, accumulation=1)
    accelerator = Accelerator(cpu=True)
    refusals = ((items, dict(data_on_device=True), "--data-on-device keeps decoded images on the GPU"),
                (arrays, dict(augment="resized-crop"), "--augment resized-crop crops whole images as they are decoded: "
                 "load_data must return images decoded on the fly (a torch Dataset,"))
    for split, flags, message in refusals:
        data = checked_data({"train": split, "test": split, "classes": ["a", "b"]})
        cfg = SimpleNamespace(train_subset=None, eval_subset=None, data_on_device=False, augment="standard", seed=0,
                              mixup=0.0, cutmix=0.0, mix_prob=1.0, data_workers=None, dist_timeout=600)
        vars(cfg).update(flags)
        with pytest.raises(UserError, match=re.escape(message)):
            build_loaders(data, cfg, accelerator, plan)
