"""Image classification data, decoded once: read a source (local parquet files, an image folder, or a Hub dataset),
hold out an evaluation part when the source has none, and decode every image, in parallel, straight into a
safetensors cache file through a memory map: one (N, S, S, 3) uint8 tensor per split (channels-last, as JPEGs
decode and as the models run), keyed by the source files and the decode settings. Every process then reads the
images through a map of that file: a machine's processes share one copy in the page cache, and a dataset larger
than memory trains from disk. This is the module to replace for data none of its sources covers; what its result
must satisfy is utils/batches.py's contract (docs/customizing.md).

`load_source` is the entry point: the first process of each machine reads and decodes, the others wait for it and then
read the cache. `datasets`' own builders (`parquet`, `imagefolder`, `load_dataset`) read the sources.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from utils import UserError, first_line
from utils.batches import SPLITS, channel_stats
from utils.config_groups import DATA_LAYOUTS, check_source
from utils.launch import first_on_each_machine

EVAL_SPLITS = ("test", "validation")  # the source's evaluation split: the first of these it has
VAL_FRACTION = 0.1  # held out of train for evaluation when the source has no evaluation split
CACHE_FORMAT = 6  # bump when the cache file changes (4: class names, mean and std; 5: held-out splits; 6: mean and
# std as tensors, labels first: decoded into through a memory map)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
IMAGE_COLUMNS, LABEL_COLUMNS = ("img", "image"), ("label", "labels", "fine_label")


# ----------------------------------------------------------------------------------------------------
# Source: local parquet files, an image folder, or the Hub
# ----------------------------------------------------------------------------------------------------
def find_source(data_dir: str | Path) -> tuple[str, dict[str, list[Path]]]:
    """What --data-dir holds: ("parquet", {split: its <split>-*.parquet files at any depth, as in a Hub snapshot}) or
    ("imagefolder", {split: the image files of <split>/<class>/}), for the splits found: train, and test or
    validation (the first of them that is there; neither: a part of train is held out, see hold_out)."""
    root = Path(data_dir)
    if not root.is_dir():
        raise UserError(f"--data-dir {root} does not exist or is not a directory. {DATA_LAYOUTS}")
    parquet = {split: sorted(root.rglob(f"{split}-*.parquet")) for split in ("train", *EVAL_SPLITS)}
    if parquet["train"]:
        eval_split = next((s for s in EVAL_SPLITS if parquet[s]), None)
        return "parquet", {s: parquet[s] for s in ("train", eval_split) if s}
    if (root / "train").is_dir() and any(d.is_dir() for d in (root / "train").iterdir()):
        return "imagefolder", _image_folder_files(root)
    raise UserError(
        f"--data-dir {root} holds no train-*.parquet file and no image folder (train/<class>/*.png, "
        f"test/<class>/...); expected the parquet layout of a Hub dataset (data/train-*.parquet), or such a folder."
    )


def _image_folder_files(root: Path) -> dict[str, list[Path]]:
    splits = ["train"] + [s for s in EVAL_SPLITS if (root / s).is_dir()][:1]
    files, classes = {}, {}
    for split in splits:
        folder = root / split
        classes[split] = sorted(d.name for d in folder.iterdir() if d.is_dir())
        for name in classes[split]:
            if not any(f.suffix.lower() in IMAGE_SUFFIXES for f in (folder / name).iterdir()):
                raise UserError(f"the class folder {folder / name} holds no image ({', '.join(IMAGE_SUFFIXES)}).")
        files[split] = sorted(f for f in folder.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)
    if len(splits) == 2 and classes["train"] != classes[splits[1]]:
        differ = sorted(set(classes["train"]) ^ set(classes[splits[1]]))
        raise UserError(f"--data-dir {root}: train/ and {splits[1]}/ have different class folders ({', '.join(differ)} "
                        f"only in one of them).")
    return files


def _read_local(kind: str, files: dict[str, list[Path]]):
    """The splits through datasets' packaged builder for the kind ('parquet' or 'imagefolder'); both work offline."""
    import datasets
    import pyarrow.parquet as pq

    for path in (p for paths in files.values() for p in paths if kind == "parquet"):
        try:  # reading the footer names the broken file; load_dataset's error would not
            pq.read_metadata(path)
        except Exception as e:
            raise UserError(f"{path} is not a readable parquet file ({first_line(e)}).") from None
    try:
        if kind == "parquet":  # a builder per split: one for both would cast the test file to the train file's features
            return {s: datasets.load_dataset(kind, data_files={s: [str(p) for p in ps]}, split=s)  # (class names too)
                    for s, ps in files.items()}
        return datasets.load_dataset(kind, data_files={s: [str(p) for p in ps] for s, ps in files.items()})
    except Exception as e:
        cause = _root_cause(e)  # load_dataset wraps the real reason (a full disk, say) in DatasetGenerationError
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            cache = Path(datasets.config.HF_DATASETS_CACHE)
            free = shutil.disk_usage(cache if cache.exists() else Path.home()).free
            raise UserError(
                f"no space left on device while datasets copied {files['train'][0].parent} into its cache {cache} "
                f"({free / 2**20:,.0f} MiB free); free some space or point HF_DATASETS_CACHE at a larger disk."
            ) from None
        raise UserError(f"cannot read the {kind} files in {files['train'][0].parent}: {first_line(cause)}") from None


def _read_hub(name: str):
    import datasets

    try:
        return datasets.load_dataset(name)
    except Exception as e:
        raise UserError(
            f"could not download {name} from the Hugging Face Hub ({first_line(e)}); either pass "
            f"--data-dir with a local copy (train-*.parquet and test-*.parquet, or an image folder) or run with "
            f"internet access."
        ) from None


def _root_cause(e: BaseException) -> BaseException:
    """The innermost exception of a chain (raise ... from ..., or raised while handling another)."""
    seen = {id(e)}
    while (inner := e.__cause__ or e.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        e = inner
    return e


# ----------------------------------------------------------------------------------------------------
# Decode once into uint8 tensors
# ----------------------------------------------------------------------------------------------------
def _column(ds, split: str, names: tuple[str, ...], what: str, given: str | None) -> str:
    """The split's image or label column: `given` (--image-column / --label-column), else the first of `names`."""
    if given is not None:
        if given not in ds.column_names:
            raise UserError(f"the {split} split has no column {given!r} (--{what}-column); its columns: "
                            f"{ds.column_names}.")
        return given
    found = [n for n in names if n in ds.column_names]
    if not found:
        article = "an" if what == "image" else "a"
        raise UserError(f"the {split} split has columns {ds.column_names}; expected {article} {what} column named "
                        f"{' or '.join(repr(n) for n in names)} (or name it with --{what}-column).")
    return found[0]


def decode_split(ds, split: str, size: int | None = None, columns: tuple[str | None, str | None] = (None, None)
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[str, ...] | None]:
    """(N, 3, S, S) uint8 images (channels-last in memory), (N,) int64 labels and the class names (None for a
    label column of plain integers) from a datasets.Dataset with an image column (`img` or `image`) and a label
    column (`label`, `labels` or `fine_label`): a ClassLabel (the Hub's, an image folder's) or integers. columns:
    (image column, label column) instead of those names. Every image is converted to RGB and resized to S x S (size;
    None: the split's own size, which all its images must share). In memory, one process (load_source decodes into
    the cache file, in parallel)."""
    rows = _rows(ds, split, columns)
    size, same_as = (size, None) if size else first_size({split: rows})
    images = np.empty((len(rows), size, size, 3), dtype=np.uint8)
    _decode_rows(rows, size, images, 0, len(rows), same_as)
    return torch.from_numpy(images).permute(0, 3, 1, 2), rows.labels, rows.names


class _Rows:
    """A split's undecoded images (each a parquet row's bytes or an image folder's path), labels and class names;
    `numbers`: each row's number in the source split, for messages."""

    def __init__(self, sources: list, labels: torch.Tensor, names: tuple[str, ...] | None, split: str,
                 numbers: torch.Tensor | None = None):
        self.sources, self.labels, self.names, self.split = sources, labels, names, split
        self.numbers = numbers if numbers is not None else torch.arange(len(sources))

    def __len__(self) -> int:
        return len(self.sources)

    def take(self, order: torch.Tensor) -> _Rows:
        """These rows in `order` (indices): shuffles and held-out parts are chosen before decoding, as orders."""
        return _Rows([self.sources[i] for i in order.tolist()], self.labels[order], self.names, self.split,
                     self.numbers[order])


def _rows(ds, split: str, columns: tuple[str | None, str | None]) -> _Rows:
    from datasets import ClassLabel
    from datasets import Image as ImageFeature

    image_col = _column(ds, split, IMAGE_COLUMNS, "image", columns[0])
    label_col = _column(ds, split, LABEL_COLUMNS, "label", columns[1])
    if not isinstance(ds.features[image_col], ImageFeature):
        raise UserError(f"the {split} split's column {image_col!r} is {ds.features[image_col]}, not images.")
    feature = ds.features[label_col]
    names = tuple(feature.names) if isinstance(feature, ClassLabel) else None
    if names is None and not (hasattr(feature, "dtype") and feature.dtype.startswith(("int", "uint"))):
        raise UserError(f"the {split} split's label column {label_col!r} is {feature}, neither class names (a "
                        f"ClassLabel) nor integers.")
    # Undecoded: we decode straight into the cache file instead of one PIL object per row. A parquet row holds the
    # image's bytes; an image folder's row holds its path.
    table = ds.cast_column(image_col, ImageFeature(decode=False)).with_format("arrow")[:]
    column = table.column(image_col).combine_chunks()
    sources = [blob if blob is not None else path for blob, path in
               zip(column.field("bytes").to_pylist(), column.field("path").to_pylist())]
    labels = torch.from_numpy(table.column(label_col).to_numpy(zero_copy_only=False).astype(np.int64))
    return _Rows(sources, labels, names, split)


def _open(source, split: str, where: str):
    """The PIL image of a row (lazy: only its header is read until the pixels are asked for); one line if broken."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
    except (UnidentifiedImageError, OSError, TypeError) as e:
        raise UserError(f"the {split} split has an undecodable image at {where} ({first_line(e)}).") from None


def _where(rows: _Rows, i: int) -> str:
    source = rows.sources[i]
    return f"row {int(rows.numbers[i])}" if isinstance(source, bytes) else str(source)


def first_size(splits: dict[str, _Rows]) -> tuple[int, str]:
    """The first image's size, which must be square, and where it is: every other image must share it when no
    --image-size is given (the decode checks each as it opens it: one pass over the files)."""
    rows = next(iter(splits.values()))
    with _open(rows.sources[0], rows.split, _where(rows, 0)) as im:
        (w, h), where = im.size, f"{im.size[0]}x{im.size[1]} (the {rows.split} split's {_where(rows, 0)})"
    if w != h:
        raise UserError(f"the images do not share one square size ({where}); pass --image-size S to resize every "
                        f"image to S x S.")
    return w, where


def _decode_rows(rows: _Rows, size: int, out: np.ndarray, start: int, stop: int, same_as: str | None = None) -> None:
    """Decodes rows start..stop-1 into out[start:stop] ((N, S, S, 3) uint8: a memory map of the cache file), each
    resized to S x S; same_as (the first image's size and place, see first_size): instead, each must be S x S."""
    from PIL import Image

    for i in range(start, stop):
        try:
            with _open(rows.sources[i], rows.split, _where(rows, i)) as im:
                if im.size != (size, size) and same_as:
                    raise UserError(f"the images do not share one square size ({same_as}, {im.size[0]}x{im.size[1]} "
                                    f"(the {rows.split} split's {_where(rows, i)})); pass --image-size S to resize "
                                    f"every image to S x S.")
                im = im.convert("RGB")  # grayscale repeated into 3 channels, RGBA's alpha dropped, palettes expanded
                if im.size != (size, size):
                    im = im.resize((size, size), Image.Resampling.BICUBIC)
                out[i] = np.asarray(im)
        except OSError as e:  # a header that reads but pixels that do not (a truncated file)
            raise UserError(f"the {rows.split} split has an undecodable image at {_where(rows, i)} "
                            f"({first_line(e)}).") from None


DECODE_CHUNK = 512  # rows a decode worker takes at a time
_JOB = None  # (rows, outputs, size, same_as) of the running parallel decode: forked workers inherit it, unpickled


def _decode_chunk(role: str, start: int, stop: int) -> None:
    rows, outputs, size, same_as = _JOB
    _decode_rows(rows[role], size, outputs[role], start, stop, same_as)


def decode_all(rows: dict[str, _Rows], outputs: dict[str, np.ndarray], size: int, workers: int,
               same_as: str | None = None) -> None:
    """Decodes every split's rows into its output array (_decode_rows), with `workers` processes. The workers are
    forked (as PyTorch's DataLoader workers are): they inherit the rows and the outputs, memory maps of the cache file
    that they write into, so no image crosses a pipe. Each row is decoded alone: the result is the same bit for bit
    for any number of workers. An undecodable image (or one of another size, with same_as) stops the decode with the
    first bad row's line, as one worker would.
    Written with concurrent.futures: datasets' map(num_proc=...) would write every decoded image to an Arrow cache
    first, a second copy on disk."""
    global _JOB
    chunks = [(role, a, min(a + DECODE_CHUNK, len(r))) for role, r in rows.items() for a in range(0, len(r),
                                                                                                 DECODE_CHUNK)]
    if workers <= 1 or len(chunks) <= 1:
        for role, start, stop in chunks:
            _decode_rows(rows[role], size, outputs[role], start, stop, same_as)
        return
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    _JOB = rows, outputs, size, same_as
    pool = ProcessPoolExecutor(min(workers, len(chunks)), mp_context=multiprocessing.get_context("fork"))
    try:
        for future in [pool.submit(_decode_chunk, *chunk) for chunk in chunks]:
            future.result()  # in row order
    except BrokenProcessPool:
        raise UserError(f"a decode worker died (killed, or out of memory) while decoding with --decode-workers "
                        f"{workers}; try fewer workers.") from None
    finally:
        pool.shutdown(cancel_futures=True)
        _JOB = None


def _classes(rows: dict[str, _Rows], eval_name: str) -> tuple[str, ...]:
    """The class names both splits share: the ClassLabel's, or "0".."C-1" for integer labels, which must then be
    exactly 0..C-1 in the training split (C: how many distinct labels it has). Every label must name a class.
    Checked before decoding."""
    names = {role: r.names for role, r in rows.items()}
    if names["train"] != names["test"]:
        described = {s: ", ".join(n[:12]) + (", ..." if len(n) > 12 else "") if n else "integers" for s, n in
                     names.items()}
        raise UserError(f"the train and {eval_name} splits have different classes (train: {described['train']}; "
                        f"{eval_name}: {described['test']}).")
    classes = names["train"]
    if classes is None:
        count = len(torch.unique(rows["train"].labels))
        classes = tuple(str(k) for k in range(count))
    for r in rows.values():
        bad = torch.nonzero((r.labels < 0) | (r.labels >= len(classes))).flatten()
        if len(bad):
            why = (f"labels must be 0-{len(classes) - 1}" if names["train"] else
                   f"a label column without class names must hold the integers 0..C-1, and the training split has "
                   f"{len(classes)} distinct labels")
            raise UserError(f"the {r.split} split has label {int(r.labels[bad[0]])} at row {int(r.numbers[bad[0]])} "
                            f"({len(bad)} rows in all); {why}.")
    return classes


# ----------------------------------------------------------------------------------------------------
# Cache: one safetensors file, decoded into through a memory map and read through one
# ----------------------------------------------------------------------------------------------------
def _fingerprint(paths: list[str | Path], settings: dict) -> str:
    """Changes when any source file is replaced, grown or touched, or the decoding settings change; cheap (no hashing
    of the contents)."""
    stats = [(str(Path(p).resolve()), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths]
    return hashlib.sha256(json.dumps([CACHE_FORMAT, stats, settings], sort_keys=True).encode()).hexdigest()[:16]


def _writable_dir(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def default_cache_dir(data_dir: str | None) -> Path:
    """<data-dir>/.decoded when that can be written, else a per-user cache folder. A data folder without
    write permission bits counts as read-only even for root, who could write there anyway."""
    if data_dir is not None and os.stat(data_dir).st_mode & 0o222 and _writable_dir(Path(data_dir) / ".decoded"):
        return Path(data_dir) / ".decoded"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "accelerate-cifar"


def _read_cache(path: Path) -> dict | None:
    """The cached splits as tensors backed by a memory map of the file (safetensors' safe_open maps it for PyTorch):
    a machine's processes share its pages through the page cache, and a dataset larger than memory is read from
    disk as the batches ask for it."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            t, about = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        return {**{s: (t[f"{s}_images"].permute(0, 3, 1, 2), t[f"{s}_labels"]) for s in SPLITS},
                "classes": tuple(json.loads(about["classes"])), "mean": tuple(t["mean"].tolist()),
                "std": tuple(t["std"].tolist())}
    except Exception as e:  # a truncated or foreign file: decode again rather than fail
        warnings.warn(f"ignoring unreadable cache {path} ({first_line(e)}); decoding the source again")
        return None


def _layout(counts: dict[str, int], size: int, classes: tuple[str, ...]) -> tuple[bytes, dict, int]:
    """The cache file's safetensors header and where each tensor lies: (header bytes, {name: (numpy dtype, shape,
    first byte in the file)}, file size). Labels, mean and std (8-byte values) first, then the images as (N, S, S, 3)
    uint8, so every tensor is aligned. Written by hand because safetensors' writers need the tensors in memory, and
    these are decoded straight into the file."""
    specs = [*((f"{s}_labels", np.int64, "I64", (counts[s],)) for s in SPLITS), ("mean", np.float64, "F64", (3,)),
             ("std", np.float64, "F64", (3,)), *((f"{s}_images", np.uint8, "U8", (counts[s], size, size, 3))
                                                  for s in SPLITS)]
    header, places, offset = {"__metadata__": {"classes": json.dumps(list(classes))}}, {}, 0
    for name, dtype, code, shape in specs:
        end = offset + int(np.prod(shape)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, end]}
        places[name], offset = (dtype, shape, offset), end
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header with spaces to 8 bytes
    start = 8 + len(text)
    return len(text).to_bytes(8, "little") + text, {k: (d, sh, start + o) for k, (d, sh, o) in places.items()}, \
        start + offset


def _decode_into_cache(path: Path, rows: dict[str, _Rows], size: int, same_as: str | None, classes, workers: int,
                       log) -> dict:
    """Decodes the rows into a new cache file at `path` through a memory map (no copy of the images in this
    process's memory, so a dataset larger than memory decodes), then reads it back as _read_cache does. The file is
    complete before it is renamed into place: a reader sees the old file or the whole new one. Where the cache folder
    cannot be written, the same is done in a temporary file that is deleted once mapped (the next run decodes
    again)."""
    header, places, total = _layout({role: len(r) for role, r in rows.items()}, size, classes)
    keep = _writable_dir(path.parent)
    if not keep:
        warnings.warn(f"cache folder {path.parent} is not writable; decoding into a temporary file in "
                      f"{tempfile.gettempdir()}, and the next run will decode again")
    folder = path.parent if keep else Path(tempfile.gettempdir())
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    try:
        try:  # the blocks, reserved now: a full disk stops here, not with SIGBUS in the middle of a write to the map
            os.posix_fallocate(fd, 0, total)
        except OSError as e:
            raise UserError(f"the decoded images need {total / 2**20:,.1f} MiB in {folder}, which has "
                            f"{shutil.disk_usage(folder).free / 2**20:,.1f} MiB free ({os.strerror(e.errno)}); free "
                            f"some space, or pass --cache-dir on a larger disk (or a smaller --image-size).") from None
        os.pwrite(fd, header, 0)
        mapped = np.memmap(tmp, dtype=np.uint8, mode="r+", shape=(total,))
        views = {name: np.ndarray(shape, dtype, buffer=mapped, offset=at) for name, (dtype, shape, at) in
                 places.items()}
        for role, r in rows.items():
            views[f"{role}_labels"][:] = r.labels.numpy()
        log(f"decoding {sum(map(len, rows.values())):,} images with {workers} process{'es' * (workers > 1)} "
            f"(--decode-workers)")
        decode_all(rows, {role: views[f"{role}_images"] for role in rows}, size, workers, same_as)
        views["mean"][:], views["std"][:] = channel_stats(torch.from_numpy(views["train_images"]).permute(0, 3, 1, 2))
        mapped.flush()
        del mapped, views  # unmapped: what follows reads the file as any later run does
        if keep:
            umask = os.umask(0)  # mkstemp made the file private (0600); give it the mode any new file gets (shared
            os.umask(umask)  # data folders on clusters: other users must read it too)
            os.fchmod(fd, 0o666 & ~umask)
            os.replace(tmp, path)
        data = _read_cache(Path(path if keep else tmp))
        if data is None:
            raise UserError(f"the cache file just written at {path if keep else tmp} cannot be read back.")
        return data
    finally:
        os.close(fd)
        if os.path.exists(tmp):
            os.remove(tmp)


# ----------------------------------------------------------------------------------------------------
# The entry point: read, decode and cache once per machine, the others read the cache; the held-out split
# ----------------------------------------------------------------------------------------------------
def load_source(data_dir: str | None, dataset: str | None = None, image_size: int | None = None,
                columns: tuple[str | None, str | None] = (None, None), val_fraction: float | None = None,
                cache_dir: str | None = None, decode_workers: int | None = None) -> dict:
    """The built-in sources, as a template's load_data returns them: {'train': (images, labels), 'test': (images,
    labels)} on the CPU ('test': the evaluation split), with 'classes' (the class names, label k names classes[k]),
    'mean' and 'std' (per channel, of the training images, in [0, 1]) and 'dataset' (where it came from, the
    fingerprint of its files, which split is evaluated on). The images are (N, 3, S, S) uint8 views of a memory map
    of the cache file (channels-last in memory): the processes of a machine share one copy in the page cache.

    The source: data_dir (parquet files or an image folder), or the Hub dataset `dataset` (one of the two).
    image_size: resize every image to that square size; None: the images' own size, which they must all share.
    columns: the (image, label) column names; None: found by name. val_fraction: evaluate on that fraction of the
    training images, held out (hold_out); None: the source's test (or validation) split, else VAL_FRACTION held out.
    cache_dir: where the decoded cache goes (default_cache_dir). decode_workers: processes that decode (the first
    run); None: one per core this process may run on.

    The first process of each machine downloads (the Hub), decodes and writes the cache while the others wait, then
    they read it (first_on_each_machine: an input error found there stops every process with its line). Where the
    cache could not be written, each process decodes for itself with its share of the cores.
    """
    check_source(data_dir, dataset, val_fraction)
    if data_dir is None and dataset is None:
        raise UserError("no data: pass --data-dir (a local folder) or --dataset (a Hub dataset id).")
    settings = {"image_size": image_size, "columns": list(columns), "val_fraction": val_fraction}
    workers = decode_workers or len(os.sched_getaffinity(0))
    log = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *_: None)
    if int(os.environ.get("LOCAL_RANK", "0")) > 0:
        workers = max(1, workers // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return first_on_each_machine(lambda: _load(data_dir, dataset, cache_dir, log, settings, workers))


def _load(data_dir, dataset: str, cache_dir, log, settings: dict, workers: int):
    if data_dir is not None:
        kind, files, dsd = *find_source(data_dir), None
        splits, paths = list(files), [p for ps in files.values() for p in ps]
    else:
        kind, dsd = "hub", _read_hub(dataset)  # the Hub client's own cache makes this cheap after the first download
        splits = list(dsd)
        if "train" not in splits:
            raise UserError(f"the Hub dataset {dataset} has no train split (its splits: {', '.join(splits)}).")
        paths = [f["filename"] for s in dsd for f in dsd[s].cache_files]
    source_eval = next((s for s in EVAL_SPLITS if s in splits), None)
    fraction = settings["val_fraction"] or (None if source_eval else VAL_FRACTION)
    eval_split = f"{fraction:g} of train, held out" if fraction else source_eval
    key = _fingerprint(paths, {**settings, "val_fraction": fraction})
    path = (Path(cache_dir) if cache_dir else default_cache_dir(data_dir)) / f"images-{key}.safetensors"
    data = _read_cache(path) if path.exists() else None
    if data is None:
        log(f"decoding the images once into uint8 tensors; cache: {path}")
        wanted = {"train": "train"} if fraction else {"train": "train", "test": source_eval}
        dsd = dsd if dsd is not None else _read_local(kind, {s: files[s] for s in wanted.values()})
        rows = {role: _rows(dsd[s], s, tuple(settings["columns"])) for role, s in wanted.items()}
        size, same_as = (settings["image_size"], None) if settings["image_size"] else first_size(rows)
        if kind == "imagefolder":  # rows come class by class: shuffle them once, with a fixed seed, so a prefix
            rows = {role: r.take(_permutation(len(r))) for role, r in rows.items()}  # is class-balanced, as in
        if fraction:  # the Hub's files
            rows = dict(zip(SPLITS, (rows["train"].take(part) for part in hold_out(len(rows["train"]), fraction))))
        classes = _classes(rows, source_eval or "test")
        data = _decode_into_cache(path, rows, size, same_as, classes, workers, log)
    if fraction:
        n, k = len(data["train"][1]), len(data["test"][1])
        log(f"no evaluation split{' used' if source_eval else ''}: evaluating on {k:,} of the {n + k:,} training "
            f"images, held out by --val-fraction {fraction:g} (a fixed shuffle: the same on every process and run); "
            f"training on the other {n:,}")
    data["dataset"] = {"source": str(data_dir) if data_dir is not None else dataset, "kind": kind,
                       "fingerprint": key, "eval_split": eval_split}
    return data


def _permutation(n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(0))


def hold_out(n: int, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows to train on, the rows held out for evaluation) of n training rows: round(fraction x n) rows drawn
    by a fixed permutation (seed 0, not --seed: changing the seed must not change what is evaluated on), each part
    in the source's order."""
    k = round(fraction * n)
    if not 0 < k < n:
        raise UserError(f"--val-fraction {fraction:g} of {n:,} training images holds out {k:,}; both the training and "
                        f"the held-out part need at least one image.")
    order = _permutation(n)
    return order[k:].sort().values, order[:k].sort().values
