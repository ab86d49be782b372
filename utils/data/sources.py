"""Image classification sources, read but not decoded: local parquet files, an image folder, or a Hub dataset (through
`datasets`), and a copy's own torch Dataset. `locate` finds what --data-dir / --dataset hold; `Source.rows` reads each
split's encoded images, labels and class names in a fixed order (an image folder's shuffled once, so a prefix is
class-balanced; a part of train held out when the source has no evaluation split).
A copy's Dataset (`DatasetRows`): items (image, label), the image a PIL image or a uint8 tensor of any size (square
without --image-size), read once when the data is checked (a lazily opened PIL image decodes nothing), then a batch at a
time in the loader's workers, as an image folder is. An index must give the same item every time."""

from __future__ import annotations

import abc
import csv
import errno
import hashlib
import io
import json
import os
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from utils import UserError, first_line
from utils.config_groups import DATA_LAYOUTS, check_source
from utils.data.pixels import as_rgb, check_pixels, encoded, encoded_source, open_encoded, open_image
from utils.launch import is_main_process, main_print
from utils.scripts import IMPORTED, new_after_imports

SPLITS = ("train", "test")  # load_data's splits: "test" is the one evaluated on
# the evaluation split without --eval-split: the first of these (datasets' SPLIT_KEYWORDS) the source has, validation
# before test (the best weights chosen on validation, a test split left for a final score)
EVAL_SPLITS = ("validation", "valid", "dev", "val", "test", "testing", "eval", "evaluation")
VAL_FRACTION = 0.1  # held out of train for evaluation when the source has no evaluation split
# photos by suffix: those Pillow opens here are read (HEIC with pi-heif), the others (JPEG XL, raw) left out, said
PHOTO_SUFFIXES = (".png", ".jpg", ".jpeg", ".jfif", ".jpe", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".heic", ".heif",
                  ".avif", ".jxl", ".dng", ".cr2", ".cr3", ".nef", ".arw", ".raf", ".orf", ".rw2")
IMAGE_SUFFIXES = tuple(s for s in PHOTO_SUFFIXES if s in Image.registered_extensions())
OTHER_PHOTOS = tuple(s for s in PHOTO_SUFFIXES if s not in IMAGE_SUFFIXES)
IMAGE_COLUMNS, LABEL_COLUMNS = ("img", "image"), ("label", "labels", "fine_label")
METADATA_FILES = ("metadata.csv", "metadata.jsonl")  # an image folder's labels by file name, as datasets reads them
# what to do when images of other sizes or shapes meet without --image-size
SIZE_ADVICE = ("pass --image-size S to resize every image to S x S (photos of many sizes and shapes: --image-size S "
               "--augment resized-crop, the natural-image recipe, crops each as it is decoded)")


@dataclass
class Source:
    """What `locate` found: its kind ('parquet', 'imagefolder' or 'hub'), its files by split (or the Hub's DatasetDict),
    the paths that fingerprint it, its own evaluation split, the fraction of train held out (None: none) and an image
    folder's class of each file."""
    name: str
    kind: str
    files: dict[str, list[Path]] | None
    hub: object | None
    paths: list
    source_eval: str | None
    fraction: float | None
    labels: dict[str, list[str]] | None = None
    read: tuple | None = None  # (columns, what rows() read with them)

    @property
    def eval_split(self) -> str:
        """What is evaluated on, for summary.json (evaluate_checkpoint.py compares it with the run's)."""
        return f"{self.fraction:g} of train, held out by class" if self.fraction else self.source_eval

    def count(self) -> int:
        """How many images its train and evaluation splits hold (parquet footers, file lists, split sizes)."""
        if self.hub is not None:
            return sum(self.hub[s].num_rows for s in ("train", self.source_eval) if s)
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            return sum(pq.read_metadata(p).num_rows for p in self.paths)
        return sum(map(len, self.files.values()))

    def announce_held_out(self, log, n_train: int, n_held: int) -> None:
        """Says what is evaluated on when a part of train is held out."""
        if self.fraction:
            log(f"no evaluation split{' used' if self.source_eval else ''}: evaluating on {n_held:,} of the "
                f"{n_train + n_held:,} training images, held out by --val-fraction {self.fraction:g} (each "
                f"class its share, by a fixed shuffle: the same on every process and run); training on the other "
                f"{n_train:,}")

    def describe(self, fingerprint: str) -> dict:
        """What summary.json records of the source; with the fraction held out, when one is."""
        held = {"val_fraction": self.fraction} if self.fraction else {}
        return {"source": self.name, "kind": self.kind, "fingerprint": fingerprint, "eval_split": self.eval_split,
                **held}

    def rows(self, columns: tuple[str | None, str | None]) -> tuple[dict[str, Rows], tuple[str, ...]]:
        """{'train': rows, 'test': rows} and the class names, read on the first call and kept: 'test' is the evaluation
        split or the part of train held out. An image folder has its own columns (the column flags are a table's)."""
        columns = (None, None) if self.kind == "imagefolder" else columns
        if self.read is None or self.read[0] != columns:
            wanted = {"train": "train"} if self.fraction else {"train": "train", "test": self.source_eval}
            dsd = self.hub if self.hub is not None else read_local(self.kind, {s: self.files[s] for s in
                                                                              wanted.values()}, self.labels)
            rows = {role: read_rows(dsd[s], s, columns) for role, s in wanted.items()}
            if self.kind == "imagefolder":
                rows = {role: r.take(_permutation(len(r))) for role, r in rows.items()}
            if self.fraction:
                rows = dict(zip(SPLITS, (rows["train"].take(part) for part in hold_out(rows["train"].labels,
                                                                                      self.fraction))))
            self.read = columns, (rows, shared_classes(rows, self.source_eval or "test"))
        return self.read[1]


def locate(data_dir: str | None, dataset: str | None, val_fraction: float | None, eval_split: str | None = None
           ) -> Source:
    """The source of --data-dir (its files, not read) or of the Hub dataset `dataset`, evaluated on `eval_split` (None:
    the first of EVAL_SPLITS it has)."""
    check_source(data_dir, dataset, val_fraction, eval_split)
    if data_dir is None and dataset is None:
        raise UserError("no data: pass --data-dir (a local folder) or --dataset (a Hub dataset id).")
    if data_dir is not None:
        kind, files, unread, labels = find_source(data_dir, eval_split)
        if unread:
            n = sum(unread.values())
            main_print(f"warning: left out {n:,} photo{'s' * (n != 1)} under --data-dir {data_dir} in formats the data "
                       f"path does not read ({counted(unread)}); convert them to JPEG to use them.")
        hub, splits, paths = None, list(files), [p for ps in files.values() for p in ps]
        paths += [m for s in files if kind == "imagefolder" and (m := metadata_file(split_folder(Path(data_dir), s)))]
        beside = folders_beside_train(Path(data_dir), files) if kind == "imagefolder" else []
        present, named = [*files, *beside], [d for d in beside if d not in EVAL_SPLITS]
        if named and len(files) == 1:
            main_print(f"warning: --data-dir {data_dir} holds {', '.join(d + '/' for d in named)} beside train/, "
                       f"which is not read: an evaluation split's folder is named test/, validation/ or val/.")
    else:
        kind, files, hub, labels = "hub", None, read_hub(dataset), None
        splits = list(hub)
        if "train" not in splits:
            raise UserError(f"the Hub dataset {dataset} has no train split (its splits: {', '.join(splits)}).")
        if eval_split is not None and eval_split not in splits:
            raise UserError(f"--eval-split {eval_split}: the Hub dataset {dataset} has no such split (its splits: "
                            f"{', '.join(splits)}).")
        paths, present = [f["filename"] for s in hub for f in hub[s].cache_files], splits
    source_eval = eval_split if eval_split in splits else next((s for s in EVAL_SPLITS if s in splits), None)
    left = [s for s in present if s in EVAL_SPLITS and s != source_eval]
    if left and source_eval and not (val_fraction or eval_split):  # a test split beside the validation split chosen
        main_print(f"evaluating on the {source_eval} split; {', '.join(left)} left for a final score: "
                   f"evaluate_checkpoint.py RUN/best.safetensors --eval-split {left[0]}")
    fraction = val_fraction or (None if source_eval else VAL_FRACTION)
    return Source(str(data_dir) if data_dir is not None else dataset, kind, files, hub, paths, source_eval, fraction,
                  labels)


def folders_beside_train(root: Path, files: dict[str, list[Path]]) -> list[str]:
    """The visible folders beside an image folder's train/ that are not read (none without a train/)."""
    if not (root / "train").is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and d.name not in files)


def first_image_size(data_dir: str, image_column: str | None = None) -> tuple[int, int] | None:
    """(width, height) of a local --data-dir's first training image from its header; None when it cannot be told cheaply
    (the load says what is wrong)."""
    try:
        kind, files, *_ = find_source(data_dir)
        first = files["train"][0]
        if kind == "parquet":
            import pyarrow.parquet as pq

            table = pq.ParquetFile(first).read_row_group(0)
            cell = table.column(pick_column(table.column_names, first, IMAGE_COLUMNS, "image", image_column))[0]
            first = io.BytesIO(cell.as_py()["bytes"])
        with Image.open(first) as im:
            return im.size
    except Exception:  # noqa: BLE001 - a broken source is reported by the load, in its own words
        return None


def fingerprint(paths: list[str | Path], settings: dict, version: int = 0) -> str:
    """Changes when a source file is replaced, grown or touched, or the settings change (no hashing)."""
    stats = [(str(Path(p).resolve()), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths]
    return hashlib.sha256(json.dumps([version, stats, settings], sort_keys=True).encode()).hexdigest()[:16]


def find_source(data_dir: str | Path, eval_split: str | None = None
                ) -> tuple[str, dict[str, list[Path]], Counter, dict[str, list[str]] | None]:
    """What --data-dir holds: ("parquet", {split: its <split>-*.parquet files}), ("imagefolder", {split: its files}:
    <split>/<class>/ or a metadata file; <class>/ alone is train) or ("shards", {}) for tar shards; the splits: train
    and `eval_split`, else the first of EVAL_SPLITS there. With the count of OTHER_PHOTOS left out and an image folder's
    class of each file."""
    root = Path(data_dir)
    if not root.is_dir():
        raise UserError(f"--data-dir {root} does not exist or is not a directory. {DATA_LAYOUTS}")
    found = sorted(root.rglob("*.parquet"))  # one walk of the folder, not one per split name
    names = (eval_split,) if eval_split else EVAL_SPLITS
    parquet = {split: [p for p in found if p.name.startswith(f"{split}-")] for split in ("train", *names)}
    if parquet["train"]:
        chosen = next((s for s in names if parquet[s]), None)
        if eval_split and not chosen:
            raise UserError(f"--eval-split {eval_split}: --data-dir {root} holds no {eval_split}-*.parquet file.")
        return "parquet", {s: parquet[s] for s in ("train", chosen) if s}, Counter(), None
    train = root / "train"
    if train.is_dir() and (metadata_file(train) or any(d.is_dir() for d in train.iterdir())):
        if eval_split and not (root / eval_split).is_dir():
            raise UserError(f"--eval-split {eval_split}: --data-dir {root} holds no {eval_split}/ folder beside "
                            f"train/.")
        return "imagefolder", *_image_folder_files(root, names)
    if any(names_split(p.name, "train") for p in root.rglob("*.tar")):
        return "shards", {}, Counter(), None
    folders = [d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")]
    if "train" in folders:
        raise UserError(f"{root / 'train'} holds no class folder: an image folder's images go in "
                        f"{root / 'train'}/<class>/, at any depth beneath it (or name their classes in a "
                        f"{root / 'train'}/metadata.csv of file_name and label).")
    if root.name in ("train", *EVAL_SPLITS):  # likely the split of an image folder, given for the folder
        raise UserError(f"--data-dir {root} holds no train/ folder: it is named as a split of an image folder; pass "
                        f"the folder that holds train/ and test/ (here {root.parent}), or give the class folders a "
                        f"folder of another name to train on them alone.")
    if split := next((s for s in EVAL_SPLITS if s in folders), None):
        raise UserError(f"--data-dir {root} holds {split}/ but no train/ beside it: training reads train/<class>/...; "
                        f"a trained run scores a folder of class folders with predict.py RUN {root / split} --output "
                        f"FILE.csv (its top-1 against the folder names).")
    if metadata_file(root) or folders and any(Path(name).suffix.lower() in IMAGE_SUFFIXES
                                              for _, _, names in os.walk(root) for name in names):
        if eval_split:
            raise UserError(f"--eval-split {eval_split}: --data-dir {root} holds class folders alone, no split.")
        return "imagefolder", *_image_folder_files(root, ())  # <class>/*.jpg alone: the train split, as datasets has it
    raise UserError(f"--data-dir {root} holds no train-*.parquet file, no image folder (train/<class>/*.png, "
                    f"test/<class>/...) and no tar shard (*-train-*.tar); expected the parquet layout of a Hub dataset "
                    f"(data/train-*.parquet), or such a folder or shards.")


def names_split(file_name: str, split: str) -> bool:
    """Whether a shard's file name names the split, set off by -, _ or . (train-0.parquet, a-train-0.tar)."""
    return re.search(rf"(^|[-_.]){split}[-_.]", file_name) is not None


def counted(suffixes: Counter) -> str:
    """'1 .avif, 2 .heic': how many files of each suffix."""
    return ", ".join(f"{n:,} {suffix}" for suffix, n in sorted(suffixes.items()))


def visible_files(folder: Path) -> list[Path]:
    """The files under `folder` at any depth, sorted, hidden ones left out, linked folders followed once. Written with
    os.walk: rglob neither prunes hidden folders nor follows links."""
    found, seen = [], set()
    for top, folders, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:  # reached again through a link
            folders[:] = []
            continue
        seen.add(real)
        folders[:] = [f for f in folders if not f.startswith(".")]
        found += [Path(top, name) for name in names if not name.startswith(".")]
    return sorted(found)


def split_folder(root: Path, split: str) -> Path:
    """An image folder's folder of a split: root/<split>, or root itself for train without a train/."""
    return root / split if split != "train" or (root / split).is_dir() else root


def _image_folder_files(root: Path, names: tuple[str, ...]
                        ) -> tuple[dict[str, list[Path]], Counter, dict[str, list[str]]]:
    """({split: its image files}, the photos of OTHER_PHOTOS left out, {split: each file's class}) for train and the
    first of `names` there: a file's class is its top folder under the split, or its metadata file's label."""
    splits = ["train"] + [s for s in names if (root / s).is_dir()][:1]
    files, labels, unread = {}, {}, Counter()
    for split in splits:
        folder = split_folder(root, split)
        if metadata := metadata_file(folder):
            files[split], labels[split] = listed_files(metadata)
            continue
        classes = sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
        found, depth = visible_files(folder), len(folder.parts)  # a file's class: its part at `depth`
        files[split] = [f for f in found if f.suffix.lower() in IMAGE_SUFFIXES]
        labels[split] = [f.parts[depth] for f in files[split]]
        loose = [f for f in files[split] if len(f.parts) == depth + 1]
        if loose:
            raise UserError(f"{loose[0]} is not in a class folder: an image folder's images go in {folder}/<class>/, "
                            f"at any depth beneath it.")
        held = Counter(labels[split])
        for name in classes:
            if not held[name]:
                others = Counter(f.suffix.lower() for f in found if f.parts[depth] == name and
                                 f.suffix.lower() in OTHER_PHOTOS)
                why = (f"; it holds photos in formats the data path does not read ({counted(others)}): convert them "
                       f"to JPEG") if others else ""
                raise UserError(f"the class folder {folder / name} holds no image ({', '.join(IMAGE_SUFFIXES)}){why}.")
        unread.update(f.suffix.lower() for f in found if f.suffix.lower() in OTHER_PHOTOS)
    extra = sorted(set(labels[splits[-1]]) - set(labels["train"]))  # an evaluation split may lack a class
    if extra:
        raise UserError(f"--data-dir {root}: {splits[-1]}/ has classes that train/ has not ({', '.join(extra)}): "
                        f"a model trained on train/ cannot predict them.")
    return files, unread, labels


def metadata_file(folder: Path) -> Path | None:
    """A split folder's metadata.csv or metadata.jsonl (METADATA_FILES), if it has one."""
    return next((folder / name for name in METADATA_FILES if (folder / name).is_file()), None)


def listed_files(metadata: Path) -> tuple[list[Path], list[str]]:
    """(the image files, their classes) a metadata file names, as datasets reads one: file_name and a label column (the
    first of LABEL_COLUMNS, or the one other column); images it does not name are left out, said."""
    try:
        with open(metadata, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f)) if metadata.suffix == ".csv" else [json.loads(x) for x in f if x.strip()]
    except (OSError, ValueError) as e:
        raise UserError(f"{metadata} cannot be read ({first_line(e)}).") from None
    columns = list(rows[0]) if rows else []
    others = [c for c in columns if c != "file_name"]
    label = next((c for c in LABEL_COLUMNS if c in columns), others[0] if len(others) == 1 else None)
    if "file_name" not in columns or label is None:
        raise UserError(f"{metadata} has columns {columns}; expected file_name and a label column named "
                        f"{' or '.join(repr(n) for n in LABEL_COLUMNS)}.")
    names = ["" if row.get("file_name") is None else str(row["file_name"]) for row in rows]
    classes = ["" if row.get(label) is None else str(row[label]) for row in rows]
    if not all(names):
        raise UserError(f"{metadata} has a row without a file_name.")
    if unlabelled := next((n for n, c in zip(names, classes) if not c), None):
        raise UserError(f"{metadata} names {unlabelled} without a {label}.")
    if twice := next((n for n, k in Counter(names).items() if k > 1), None):
        raise UserError(f"{metadata} names {twice} more than once.")
    folder = metadata.parent
    files = [folder / n for n in names]
    missing = [n for n, f in zip(names, files) if not f.is_file()]
    if missing:
        raise UserError(f"{metadata} names {len(missing):,} file{'s' * (len(missing) != 1)} not in {folder} (the "
                        f"first: {missing[0]}).")
    named = {os.path.normpath(f) for f in files}
    left = sum(f.suffix.lower() in IMAGE_SUFFIXES and os.path.normpath(f) not in named for f in visible_files(folder))
    if left:
        main_print(f"warning: {left:,} image{'s' * (left != 1)} in {folder} {'are' if left != 1 else 'is'} not named "
                   f"in {metadata.name}: left out.")
    return files, classes


def read_local(kind: str, files: dict[str, list[Path]], labels: dict[str, list[str]] | None):
    """The splits of local files through `datasets`, offline: parquet by its builder, an image folder as a table of
    paths and classes; memory-mapped from datasets' cache."""
    import datasets
    import pyarrow.parquet as pq

    for path in (p for paths in files.values() for p in paths if kind == "parquet"):
        try:  # reading the footer names the broken file; load_dataset's error would not
            pq.read_metadata(path)
        except Exception as e:
            raise UserError(f"{path} is not a readable parquet file ({first_line(e)}).") from None
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # local files: its "Downloading data" bars download nothing
    try:
        if kind == "parquet":  # a builder per split: one for both would cast the test file to the train file's features
            return {s: datasets.load_dataset(kind, data_files={s: [str(p) for p in ps]}, split=s)  # (class names too)
                    for s, ps in files.items()}
        classes = sorted(set(labels["train"]))  # the labels: the training split's classes
        return {s: image_folder_table(ps, labels[s], classes) for s, ps in files.items()}
    except Exception as e:
        cause = root_cause(e)  # load_dataset wraps the real reason (a full disk, say) in DatasetGenerationError
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            cache = Path(datasets.config.HF_DATASETS_CACHE)
            free = shutil.disk_usage(cache if cache.exists() else Path.home()).free
            raise UserError(
                f"no space left on device while datasets copied {files['train'][0].parent} into its cache {cache} "
                f"({free / 2**20:,.0f} MiB free); free some space or point HF_DATASETS_CACHE at a larger disk."
            ) from None
        raise UserError(f"cannot read the {kind} files in {files['train'][0].parent}: {first_line(cause)}") from None
    finally:
        if shown:
            datasets.enable_progress_bars()


def image_folder_table(files: list[Path], names: list[str], classes: list[str]):
    """An image folder's split as a datasets table of paths and ClassLabels of `classes`. Written by hand: datasets'
    image folder labels a file by the folder it is in, and skips suffixes it does not list."""
    from datasets import ClassLabel, Dataset, Features
    from datasets import Image as ImageFeature

    index = {name: k for k, name in enumerate(classes)}
    features = Features({"image": ImageFeature(), "label": ClassLabel(names=classes)})
    return Dataset.from_generator(_image_folder_rows, features=features, gen_kwargs={
        "paths": [str(f) for f in files], "labels": [index[name] for name in names]})


def _image_folder_rows(paths: list[str], labels: list[int]):
    yield from ({"image": path, "label": label} for path, label in zip(paths, labels))


def read_hub(name: str):
    import datasets

    try:
        return datasets.load_dataset(name)
    except Exception as e:
        raise UserError(
            f"could not download {name} from the Hugging Face Hub ({first_line(e)}); either pass "
            f"--data-dir with a local copy (train-*.parquet and test-*.parquet, or an image folder) or run with "
            f"internet access."
        ) from None


def root_cause(e: BaseException) -> BaseException:
    """The innermost exception of a chain."""
    seen = {id(e)}
    while (inner := e.__cause__ or e.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        e = inner
    return e


def pick_column(columns: list[str], where: str, names: tuple[str, ...], what: str, given: str | None) -> str:
    """The image or label column of `columns`: `given` (--image-column / --label-column), else the first of `names`."""
    if given is not None:
        if given not in columns:
            raise UserError(f"{where} has no column {given!r} (--{what}-column); its columns: {columns}.")
        return given
    found = [n for n in names if n in columns]
    if not found:
        article = "an" if what == "image" else "a"
        raise UserError(f"{where} has columns {columns}; expected {article} {what} column named "
                        f"{' or '.join(repr(n) for n in names)} (or name it with --{what}-column).")
    return found[0]


class EncodedRows(abc.ABC):
    """A split's encoded images as utils/data/images.py reads them (`Rows`: a table; StreamRows: shards; `DatasetRows`:
    a copy's Dataset): `labels`, `names` (None: integer labels), `split`, `len()`, `take(order)`, `where(i)` (for
    messages), `fetch(indices)` (bytes, paths or PIL images), `sampler`, and `sizes()` and `encoded` for byte_copies."""

    labels: torch.Tensor
    names: tuple[str, ...] | None
    split: str

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def take(self, order: torch.Tensor) -> EncodedRows: ...

    @abc.abstractmethod
    def where(self, i: int) -> str: ...

    @abc.abstractmethod
    def fetch(self, indices) -> list: ...

    @abc.abstractmethod
    def sizes(self) -> np.ndarray:
        """Each row's key for byte_copies' first round (its size in bytes); below 0: not compared."""

    def encoded(self, indices, limit: int | None = None) -> list[bytes]:
        """The rows' first `limit` bytes (None: all), for byte_copies."""
        return [encoded(cell, limit) for cell in self.fetch(indices)]

    def sampler(self, dataset, train: bool, seed: int, step_images: int, layout: tuple[int, int, int]):
        """A training order of the rows' own, or None (the EpochSampler every kind has)."""
        return None


class Rows(EncodedRows):
    """A split's rows `order` of a datasets table (memory-mapped; workers get it by reference), each an encoded image in
    `column` (bytes or a path), with labels and class names."""

    def __init__(self, ds, column: str, labels: torch.Tensor, names: tuple[str, ...] | None, split: str,
                 order: np.ndarray | None = None):
        self.ds, self.column, self.labels, self.names, self.split = ds, column, labels, names, split
        self.order = np.arange(len(ds)) if order is None else order

    def __len__(self) -> int:
        return len(self.order)

    def take(self, order: torch.Tensor) -> Rows:
        return Rows(self.ds, self.column, self.labels[order], self.names, self.split, self.order[order.numpy()])

    def where(self, i: int) -> str:
        """Row i's file, or its row number in the source split."""
        source = self.fetch([i])[0]
        return f"row {int(self.order[i])}" if isinstance(source, bytes) else str(source)

    def fetch(self, indices) -> list:
        cells = self.ds[self.order[np.asarray(indices, dtype=np.int64)].tolist()][self.column]
        return [cell["bytes"] if cell["bytes"] is not None else cell["path"] for cell in cells]

    def sizes(self) -> np.ndarray:
        """Each row's encoded size in bytes, from the table's offsets or the file system."""
        import pyarrow.compute as pc

        cells = self.ds.with_format("arrow")[self.column]
        sizes = []
        for chunk in cells.chunks:  # a ChunkedArray: the table's record batches
            found = pc.binary_length(chunk.field("bytes")).to_numpy(zero_copy_only=False)
            paths = chunk.field("path").to_pylist()
            sizes += [_file_size(paths[k]) if np.isnan(n) else n for k, n in enumerate(found)]
        return np.asarray(sizes, dtype=np.int64)[self.order]


def _file_size(path: str | None) -> int:
    """A file's size; -1 (matched with nothing) for no image or an unreadable file, which its decode reports."""
    try:
        return os.path.getsize(path)
    except (OSError, TypeError):
        return -1


def byte_copies(train: EncodedRows, test: EncodedRows) -> list[tuple[int, int]]:
    """(evaluation row, first training row) of each evaluation image whose encoded bytes a training image has too,
    narrowed without decoding: by size (`sizes`), then the digest of the first 4 KB, then of the whole. A size below 0
    matches none."""
    splits = (train, test)
    picked = [np.arange(len(rows)) for rows in splits]
    keys = [[(n,) for n in rows.sizes().tolist()] for rows in splits]
    for prefix in (4096, None):  # each round keeps the rows whose key the other split has, and lengthens their keys
        shared = {key for key in set(keys[0]) & set(keys[1]) if key[0] >= 0}
        for s, rows in enumerate(splits):
            kept = [k for k, key in enumerate(keys[s]) if key in shared]
            picked[s] = picked[s][kept]
            keys[s] = [keys[s][k] + (digest,) for k, digest in zip(kept, _digests(rows, picked[s], prefix))]
    first = {}
    for i, key in zip(picked[0].tolist(), keys[0]):
        first.setdefault(key, i)
    return [(j, first[key]) for j, key in zip(picked[1].tolist(), keys[1]) if key in first]


def _digests(rows: EncodedRows, picked: np.ndarray, prefix: int | None, batch: int = 256):
    """The 128-bit BLAKE2b of each picked row's first `prefix` bytes (None: all), a batch at a time."""
    for start in range(0, len(picked), batch):
        for data in rows.encoded(picked[start:start + batch], prefix):
            yield hashlib.blake2b(data, digest_size=16).digest()


def read_rows(ds, split: str, columns: tuple[str | None, str | None]) -> Rows:
    """A split's Rows: its image and label columns checked, the images left encoded in the table."""
    from datasets import Image as ImageFeature

    image_col, label_col, names = image_and_label(ds.features, f"the {split} split", columns)
    ds = ds.cast_column(image_col, ImageFeature(decode=False))
    labels = torch.from_numpy(ds.with_format("arrow")[label_col].to_numpy(zero_copy_only=False).astype(np.int64))
    return Rows(ds, image_col, labels, names, split)


def image_and_label(features, where: str, columns: tuple[str | None, str | None]):
    """(image column, label column, class names or None) of a table with these Features: the image column must hold
    images, the label column a ClassLabel or integers."""
    from datasets import ClassLabel, Value
    from datasets import Image as ImageFeature

    image, label = (pick_column(list(features), where, names, what, given) for given, names, what in
                    ((columns[0], IMAGE_COLUMNS, "image"), (columns[1], LABEL_COLUMNS, "label")))
    if not isinstance(features[image], ImageFeature):
        raise UserError(f"{where}'s column {image!r} is {features[image]}, not images.")
    feature = features[label]
    names = tuple(feature.names) if isinstance(feature, ClassLabel) else None
    if names is None and not (isinstance(feature, Value) and feature.dtype.startswith(("int", "uint"))):
        raise UserError(f"{where}'s label column {label!r} is {feature}, neither class names (a ClassLabel) nor "
                        f"integers.")
    return image, label, names


def first_size(splits: dict[str, Rows]) -> tuple[int, str]:
    """The first image's size and where it is; it must be square, as every image must be without --image-size."""
    rows = next(iter(splits.values()))
    with open_image(rows.fetch([0])[0], rows, 0) as im:
        (w, h), where = im.size, f"{im.size[0]}x{im.size[1]} (the {rows.split} split's {rows.where(0)})"
    if w != h:
        raise UserError(f"the images do not share one square size ({where}); {SIZE_ADVICE}.")
    return w, where


def shared_classes(rows: dict[str, EncodedRows], eval_name: str, shards: dict[str, tuple | None] | None = None
                   ) -> tuple[str, ...]:
    """The class names both splits (and a stream's `shards`) share: the ClassLabel's, or "0".."C-1" for integer labels;
    every label must name a class."""
    if shards:
        check_same_classes(shards, "shard")
    check_same_classes({"the train split": rows["train"].names, f"the {eval_name} split": rows["test"].names}, "split")
    classes = rows["train"].names
    if classes is None:
        count = len(torch.unique(rows["train"].labels))
        classes = tuple(str(k) for k in range(count))
    for r in rows.values():
        bad = torch.nonzero((r.labels < 0) | (r.labels >= len(classes))).flatten()
        if len(bad):
            why = (f"labels must be 0-{len(classes) - 1}" if rows["train"].names else
                   f"a label column without class names must hold the integers 0..C-1, and the training split has "
                   f"{len(classes)} distinct labels")
            raise UserError(f"the {r.split} split has label {int(r.labels[bad[0]])} at {r.where(int(bad[0]))} "
                            f"({len(bad)} rows in all); {why}.")
    return classes


def check_same_classes(named: dict[str, tuple[str, ...] | None], part: str) -> None:
    """One line naming the first part (split, shard) whose class names are not the first part's."""
    (first, ours), *rest = named.items()
    for where, theirs in rest:
        if theirs != ours:
            only = sorted(set(ours or ()) ^ set(theirs or ()))
            why = ("integer labels in one of them" if None in (ours, theirs) else
                   f"{', '.join(only)} in one of them only" if only else "the same names in another order")
            raise UserError(f"{where} names other classes than {first} ({why}): every {part} must name the same "
                            f"classes.")


def _permutation(n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(0))


def hold_out(labels: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows to train on, rows held out) of these labels: round(fraction x n) rows, stratified (each class its share
    rounded down, the rest to the largest remainders; never a class's last row), drawn by a fixed permutation (seed 0:
    --seed does not change what is evaluated on); each part in the source's order."""
    n = len(labels)
    classes, counts = labels.unique(return_counts=True)
    share = counts.double() * fraction
    quota = share.floor().long()
    by_remainder = sorted(range(len(classes)), key=lambda c: (-float(share[c] - quota[c]), -int(counts[c]), c))
    for c in [c for c in by_remainder if quota[c] + 1 < counts[c]][:round(fraction * n) - int(quota.sum())]:
        quota[c] += 1
    k = int(quota.sum())
    if not 0 < k < n:
        raise UserError(f"--val-fraction {fraction:g} of {n:,} training images in {len(classes)} classes holds out "
                        f"{k:,} (each class its share, never its last training image); both the training and the "
                        f"held-out part need at least one image: give the data a test split, or more images.")
    order = _permutation(n)
    by_class = order[torch.argsort(labels[order], stable=True)]  # each class's rows in the permutation's order
    starts = torch.cumsum(counts, 0) - counts
    held = torch.cat([by_class[start:start + q] for start, q in zip(starts.tolist(), quota.tolist())]).sort().values
    kept = torch.ones(n, dtype=torch.bool)
    kept[held] = False
    return kept.nonzero().flatten(), held


def item_image(item, what: str, size: int | None = None):
    """One Dataset item's (PIL image, label); `size`: the side every image must have (None: any)."""
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
    w, h = check_pixels(image, f"{what}'s image").size
    if size and (w, h) != (size, size):
        raise UserError(f"{what}'s image is {w} x {h}; without --image-size every image must be {size} x {size}, as "
                        f"item 0 of the train split is: {SIZE_ADVICE}.")
    if isinstance(label, torch.Tensor) and label.numel() == 1 and not label.is_floating_point():
        label = label.item()
    if isinstance(label, bool) or not isinstance(label, int | np.integer):
        raise UserError(f"{what}'s label must be an integer (got {type(label).__name__} {label!r}).")
    return image, int(label)


class DatasetRows(EncodedRows):
    """A Dataset's items `order` as a split's rows; `keys`: each item's size key for byte_copies (main process only)."""

    def __init__(self, dataset: torch.utils.data.Dataset, split: str, what: str, labels: torch.Tensor,
                 order: np.ndarray, keys: np.ndarray | None = None):
        self.dataset, self.split, self.what, self.labels, self.order = dataset, split, what, labels, order
        self.names, self.keys = None, keys

    @classmethod
    def read(cls, dataset: torch.utils.data.Dataset, split: str, what: str, size: int | None,
             fixed: int | None = None) -> tuple[DatasetRows, int]:
        """Every item read once and checked: (the rows, S). `size`: --image-size (None: square items of `fixed`'s side,
        else the first item's)."""
        try:
            n = len(dataset)
        except TypeError:
            raise UserError(f"{what} must be a map-style Dataset with a length (got {type(dataset).__name__}).") \
                from None
        if n == 0:
            raise UserError(f"{what} holds no items.")
        labels, side, keys = [], size or fixed, np.zeros(n, dtype=np.int64) if is_main_process() else None
        for i in range(n):
            image, label = item_image(dataset[i], f"{what}'s item {i}", None if size else side)
            if side is None:
                side = image.size[0]
                if image.size[0] != image.size[1]:
                    raise UserError(f"{what}'s item {i}'s image is {image.size[0]} x {image.size[1]}; without "
                                    f"--image-size every image must be square: {SIZE_ADVICE}.")
            labels.append(label)
            if keys is not None:
                keys[i] = size_key(image)
        return cls(dataset, split, what, torch.tensor(labels, dtype=torch.int64), np.arange(n), keys), side

    def __reduce__(self):  # the Dataset's class may be a script's that a tool imported (utils/scripts.py)
        return new_after_imports, (DatasetRows, dict(IMPORTED)), {**self.__dict__, "keys": None}

    def __len__(self) -> int:
        return len(self.order)

    def take(self, order: torch.Tensor) -> DatasetRows:
        return DatasetRows(self.dataset, self.split, self.what, self.labels[order], self.order[order.numpy()],
                           self.keys)

    def where(self, i: int) -> str:
        return f"item {int(self.order[i])} of {self.what}"

    def fetch(self, indices) -> list:
        return [self.opened(int(self.order[i])) for i in np.asarray(indices, dtype=np.int64)]

    def sizes(self) -> np.ndarray:
        return self.keys[self.order]

    def encoded(self, indices, limit: int | None = None) -> list[bytes]:
        """Each item's file or bytes, else its decoded pixels as RGB."""
        out = []
        for i in np.asarray(indices, dtype=np.int64):
            image, _ = item_image((self.dataset[int(self.order[i])][0], 0), f"{self.what}'s item {int(self.order[i])}")
            source = encoded_source(image)
            out.append(encoded(source, limit) if source is not None else as_rgb(image).tobytes()[:limit])
        return out

    def opened(self, item: int):
        """The item's image as a new PIL image (the Dataset's own never closed): a lazily opened one opened again from
        its source, so a JPEG decodes at its view's scale; else RGB pixels."""
        image, _ = item_image((self.dataset[item][0], 0), f"{self.what}'s item {item}")
        source = encoded_source(image)
        return open_encoded(source) if source is not None else as_rgb(image)


def size_key(image) -> int:
    """A Dataset item's key for byte_copies' first round, nothing decoded: a lazily opened image's encoded size; decoded
    pixels, a digest of size, mode and two rows."""
    source = encoded_source(image)
    if isinstance(source, bytes):
        return len(source)
    if source is not None:
        return _file_size(source)
    w, h = image.size
    sample = image.crop((0, 0, w, 1)).tobytes() + image.crop((0, h // 2, w, h // 2 + 1)).tobytes()
    digest = hashlib.blake2b(f"{w} {h} {image.mode}".encode() + sample, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: at or above 0, as sizes are
