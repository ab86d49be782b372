"""Shards streamed as training reads them (--decode stream): parquet or webdataset tar shards, in a local folder or
at an fsspec URL (hf://datasets/..., s3://...; the same code reads both), with no local copy. For data larger than
the disk. The images are decoded by batch in the loader's workers as on the on-the-fly path (utils/onthefly.py),
whose DecodingDataset reads them through `StreamRows` here instead of a memory-mapped table.

What is read where, each epoch (`stream_plan`, a function of the shards' row counts, the seed, the epoch and the
layout: processes x loader workers x micro-batch):
  1. the shards in an order drawn from (seed, epoch), their rows one after the other: the epoch's stream;
  2. the stream cut to whole global batches (the N mod B rows at its end sit out this epoch, as N mod B images do
     under utils.batches.EpochSampler; the next epoch's shard order leaves out others) and split into one
     contiguous range per reader (a process's loader worker), so each row is read by exactly one reader and each
     shard by one reader, or by two where a range ends inside it (each then reads its own rows of it);
  3. each reader's range shuffled within windows of --shuffle-buffer rows (the bounded shuffle buffer: a reader
     holds at most two windows of encoded images), keyed by (seed, epoch, row);
  4. the sampler's order (`StreamSampler`) lists each reader's batches where Accelerate's sharding (micro-batch k
     to process k mod P) and the DataLoader (a process's j-th batch to worker j mod W) will hand them to it.
The position in the stream is the epoch's batch count, which checkpoints hold already; the sampler adds the layout
its epoch was planned with (stream.json), so a resume on another process count, micro-batch or worker count
finishes that epoch in its planned order (each image once; only reads cross readers' ranges) and plans the next in
the new layout.
Evaluation reads the test shards in order, split the same way, and counts every image once (Accelerate pads an
uneven last round with the first images, read a second time; gather_for_metrics drops them).

Written by hand, on pyarrow and fsspec (what datasets reads parquet and URLs with): datasets' IterableDataset
splits shards between processes only when their count divides the readers' (else every process reads every shard
and keeps 1/P of the rows, split_dataset_by_node), and its resume state drops the shuffle buffer; exact global
batches and an exact resume need each row's place in the plan.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import fsspec
import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from utils import UserError, first_line
from utils.batches import key_stream, splitmix64
from utils.launch import raise_if_any
from utils.sources import IMAGE_COLUMNS, LABEL_COLUMNS, shared_classes

SHARD_SUFFIXES = (".parquet", ".tar")
STATE_FILE = "stream.json"  # in each checkpoint: the epoch in progress and the layout it was planned in
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "bmp", "gif", "tif", "tiff", "webp")  # a webdataset sample's image


@dataclass
class Shard:
    """One shard's index: where it is, its rows' labels (and class names, from a parquet ClassLabel), and how to
    reach a row: a parquet file's image column and each row group's first row, or a tar's (offset, size) of each
    sample's image."""
    url: str
    labels: np.ndarray
    names: tuple[str, ...] | None
    column: str | None = None  # parquet: the image column
    groups: np.ndarray | None = None  # parquet: first row of each row group, then the row count
    members: np.ndarray | None = None  # tar: (offset, size) of each sample's image bytes

    @property
    def rows(self) -> int:
        return len(self.labels)


# ----------------------------------------------------------------------------------------------------
# Finding and indexing the shards (footers and label columns; a tar's headers and .cls members)
# ----------------------------------------------------------------------------------------------------
def find_shards(data_dir: str) -> dict[str, list[str]]:
    """{split: its shards' URLs, sorted}: files named <split>-*.parquet / *-<split>-*.tar (any depth) for train and
    the first of test or validation that has any."""
    try:
        fs, root = fsspec.core.url_to_fs(data_dir)
        files = [f for f in fs.find(root) if f.endswith(SHARD_SUFFIXES)]
    except Exception as e:
        raise UserError(f"cannot list --data-dir {data_dir} ({first_line(e)}).") from None
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    found = {}
    for split in ("train", "test", "validation"):
        named = re.compile(rf"(^|[-_.]){split}[-_.]")
        found[split] = sorted(f if protocol == "file" else fs.unstrip_protocol(f) for f in files
                              if named.search(PurePosixPath(f).name))
    if not found["train"]:
        raise UserError(f"--decode stream: --data-dir {data_dir} holds no training shard (train-*.parquet or "
                        f"*-train-*.tar).")
    eval_split = next((s for s in ("test", "validation") if found[s]), None)
    if eval_split is None:
        raise UserError(f"--decode stream: --data-dir {data_dir} holds no test or validation shard; a stream "
                        f"evaluates on its own shards (--val-fraction holds rows out of a table, not of a stream).")
    return {"train": found["train"], eval_split: found[eval_split]}


def holds_tar_shards_only(folder: Path) -> bool:
    """Whether a local folder holds training tar shards and neither parquet files nor an image folder."""
    return (not (folder / "train").is_dir() and not any(folder.rglob("train-*.parquet"))  # an image folder is not
            and any(folder.rglob("*train*.tar")))  # walked: only a folder without train/ or parquet files is


def _open(url: str):
    return fsspec.open(url, "rb").open()


def index_shard(url: str, columns: tuple[str | None, str | None]) -> Shard:
    """A shard's index, or one line naming it if it cannot be read."""
    try:
        with _open(url) as f:
            return _index_parquet(url, f, columns) if url.endswith(".parquet") else _index_tar(url, f)
    except UserError:
        raise
    except Exception as e:
        kind = "parquet" if url.endswith(".parquet") else "tar"
        raise UserError(f"{url} is not a readable {kind} shard ({first_line(e)}).") from None


def index_shards(urls: list[str], columns: tuple[str | None, str | None]) -> list[Shard]:
    """Every shard's index, each shard read by one process (shard i by process i mod P) and the indices shared
    through one all_gather: the index pass reads a shard once per job, not once per process. A shard that cannot be
    read stops every process with its line."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine, error = {}, None
    try:
        for i in range(rank, len(urls), world):
            mine[i] = index_shard(urls[i], columns)
    except UserError as e:
        error = str(e)
    raise_if_any(error, long_wait=True)  # also the barrier after the slowest process's shards
    parts = [mine]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, mine)
    merged = {i: shard for part in parts for i, shard in part.items()}
    return [merged[i] for i in range(len(urls))]


def _index_parquet(url: str, f, columns) -> Shard:
    import datasets  # here: a second to import, and only parquet shards need its Features

    pf = pq.ParquetFile(f)
    features = datasets.Features.from_arrow_schema(pf.schema_arrow)
    picked = []
    for given, names, what in ((columns[0], IMAGE_COLUMNS, "image"), (columns[1], LABEL_COLUMNS, "label")):
        found = [c for c in ([given] if given else names) if c in features]
        if not found:
            raise UserError(f"{url} has no {what} column {given or ' or '.join(names)} (its columns: "
                            f"{', '.join(features)}).")
        picked.append(found[0])
    image, label = picked
    if not isinstance(features[image], datasets.Image):
        raise UserError(f"{url}: its column {image!r} is {features[image]}, not images.")
    names = features[label].names if isinstance(features[label], datasets.ClassLabel) else None
    labels = pf.read(columns=[label]).column(0).to_numpy(zero_copy_only=False).astype(np.int64)
    sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
    return Shard(url, labels, tuple(names) if names else None, column=image,
                 groups=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))


def _index_tar(url: str, f) -> Shard:
    """A webdataset tar: samples are members sharing a key (the name up to its first dot), each an image
    (KEY.jpg, .png, ...) and its class number (KEY.cls). Only headers and .cls members are read (tarfile seeks over
    the images)."""
    images, classes, keys = {}, {}, []
    with tarfile.open(fileobj=f, mode="r:") as tar:
        for m in tar:
            if not m.isfile():
                continue
            folder, _, name = m.name.rpartition("/")
            stem, _, ext = name.partition(".")
            key = f"{folder}/{stem}"
            if key not in images and key not in classes:
                keys.append(key)
            if ext.lower() in IMAGE_EXTENSIONS:
                images[key] = (m.offset_data, m.size)
            elif ext == "cls":
                classes[key] = m
        labels = []
        for key in keys:
            if key not in images or key not in classes:
                has, lacks = ("an image", ".cls label") if key in images else ("a .cls label", "image")
                raise UserError(f"{url}: the sample {key.lstrip('/')} has {has} but no {lacks}.")
            member = tar.extractfile(classes[key])
            text = member.read().decode(errors="replace").strip()
            if not text.isdigit():
                raise UserError(f"{url}: {key.lstrip('/')}.cls holds {text[:20]!r}, not a class number.")
            labels.append(int(text))
    return Shard(url, np.array(labels, dtype=np.int64), None,
                 members=np.array([images[k] for k in keys], dtype=np.int64).reshape(-1, 2))


def check_same_classes(shards: list[Shard]) -> None:
    """One line naming a shard whose class names (its ClassLabel's; None: integer labels) are not the first's."""
    first = shards[0]
    for s in shards[1:]:
        if s.names != first.names:
            ours, theirs = set(first.names or ()), set(s.names or ())
            missing = sorted(ours - theirs) or sorted(theirs - ours)
            raise UserError(f"{s.url} names other classes than {first.url} ({', '.join(missing) or 'integer labels'}"
                            f" in one of them only): every shard must name the same classes.")


# ----------------------------------------------------------------------------------------------------
# A split's shards as rows; the plan of an epoch
# ----------------------------------------------------------------------------------------------------
class StreamRows:
    """A split's shards where utils.sources.Rows has a table: `labels` (every row's, in shard order), `names`,
    `split`, `fetch(rows)` (their encoded images) and `where(row)`. Rows are numbered through the shards in their
    sorted order; `counts` keeps a prefix of each (--train-subset, --eval-subset). `fetch` reads by window of the
    current plan (`use_plan`): the window holding an asked-for row is read whole, in stream order, and kept
    until two newer windows replace it."""

    def __init__(self, shards: list[Shard], split: str, window: int, counts: np.ndarray | None = None):
        self.shards, self.split, self.window = shards, split, window
        self.counts = np.array([s.rows for s in shards] if counts is None else counts, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.labels = torch.from_numpy(np.concatenate([s.labels[:c] for s, c in zip(shards, self.counts)]))
        self.names, self.numbers = shards[0].names, torch.arange(len(self.labels))
        self.files, self.pid = {}, None  # open shards, per process (a forked worker opens its own)
        identity = np.arange(len(self), dtype=np.int64)
        self.use_plan(identity, np.append(identity[::window], len(self)))

    def __len__(self) -> int:
        return int(self.starts[-1])

    def take(self, order: torch.Tensor) -> StreamRows:
        """The first len(order) rows (a stream reads in order: only prefixes are taken)."""
        n = len(order)
        if not torch.equal(order, torch.arange(n)):
            raise ValueError("a stream's rows are taken as a prefix only")
        return StreamRows(self.shards, self.split, self.window, np.clip(n - self.starts[:-1], 0, self.counts))

    def where(self, row: int) -> str:
        k = int(np.searchsorted(self.starts, row, "right") - 1)
        return f"{self.shards[k].url} row {row - self.starts[k]}"

    def use_plan(self, stream: np.ndarray, cuts: np.ndarray) -> None:
        """The reading order (`stream`: rows, shard by shard) and its windows (`cuts`: their first positions in it,
        then its end)."""
        self.stream, self.cuts = stream, cuts
        self.position = np.full(len(self), -1, dtype=np.int64)
        self.position[stream] = np.arange(len(stream))
        self.held = {}  # window -> {row: encoded image}

    def fetch(self, rows) -> list[bytes]:
        out = []
        for row in np.asarray(rows, dtype=np.int64):
            w = int(np.searchsorted(self.cuts, self.position[row], "right") - 1)
            if w not in self.held:
                if len(self.held) == 2:
                    del self.held[min(self.held)]
                span = self.stream[self.cuts[w]:self.cuts[w + 1]]
                self.held[w] = dict(zip(span.tolist(), self.read(span)))
            out.append(self.held[w][int(row)])
        return out

    def read(self, rows: np.ndarray) -> list[bytes]:
        """The encoded images of `rows` (a window: runs of consecutive rows of one shard)."""
        if self.pid != os.getpid():
            self.files, self.pid = {}, os.getpid()
        shard = np.searchsorted(self.starts, rows, "right") - 1
        breaks = np.flatnonzero((np.diff(rows) != 1) | (np.diff(shard) != 0)) + 1
        out = []
        for start, run in zip([0, *breaks], np.split(rows, breaks)):  # runs of consecutive rows of one shard
            k = int(shard[start])
            first = int(run[0] - self.starts[k])
            out += self._read_shard(k, first, first + len(run))
        return out

    def _read_shard(self, k: int, first: int, last: int) -> list[bytes]:
        shard = self.shards[k]
        try:
            if k not in self.files:
                for old in list(self.files)[:-1]:  # at most two shards open
                    self.files.pop(old)[0].close()
                f = _open(shard.url)
                if shard.groups is not None:
                    self.files[k] = (f, pq.ParquetFile(f), {})
                else:
                    self.files[k] = (f, None, None)
            f, pf, groups = self.files[k]
            if pf is None:
                out = []
                for offset, size in shard.members[first:last]:
                    f.seek(int(offset))
                    out.append(f.read(int(size)))
                return out
            out = []
            for g in range(int(np.searchsorted(shard.groups, first, "right") - 1), len(shard.groups) - 1):
                lo = int(shard.groups[g])
                if lo >= last:
                    break
                if g not in groups:
                    groups.clear()  # one row group at a time
                    groups[g] = pf.read_row_group(g, columns=[shard.column]).column(0).combine_chunks()
                cells = groups[g].slice(max(first - lo, 0), min(last, int(shard.groups[g + 1])) - max(first, lo))
                out += cells.field("bytes").to_pylist()
            if None in out:  # a row that names a file instead of holding its bytes
                raise UserError(f"{shard.url} row {first + out.index(None)} holds no image bytes (only a path); a "
                                f"streamed shard must hold its images.")
            return out
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"cannot read the {self.split} shard {shard.url} ({first_line(e)}).") from None

    def __getstate__(self):  # workers open their own files
        return {**self.__dict__, "files": {}, "pid": None}

    def sampler(self, dataset, train: bool, seed: int, step_images: int, micro: int, processes: int):
        return StreamSampler(dataset, self, train, seed, step_images, (processes, dataset.images.workers, micro))


def stream_plan(counts: np.ndarray, keep: int, layout: tuple[int, int, int], window: int,
                key: np.ndarray | None = None, shard_key: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """One epoch's reading: (the sampler's order, as rows; the stream, as rows; its window cuts). `counts`: each
    shard's rows; the first `keep` rows of the stream are read. layout: (processes P, workers W per process,
    micro-batch b). `shard_key` shuffles the shards' order and `key` each window's rows (training); None: in order
    (evaluation, whose last micro-batch may be short)."""
    processes, workers, micro = layout
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    shards = np.arange(len(counts)) if shard_key is None else np.argsort(
        splitmix64(np.arange(len(counts), dtype=np.uint64) ^ shard_key), kind="stable")
    stream = np.concatenate([np.arange(starts[k], starts[k + 1]) for k in shards]).astype(np.int64)[:keep]
    # micro-batch k goes to process p = k mod P, whose j-th (j = k div P) goes to its worker w = j mod W: reader p W + w
    batches = -(-keep // micro)
    sizes = np.full(batches, micro, dtype=np.int64)
    sizes[-1] = keep - (batches - 1) * micro
    k = np.arange(batches)
    reader = (k % processes) * workers + (k // processes) % workers
    grouped = np.argsort(reader, kind="stable")  # readers' ranges lie in reader order, each batch after its last
    start = np.empty(batches, dtype=np.int64)
    start[grouped] = np.cumsum(sizes[grouped]) - sizes[grouped]
    ranges = np.concatenate([[0], np.cumsum(np.bincount(reader, weights=sizes, minlength=processes * workers))])
    cuts = np.unique(np.concatenate([np.arange(a, b, window) for a, b in zip(ranges[:-1], ranges[1:])] +
                                    [[keep]]).astype(np.int64))
    emitted = np.arange(keep)
    if key is not None:  # each window's rows in an order keyed by (seed, epoch, row)
        win = np.searchsorted(cuts, emitted, "right") - 1
        emitted = np.lexsort((splitmix64(stream.astype(np.uint64) ^ key), win))
    order = emitted[np.repeat(start - (np.cumsum(sizes) - sizes), sizes) + np.arange(keep)]
    return stream[order], stream, cuts


class StreamSampler(torch.utils.data.Sampler):
    """The sampler of a streamed split: its order is `stream_plan`'s for (seed, epoch) in the layout, and it hands
    the plan to the rows before the loader's workers start (they are not persistent: each epoch's fork it). Training
    reads whole global batches of `step_images`. Its state (checkpointed through Accelerate's registered objects)
    is the epoch and the layout that epoch was planned in (`save_with`)."""

    def __init__(self, dataset, rows: StreamRows, train: bool, seed: int, step_images: int,
                 layout: tuple[int, int, int]):
        self.dataset, self.rows, self.train, self.seed, self.layout = dataset, rows, train, seed, layout
        self.keep = len(rows) // step_images * step_images if train else len(rows)
        self.epoch, self.planned, self.resumed = None, layout, None
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.epoch = epoch
        if epoch == self.epoch or (not self.train and self.epoch is not None):
            return
        self.epoch = epoch
        self.planned = self.resumed[1] if self.resumed and self.resumed[0] == epoch else self.layout
        shuffle = key_stream(self.seed, epoch, 0)  # the epoch's shuffle: its shards' order, hashed on: its windows'
        keys = (splitmix64(shuffle), shuffle) if self.train else (None, None)
        self.order, stream, cuts = stream_plan(self.rows.counts, self.keep, self.planned, self.rows.window, *keys)
        self.rows.use_plan(stream, cuts)

    def __len__(self) -> int:
        return self.keep

    def __iter__(self):
        return iter(self.order.tolist())

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "layout": list(self.planned)}

    def load_state_dict(self, state: dict) -> None:
        self.resumed = state["epoch"], tuple(state["layout"])
        if state["epoch"] == self.epoch:
            self.epoch = None  # planned again, in the saved layout
            self.set_epoch(state["epoch"])

    def save_with(self, accelerator) -> None:
        """Puts this state in every checkpoint Accelerate's save_state writes (STATE_FILE, by the main process) and
        takes it back from the one load_state reads, through Accelerate's checkpoint hooks: JSON, where
        register_for_checkpointing would pickle it (and unpickle whatever a checkpoint holds)."""
        def save(models, weights, folder):
            if accelerator.is_main_process:
                Path(folder, STATE_FILE).write_text(json.dumps(self.state_dict()))

        def load(models, folder):
            if Path(folder, STATE_FILE).exists():
                self.load_state_dict(json.loads(Path(folder, STATE_FILE).read_text()))

        accelerator.register_save_state_pre_hook(save)
        accelerator.register_load_state_pre_hook(load)


def open_stream(data_dir: str, columns: tuple[str | None, str | None], window: int):
    """({'train': StreamRows, 'test': StreamRows}, the class names, a description) of the shards in data_dir."""
    found = find_shards(data_dir)
    eval_split = [s for s in found if s != "train"][0]
    shards = {s: index_shards(urls, columns) for s, urls in found.items()}
    check_same_classes(shards["train"] + shards[eval_split])
    rows = {"train": StreamRows(shards["train"], "train", window), "test": StreamRows(shards[eval_split],
                                                                                      eval_split, window)}
    classes = shared_classes(rows, eval_split)  # names, or 0..C-1 for integer labels; every label in range
    return rows, classes, {"source": data_dir, "kind": "shards", "shards": {s: len(u) for s, u in found.items()},
                           "images": {s: len(rows[r]) for s, r in zip(found, rows)}, "eval_split": eval_split,
                           "decode": "stream"}
