"""Image classification data as uint8 tensors: read (local parquet, an image folder or a Hub dataset), decode once,
cache, batch, augment. CIFAR-10 is the default; any small-image dataset works.

The pipeline, and why it never starves a GPU:
  1. `load_data` reads the parquet files (the Hub layout of uoft-cs/cifar10), an image folder (train/<class>/*.png,
     test/<class>/...) or a Hub dataset by name with `datasets`' own builders, decodes every image once into an
     (N, 3, S, S) uint8 tensor stored channels-last (NHWC in memory, as the JPEGs decode and as the models run) and
     caches that as a safetensors file, keyed by the source files and the decode settings, so later runs load it in
     about a second. A source without a test split gets a fixed held-out part of train (`hold_out`).
  2. `BatchedTensorDataset.__getitems__` returns a whole batch with one tensor index, so the DataLoader
     that `accelerator.prepare` wraps (sharding, per-epoch reshuffle, skip_first_batches,
     gather_for_metrics all stay Accelerate's) does no per-image Python work.
  3. `BatchTransform` crops, flips and normalises the whole uint8 batch on the training device, after the (4x
     smaller than float) transfer, with crops and flips keyed by (seed, epoch, sample index) (`augment_draws`),
     so the same at any process count. In NHWC a row of an image is one contiguous run of 96 bytes, so a crop is
     a copy of 32 rows, not of 3072 pixels.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import tempfile
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from utils import UserError

HUB_DATASET = "uoft-cs/cifar10"  # --dataset's default
SPLITS = ("train", "test")  # the loaded data's keys: "test" is the evaluation split, whatever its source
EVAL_SPLITS = ("test", "validation")  # the source's evaluation split: the first of these it has
VAL_FRACTION = 0.1  # held out of train for evaluation when the source has no evaluation split
DECODE_TIMEOUT = timedelta(hours=12)  # how long the other processes wait for the decoding ones
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
MEAN = (0.4914, 0.4822, 0.4465)  # per-channel mean of the CIFAR-10 training images, in [0, 1]
STD = (0.2470, 0.2435, 0.2616)
CACHE_FORMAT = 5  # bump when the cached tensors change meaning (4: class names, mean and std; 5: held-out splits)
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
        raise UserError(f"--data-dir {root} does not exist or is not a directory.")
    parquet = {split: sorted(root.rglob(f"{split}-*.parquet")) for split in ("train", *EVAL_SPLITS)}
    if parquet["train"]:
        eval_split = next((s for s in EVAL_SPLITS if parquet[s]), None)
        return "parquet", {s: parquet[s] for s in ("train", eval_split) if s}
    if (root / "train").is_dir() and any(d.is_dir() for d in (root / "train").iterdir()):
        return "imagefolder", _image_folder_files(root)
    raise UserError(
        f"--data-dir {root} holds no train-*.parquet file and no image folder (train/<class>/*.png, "
        f"test/<class>/...); expected the parquet layout of a Hub dataset such as {HUB_DATASET}, or such a folder."
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
            raise UserError(f"{path} is not a readable parquet file ({_first_line(e)}).") from None
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
        raise UserError(f"cannot read the {kind} files in {files['train'][0].parent}: {_first_line(cause)}") from None


def _read_hub(name: str):
    import datasets

    try:
        return datasets.load_dataset(name)
    except Exception as e:
        raise UserError(
            f"could not download {name} from the Hugging Face Hub ({_first_line(e)}); either pass "
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


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
    None: the split's own size, which all its images must share)."""
    rows = _rows(ds, split, columns)
    return _decode(rows, split, size or common_size({split: rows})), rows.labels, rows.names


class _Rows:
    """A split's undecoded images (each a parquet row's bytes or an image folder's path), labels and class names."""

    def __init__(self, sources: list, labels: np.ndarray, names: tuple[str, ...] | None):
        self.sources, self.labels, self.names = sources, torch.from_numpy(labels.astype(np.int64)), names

    def __len__(self) -> int:
        return len(self.sources)


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
    # Undecoded: we decode straight into one preallocated array instead of one PIL object per row. A parquet row
    # holds the image's bytes; an image folder's row holds its path.
    table = ds.cast_column(image_col, ImageFeature(decode=False)).with_format("arrow")[:]
    column = table.column(image_col).combine_chunks()
    sources = [blob if blob is not None else path for blob, path in
               zip(column.field("bytes").to_pylist(), column.field("path").to_pylist())]
    return _Rows(sources, table.column(label_col).to_numpy(zero_copy_only=False), names)


def _open(source, split: str, i: int):
    """The PIL image of a row (lazy: only its header is read until the pixels are asked for); one line if broken."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
    except (UnidentifiedImageError, OSError, TypeError) as e:
        raise UserError(f"the {split} split has an undecodable image at {_where(source, i)} ({_first_line(e)}).") \
            from None


def _where(source, i: int) -> str:
    return f"row {i}" if isinstance(source, bytes) else str(source)


def common_size(splits: dict[str, _Rows]) -> int:
    """The one square size all images share (read from their headers); else one line asking for --image-size."""
    sizes = {}
    for split, rows in splits.items():
        for i, source in enumerate(rows.sources):
            with _open(source, split, i) as im:
                sizes.setdefault(im.size, (split, _where(source, i)))
            if len(sizes) > 1:
                break
    (w, h), first = next(iter(sizes.items()))
    if len(sizes) > 1 or w != h:
        other = [f"{a}x{b} (the {split} split's {where})" for (a, b), (split, where) in sizes.items()]
        raise UserError(f"the images do not share one square size ({', '.join(other)}); pass --image-size S to "
                        f"resize every image to S x S.")
    return w


def _decode(rows: _Rows, split: str, size: int) -> torch.Tensor:
    from PIL import Image

    images = np.empty((len(rows), size, size, 3), dtype=np.uint8)
    for i, source in enumerate(rows.sources):
        try:
            with _open(source, split, i) as im:
                im = im.convert("RGB")  # grayscale repeated into 3 channels, RGBA's alpha dropped, palettes expanded
                if im.size != (size, size):
                    im = im.resize((size, size), Image.Resampling.BICUBIC)
                images[i] = np.asarray(im)
        except OSError as e:  # a header that reads but pixels that do not (a truncated file)
            raise UserError(f"the {split} split has an undecodable image at {_where(source, i)} "
                            f"({_first_line(e)}).") from None
    return torch.from_numpy(images).permute(0, 3, 1, 2)


def channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation (population) of uint8 (N, 3, S, S) images, in [0, 1]: what the
    transform normalises with. Summed in float64, a few million pixels at a time."""
    pixels = images.permute(0, 2, 3, 1).reshape(-1, 3)  # a view of channels-last memory
    total, squares = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for chunk in pixels.split(1 << 22):
        chunk = chunk.double()
        total += chunk.sum(0)
        squares += (chunk * chunk).sum(0)
    n = max(len(pixels), 1)
    mean = total / n
    std = (squares / n - mean * mean).clamp(min=0).sqrt()
    return tuple((mean / 255).tolist()), tuple((std / 255).tolist())


def available_memory() -> int | None:
    """Bytes of memory available now (Linux's MemAvailable); None where the kernel does not say."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def check_memory(images: int, size: int) -> None:
    """Stops before decoding if the uint8 tensors would not fit in the memory available now (no check where that is
    unknown). The cache write needs a second copy of each split for a moment, so twice the tensors' size counts."""
    needed, available = 2 * images * 3 * size * size, available_memory()
    if available is not None and needed > available:
        raise UserError(f"decoding {images:,} images at {size}x{size} needs about {needed / 2**30:,.1f} GiB of memory "
                        f"(the uint8 tensors and a copy for the cache), more than the {available / 2**30:,.1f} GiB "
                        f"available; use a smaller --image-size or fewer images.")


def crop_padding(size: int) -> int:
    """The zero padding of the random crop: 4 pixels at 32 x 32, in proportion at other sizes."""
    return max(1, round(size / 8))


def _classes(decoded: dict[str, tuple], eval_name: str) -> tuple[str, ...]:
    """The class names both splits share: the ClassLabel's, or "0".."C-1" for integer labels, which must then be
    exactly 0..C-1 in the training split (C: how many distinct labels it has). Every label must name a class."""
    names = {split: found for split, (_, _, found) in decoded.items()}
    if names["train"] != names["test"]:
        described = {s: ", ".join(n[:12]) + (", ..." if len(n) > 12 else "") if n else "integers" for s, n in
                     names.items()}
        raise UserError(f"the train and {eval_name} splits have different classes (train: {described['train']}; "
                        f"{eval_name}: {described['test']}).")
    classes = names["train"]
    if classes is None:
        count = len(torch.unique(decoded["train"][1]))
        classes = tuple(str(k) for k in range(count))
    for split, (_, labels, _) in decoded.items():
        bad = torch.nonzero((labels < 0) | (labels >= len(classes))).flatten()
        if len(bad):
            row = int(bad[0])
            why = (f"labels must be 0-{len(classes) - 1}" if names["train"] else
                   f"a label column without class names must hold the integers 0..C-1, and the training split has "
                   f"{len(classes)} distinct labels")
            raise UserError(f"the {split} split has label {int(labels[row])} at row {row} ({len(bad)} rows in all); "
                            f"{why}.")
    return classes


# ----------------------------------------------------------------------------------------------------
# Cache
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
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:  # images stored as (N, 32, 32, 3): contiguous tensors only
            t = {k: f.get_tensor(k) for k in f.keys()}
            about = {k: tuple(json.loads(v)) for k, v in f.metadata().items() if k in ("classes", "mean", "std")}
        return {**{s: (t[f"{s}_images"].permute(0, 3, 1, 2), t[f"{s}_labels"]) for s in SPLITS}, **about}
    except Exception as e:  # a truncated or foreign file: decode again rather than fail
        warnings.warn(f"ignoring unreadable cache {path} ({_first_line(e)}); decoding the source again")
        return None


def _write_cache(path: Path, data: dict) -> None:
    from safetensors.torch import save_file

    if not _writable_dir(path.parent):
        warnings.warn(f"cache folder {path.parent} is not writable; the next run will decode again")
        return
    tensors = {f"{s}_{kind}": t for s, (images, labels) in ((s, data[s]) for s in SPLITS)
               for kind, t in (("images", images.permute(0, 2, 3, 1).contiguous()), ("labels", labels))}
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={k: json.dumps(list(data[k])) for k in ("classes", "mean", "std")})
        umask = os.umask(0)  # mkstemp made the file private (0600); give it the mode any new file gets (shared data
        os.umask(umask)  # folders on clusters: other users must read it too)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)  # atomic: a reader sees the old file or the complete new one, never a half
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_data(data_dir: str | None, cache_dir: str | None, accelerator=None, image_size: int | None = None,
              dataset: str | None = None, columns: tuple[str | None, str | None] = (None, None),
              val_fraction: float | None = None) -> dict:
    """{'train': (images, labels), 'test': (images, labels)} on the CPU ('test': the evaluation split), with 'classes'
    (the class names, label k names classes[k]), 'mean' and 'std' (per channel, of the training images, in [0, 1])
    and 'dataset' (where it came from, the fingerprint of its files, which split is evaluated on).

    The source: data_dir (parquet files or an image folder), else the Hub dataset `dataset` (default HUB_DATASET).
    image_size: resize every image to that square size; None: the images' own size, which they must all share.
    columns: the (image, label) column names; None: found by name. val_fraction: evaluate on that fraction of the
    training images, held out (hold_out); None: the source's test (or validation) split, else VAL_FRACTION held out.

    The local main process of each machine downloads (the Hub), decodes and writes the cache while the others wait,
    then they read it. An input error found there is raised on every process, so all exit with its message
    (instead of the others dying in a barrier with a traceback).
    """
    check_source(data_dir, dataset, val_fraction)
    settings = {"image_size": image_size, "columns": list(columns), "val_fraction": val_fraction}
    source = (data_dir, dataset or HUB_DATASET)
    if accelerator is None:  # one process, or a script without Accelerate (the benchmarks' seed copy)
        return _load(*source, cache_dir, print, True, settings)
    data = error = None
    if accelerator.is_local_main_process:
        try:
            data = _load(*source, cache_dir, accelerator.print, True, settings)
        except UserError as e:
            error = str(e)
    errors = [e for e in _gather_after_decoding(error) if e]  # also the barrier the other processes wait at
    if errors:
        raise UserError(errors[0])
    return data if data is not None else _load(*source, cache_dir, accelerator.print, False, settings)


def _gather_after_decoding(error: str | None) -> list:
    """Every process's error (None: none), once the decoding processes are done. Decoding a large dataset can take
    longer than --dist-timeout, the limit of the default process group's collectives, so the waiting happens in a
    gloo group of its own whose limit is DECODE_TIMEOUT (a dead process still ends the job: the launcher sees it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [error]
    group = dist.new_group(backend="gloo", timeout=DECODE_TIMEOUT)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error, group=group)
    dist.destroy_process_group(group)
    return gathered


def check_source(data_dir: str | None, dataset: str | None, val_fraction: float | None) -> None:
    """One line for flags that contradict each other or are out of range (the scripts call it before any output)."""
    if data_dir is not None and dataset is not None:
        raise UserError(f"pass either --data-dir ({data_dir}) or --dataset ({dataset}), not both.")
    if val_fraction is not None and not 0 < val_fraction < 1:
        raise UserError(f"--val-fraction must be between 0 and 1 (got {val_fraction:g}).")


def _load(data_dir, dataset: str, cache_dir, log, write_cache: bool, settings: dict):
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
        size = settings["image_size"] or common_size(rows)
        check_memory(sum(map(len, rows.values())), size)
        decoded = {role: (_decode(r, wanted[role], size), r.labels, r.names) for role, r in rows.items()}
        if kind == "imagefolder":  # rows come class by class: shuffle them once, with a fixed seed, so a prefix
            decoded = {s: (*_shuffled(images, labels), names) for s, (images, labels, names) in decoded.items()}
        if fraction:  # (class-balanced, as in the Hub's files)
            train, held_out = hold_out(*decoded["train"][:2], fraction)
            decoded = {"train": (*train, decoded["train"][2]), "test": (*held_out, decoded["train"][2])}
        data = {s: (images, labels) for s, (images, labels, _) in decoded.items()}
        data["classes"] = _classes(decoded, source_eval or "test")
        data["mean"], data["std"] = channel_stats(data["train"][0])
        if write_cache:
            _write_cache(path, data)
    if fraction:
        n, k = len(data["train"][1]), len(data["test"][1])
        log(f"no evaluation split{' used' if source_eval else ''}: evaluating on {k:,} of the {n + k:,} training "
            f"images, held out by --val-fraction {fraction:g} (a fixed shuffle: the same on every process and run); "
            f"training on the other {n:,}")
    data["dataset"] = {"source": str(data_dir) if data_dir is not None else dataset, "kind": kind,
                       "fingerprint": key, "eval_split": eval_split}
    return data


def hold_out(images: torch.Tensor, labels: torch.Tensor, fraction: float):
    """((images, labels) to train on, (images, labels) held out for evaluation): round(fraction x N) images drawn by
    a fixed permutation (seed 0, not --seed: changing the seed must not change what is evaluated on), each part in
    the source's order."""
    n = len(labels)
    k = round(fraction * n)
    if not 0 < k < n:
        raise UserError(f"--val-fraction {fraction:g} of {n:,} training images holds out {k:,}; both the training and "
                        f"the held-out part need at least one image.")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    nhwc = images.permute(0, 2, 3, 1)  # index rows of channels-last memory: the parts stay channels-last
    return tuple((nhwc.index_select(0, idx).permute(0, 3, 1, 2), labels[idx]) for idx in (order[k:].sort().values,
                                                                         order[:k].sort().values))


def _shuffled(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    return images.permute(0, 2, 3, 1)[order].permute(0, 3, 1, 2), labels[order]  # stays channels-last in memory


def check_one_batch(labels: torch.Tensor, batch_size: int, processes: int, accumulation: int = 1) -> None:
    """Training keeps whole global batches only: a split smaller than one would train nothing."""
    if len(labels) < batch_size * processes * accumulation:
        raise UserError(f"{len(labels)} training images do not fill one global batch of "
                        f"{batch_size * processes * accumulation} ({batch_size} on each of {processes} processes x "
                        f"{accumulation} accumulation steps).")


def take_prefix(pair: tuple[torch.Tensor, torch.Tensor], n: int | None, flag: str):
    """The first n (images, labels) of a split (all with n None); a prefix is class-balanced (rows are shuffled)."""
    images, labels = pair
    if n is not None and n > len(labels):
        raise UserError(f"{flag} {n} is larger than the split ({len(labels)} images).")
    return (images[:n], labels[:n]) if n is not None else pair


# ----------------------------------------------------------------------------------------------------
# Batched dataset and on-device augmentation
# ----------------------------------------------------------------------------------------------------
def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic): a counter-based hash, so the draw for key k is
    computed from k alone, in any order, by any process."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _stream(seed: int, epoch: int, purpose: int) -> np.ndarray:
    """A (1,) uint64 key of (seed, epoch, purpose): 0 the epoch's shuffle, 1 its augmentation."""
    return _splitmix64(np.array([(seed % 2**32) << 32 | (epoch % 2**30) << 2 | purpose], dtype=np.uint64))


def augment_draws(seed: int, epoch: int, indices, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The crop and flip of each training sample in `indices`, a function of (seed, epoch, sample index) only: an
    image is augmented the same way whichever process draws it at whatever process count. Returns (the positions
    in the batch of the images to mirror, each image's crop offset: an index into the (2 pad + 1)^2 (dy, dx)).
    On the host, beside the sampler's indices (128 hashes in numpy: about 50 us on the 2-core CPU), because how
    many images are mirrored sets the shapes of the transform's kernels: drawn on a GPU, that count would cost a
    device sync per batch."""
    h = _splitmix64(np.asarray(indices).astype(np.uint64) ^ _stream(seed, epoch, 1))
    mirrored = np.flatnonzero(h >> np.uint64(63))  # the top bit: a fair coin
    crop = (h & np.uint64(0xFFFFFFFF)) % np.uint64((2 * pad + 1) ** 2)  # the low 32 bits: uniform to 2e-8
    return torch.from_numpy(mirrored.astype(np.int64)), torch.from_numpy(crop.astype(np.int64))


class BatchedTensorDataset(torch.utils.data.Dataset):
    """Images and labels as two tensors. The DataLoader calls `__getitems__` once per batch with the
    sampler's indices, so a batch costs one tensor index instead of `batch_size` Python calls.
    A training set (`augment_seed` given) returns (images, labels, draws): each sample's crop and flip for the
    current `epoch` (set by `EpochSampler`), from `augment_draws`; draws is None when `augment` is off."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment_seed: int | None = None,
                 augment: bool = True, pad: int = 4):
        assert len(images) == len(labels)
        # NHWC rows: a batch is then one row copy per image, and arrives in the layout the transform reads.
        self.images, self.labels = images.contiguous(memory_format=torch.channels_last), labels
        self.augment_seed, self.augment, self.pad, self.epoch = augment_seed, augment, pad, 0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]

    def __getitems__(self, indices: list[int]):
        # Measured on the 2-core CPU, 128 uint8 images:
        # - index_select copies whole rows: 8 us; advanced indexing (images[idx]) goes element by element: 2.3 ms.
        # - on the (N, 32, 32, 3) view the batch stays NHWC; on the channels-last 4-D tensor itself index_select
        #   returns NCHW (a transposing copy, 8x slower).
        # - the indices through numpy: 3 us; torch.as_tensor(list) 14 us.
        # non_blocking: with the data on a GPU a blocking copy would wait for all queued GPU work every batch (a
        # copy from pageable memory is staged before the call returns, so the host array may go away at once).
        host = np.asarray(indices, dtype=np.int64)  # once, for the batch and its draws
        idx = torch.from_numpy(host).to(self.labels.device, non_blocking=True)
        nhwc = self.images.permute(0, 2, 3, 1).index_select(0, idx)
        batch = nhwc.permute(0, 3, 1, 2), self.labels.index_select(0, idx)
        if self.augment_seed is None:
            return batch
        draws = augment_draws(self.augment_seed, self.epoch, host, self.pad) if self.augment else None
        return (*batch, draws)


class EpochSampler(torch.utils.data.Sampler):
    """The training order: a permutation of the samples per epoch, a function of (seed, epoch) only, cut to whole
    optimizer steps of `step_images` (the global batch). Accelerate's prepare() splits its micro-batches over the
    processes (micro-batch k to process k mod P), so optimizer step s takes the same micro-batches at any process
    count P with P x accumulation fixed.
    Written by hand because Accelerate's seedable sampler keeps the whole epoch and its shards then drop a tail that
    depends on P (a last, partial optimizer step of other micro-batches), and it cannot tell the dataset the epoch
    that keys the augmentation. Has no `generator` attribute on purpose: Accelerate then leaves the RNG alone."""

    def __init__(self, dataset: BatchedTensorDataset, seed: int, step_images: int):
        self.dataset, self.seed, self.step_images, self.epoch = dataset, seed, step_images, 0

    def set_epoch(self, epoch: int) -> None:  # called by the prepared loader's set_epoch and at each iteration
        self.epoch = self.dataset.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset) // self.step_images * self.step_images

    def __iter__(self):
        order = torch.Generator().manual_seed(int(_stream(self.seed, self.epoch, 0)[0]))
        return iter(torch.randperm(len(self.dataset), generator=order)[:len(self)].tolist())


def keep_batch(batch):
    """collate_fn for BatchedTensorDataset: `__getitems__` already returned the collated batch."""
    return batch


def make_loader(images, labels, batch_size: int, train: bool, seed: int = 0, augment: bool = False, pad: int = 4,
                global_batch: int | None = None) -> torch.utils.data.DataLoader:
    """A plain DataLoader for `accelerator.prepare`. Training: `EpochSampler` (reshuffled per epoch from the seed,
    whole global batches only; global_batch unset: batch_size) and batches (images, labels, draws); evaluation keeps
    every image in order, as (images, labels)."""
    dataset = BatchedTensorDataset(images, labels, seed if train else None, augment, pad)
    sampler = EpochSampler(dataset, seed, global_batch or batch_size) if train else None
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=train,
        collate_fn=keep_batch,
        pin_memory=torch.cuda.is_available() and images.device.type == "cpu",  # asynchronous host-to-GPU copies
    )


class BatchTransform:
    """uint8 (B, 3, S, S) on the device -> normalised float batch (per-channel mean and std in [0, 1]: the data's,
    CIFAR-10's by default); given a training batch's draws (`augment_draws`), first a crop of each image (zero padding
    of `pad` pixels: crop_padding(S)) and its horizontal flip. Works in NHWC (channels-last) memory, which the
    loader delivers; --no-channels-last gets NCHW at the end. Holds no random state: the draws come with the batch."""

    def __init__(self, device: torch.device, channels_last: bool, pad: int = 4, mean: tuple[float, ...] = MEAN,
                 std: tuple[float, ...] = STD):
        self.channels_last, self.pad = channels_last, pad
        # (x - mean) / std as one fused x * scale + shift over rows of W pixels x 3 channels: with a
        # per-channel (3,) operand the innermost loop would be 3 long (5x slower on CPU than this).
        std, mean = torch.tensor(std, device=device) * 255, torch.tensor(mean, device=device) * 255
        self.scale, self.shift = 1 / std, -mean / std
        self.row_scale_shift = {}  # width -> (scale, shift) tiled along a row
        self.canvas = None  # (2B, H + 2 pad, W + 2 pad, 3) uint8 with a zero border, kept between batches

    def __call__(self, images: torch.Tensor, draws: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if draws is not None:
            images = self.crop_and_flip(images, draws)
        n, c, h, w = images.shape
        rows = images.permute(0, 2, 3, 1).reshape(n * h, w * c)  # a view for channels-last input
        if w not in self.row_scale_shift:
            self.row_scale_shift[w] = self.scale.repeat(w), self.shift.repeat(w)
        scale, shift = self.row_scale_shift[w]
        x = torch.addcmul(shift, rows, scale).view(n, h, w, c).permute(0, 3, 1, 2)  # float, channels-last
        return x if self.channels_last else x.contiguous()

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


# ----------------------------------------------------------------------------------------------------
# The scripts' loaders
# ----------------------------------------------------------------------------------------------------
def build_loaders(cfg, accelerator, plan):
    """Training and test DataLoaders over whole splits held as uint8 tensors (decoded once, cached), and what the
    data is (load_data's 'classes', 'dataset', and 'image_size'); prepare() then shards the loaders and moves
    batches to the device. The training order and augmentation are keyed by --seed, the epoch and the sample, and
    every epoch is whole optimizer steps of the plan's global batch (utils.launch.BatchPlan). cfg: a script's Config
    (data_dir, cache_dir, train_subset, eval_subset, data_on_device, dataset, image_column, label_column,
    val_fraction, seed, augment). Your own data: return yours here."""
    data = load_data(cfg.data_dir, cfg.cache_dir, accelerator, cfg.image_size, cfg.dataset,
                     (cfg.image_column, cfg.label_column), cfg.val_fraction)
    train_split = take_prefix(data["train"], cfg.train_subset, "--train-subset")
    eval_split = take_prefix(data["test"], cfg.eval_subset, "--eval-subset")
    check_one_batch(train_split[1], plan.micro, accelerator.num_processes, plan.accumulation)
    if cfg.data_on_device:  # GPU-resident: Accelerate's move to the device becomes a no-op
        train_split, eval_split = ([t.to(accelerator.device) for t in split] for split in (train_split, eval_split))
    size = int(train_split[0].shape[-1])
    about = {k: data[k] for k in ("classes", "dataset", "mean", "std")} | {"image_size": size}
    train = make_loader(*train_split, plan.micro, train=True, seed=cfg.seed, augment=cfg.augment == "standard",
                        pad=crop_padding(size), global_batch=plan.global_batch)
    return train, make_loader(*eval_split, plan.micro, train=False), about
