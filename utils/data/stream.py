"""Shards streamed as training reads them (--decode stream): parquet or webdataset tar shards in a local folder or at an
fsspec URL (hf://, s3://, https://), with no local copy. EncodedImages decodes them by batch in the loader's workers
through `StreamRows`. docs/data.md ("Streamed shards") is the design: each epoch's plan (`stream_plan`), a reader's
windows and --read-ahead, the retries (`retried`), the kept index (`index_shard`), and the sampler's state in each
checkpoint, with which a resume on another layout finishes its epoch as planned.
Written by hand on pyarrow and fsspec: datasets' IterableDataset splits shards between processes only when their count
divides, shuffles only shard order and a buffer, and drops the buffer on resume; exact global batches and an exact
resume need each row's place in the plan."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import io
import json
import math
import os
import tarfile
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath

import aiohttp
import fsspec
import fsspec.caching
import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from fsspec.exceptions import FSTimeoutError

from utils import UserError, first_line, write_atomically
from utils.data.draws import key_stream, splitmix64
from utils.data.images import KeyedSampler
from utils.data.sources import EVAL_SPLITS, IMAGE_SUFFIXES, EncodedRows, image_and_label, names_split, shared_classes
from utils.launch import main_print, raise_if_any

SHARD_SUFFIXES = (".parquet", ".tar")
STATE_FILE = "stream.json"  # in each checkpoint: the epoch in progress and the layout, window and block of its plan
ATTEMPTS, BACKOFF_S = 6, 0.25  # a request failing transiently is tried again after 0.25, 0.5, 1, 2 and 4 s, then stops
TIMEOUT_S = 30  # an HTTP(S) request waiting this long to connect, or for the server's next bytes, fails (transient)
READ_BLOCK = 5 * 2**20  # a remote file (parquet, the index pass) is read in ranges of at least this (fsspec's block)
VERSION_FIELDS = ("ETag", "etag", "Content-MD5", "Digest", "Last-Modified", "LastModified", "mtime", "md5Hash",
                  "blob_id", "generation")  # what fsspec's filesystems report of a file's version (info())
POOR_MIX = 0.8  # the start warns when micro-batches hold fewer than this share of a uniform shuffle's classes


@dataclass(frozen=True)
class StreamSettings:
    """--shuffle-buffer (window), --shuffle-block (block), --read-ahead (requests in flight per reader; 0: none), the
    folder indices are kept in (None: not kept), --eval-split."""
    window: int = 4096
    block: int = 64
    read_ahead: int = 4
    index_cache: Path | None = None
    eval_split: str | None = None


@dataclass
class Shard:
    """One shard's index: its URL, labels and class names, and a parquet file's image column and row-group starts, or a
    tar's (offset, size) of each sample's image."""
    url: str
    labels: np.ndarray
    names: tuple[str, ...] | None
    column: str | None = None  # parquet: the image column
    groups: np.ndarray | None = None  # parquet: first row of each row group, then the row count
    members: np.ndarray | None = None  # tar: (offset, size) of each sample's image bytes

    @property
    def rows(self) -> int:
        return len(self.labels)


def transient(e: BaseException | None) -> BaseException | None:
    """The error in e's chain that may pass on a retry (a 5xx, 408 or 429, a timeout, a refused or reset connection, a
    body cut short), or None."""
    while e is not None:
        if isinstance(e, aiohttp.ClientResponseError):
            if e.status >= 500 or e.status in (408, 429):
                return e
        elif isinstance(e, (ConnectionError, TimeoutError, asyncio.TimeoutError, FSTimeoutError,
                            aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)):
            return e
        e = e.__cause__ or e.__context__
    return None


def retried(call, failed: str):
    """call(), one request, retried after a transient error (ATTEMPTS in all, doubling waits); otherwise one line:
    `failed`, then why. Written by hand: fsspec's HTTP filesystem does not retry."""
    for attempt in range(ATTEMPTS):
        try:
            return call()
        except UserError:
            raise
        except Exception as e:
            passing = transient(e)
            if passing is None or attempt == ATTEMPTS - 1:
                why = f"{first_line(passing)}, {ATTEMPTS} tries" if passing else first_line(e)
                raise UserError(f"{failed} ({why}).") from None
            time.sleep(BACKOFF_S * 2 ** attempt)


def one_line(call, failed: str):
    """call(); an error that is not already one line becomes one: `failed`, then why."""
    try:
        return call()
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{failed} ({first_line(e)}).") from None


def is_local(fs) -> bool:
    """Whether an fsspec filesystem is this machine's."""
    return (fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]) == "file"


def url_to_fs(url: str):
    """(filesystem, path) of a URL; over HTTP(S) a request stalled for TIMEOUT_S fails."""
    if url.startswith(("http://", "https://")):
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=TIMEOUT_S, sock_read=TIMEOUT_S)
        return fsspec.core.url_to_fs(url, client_kwargs={"timeout": timeout})
    return fsspec.core.url_to_fs(url)


class RemoteFile(io.RawIOBase):
    """A remote file, read-only and seekable, through fsspec's read-ahead cache, each byte range retried on its own.
    Written by hand: fsspec's files do not retry a request."""

    def __init__(self, url: str, failed: str, size: int | None = None):
        self.fs, self.path = url_to_fs(url)
        if size is None:
            size = retried(lambda: self.fs.info(self.path), failed).get("size")
        if size is None:
            raise UserError(f"{failed} (its server reports no size; byte ranges need one).")
        self.size, self.pos = int(size), 0
        fetch = lambda a, b: retried(lambda: self.fs.cat_file(self.path, start=a, end=b), failed)  # noqa: E731
        self.cache = fsspec.caching.ReadAheadCache(READ_BLOCK, fetch, self.size)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        data = self.cache._fetch(self.pos, min(self.pos + len(buffer), self.size))
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def find_shards(data_dir: str, cache: Path | None = None, eval_split: str | None = None) -> dict[str, list[str]]:
    """{split: its shards' URLs, sorted}: <split>-*.parquet / *-<split>-*.tar at any depth, for train and `eval_split`,
    else the first of EVAL_SPLITS with any."""
    fs, root = url_to_fs(data_dir)
    files = shard_files(fs, root, f"cannot list --data-dir {data_dir}", cache)
    found, names = {}, (eval_split,) if eval_split else EVAL_SPLITS
    for split in ("train", *names):
        found[split] = sorted(f if is_local(fs) else fs.unstrip_protocol(f) for f in files
                              if names_split(PurePosixPath(f).name, split))
    if not found["train"]:
        raise UserError(f"--decode stream: --data-dir {data_dir} holds no training shard (train-*.parquet or "
                        f"*-train-*.tar).")
    chosen = next((s for s in names if found[s]), None)
    if chosen is None:
        raise UserError(f"--decode stream: --data-dir {data_dir} holds no {eval_split or 'validation or test'} shard; "
                        f"a stream evaluates on its own shards (--val-fraction holds rows out of a table, not of a "
                        f"stream).")
    return {"train": found["train"], chosen: found[chosen]}


def shard_files(fs, root: str, failed: str, cache: Path | None = None) -> list[str]:
    """The .parquet and .tar files under root, one retried listing per folder; hidden folders and the cache folder are
    not walked. Written by hand: fsspec's find() lists the whole tree in one go, so a retry would repeat every
    listing."""
    skip = os.path.realpath(cache.parent) if cache is not None and is_local(fs) else None  # <cache>/stream-index
    files, folders = [], [root]
    while folders:
        folder = folders.pop()
        for entry in retried(partial(fs.ls, folder, detail=True), failed):  # each a folder's direct children
            name = entry["name"]
            if PurePosixPath(name.rstrip("/")).name.startswith("."):
                continue
            if entry["type"] == "directory":
                if not (skip and os.path.realpath(name) == skip):
                    folders.append(name)
            elif name.endswith(SHARD_SUFFIXES):
                files.append(name)
    return files


def _open(url: str, failed: str, size: int | None = None):
    """A shard as a file: local, or a RemoteFile."""
    fs, path = url_to_fs(url)
    return fs.open(path, "rb") if is_local(fs) else RemoteFile(url, failed, size)


def index_shard(url: str, columns: tuple[str | None, str | None], cache: Path | None = None) -> Shard:
    """A shard's index, from `cache` when it holds one for this version of the file (URL, size, version as the
    filesystem reports them), else read and kept there. One line naming the shard if it cannot be read."""
    failed = f"{url} is not a readable {'parquet' if url.endswith('.parquet') else 'tar'} shard"
    kept, size = None, None
    if cache is not None:
        fs, path = url_to_fs(url)
        info = retried(lambda: fs.info(path), failed)
        size = info.get("size")
        version = {k: str(info[k]) for k in VERSION_FIELDS if info.get(k)}
        if version:
            key = json.dumps([url, list(columns), info.get("size"), version], sort_keys=True)
            kept = cache / f"index-{hashlib.sha256(key.encode()).hexdigest()[:32]}.npz"
            shard = _load_index(kept, url)
            if shard is not None:
                return shard
    shard = one_line(lambda: _read_index(url, columns, failed, size), failed)
    if kept is not None:
        _keep_index(shard, kept)
    return shard


def _read_index(url: str, columns, failed: str, size: int | None) -> Shard:
    with _open(url, failed, size) as f:
        return _index_parquet(url, f, columns) if url.endswith(".parquet") else _index_tar(url, f)


def _keep_index(shard: Shard, path: Path) -> None:
    """The index as an .npz of plain arrays, written atomically; an unwritable cache is no error."""
    meta = json.dumps({"names": shard.names, "column": shard.column})
    arrays = {k: v for k, v in (("groups", shard.groups), ("members", shard.members)) if v is not None}
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, labels=shard.labels, meta=np.array(meta), **arrays)

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, write)
    except OSError:
        pass


def _load_index(path: Path, url: str) -> Shard | None:
    """A kept index, or None (then read from the shard again)."""
    try:
        with np.load(path, allow_pickle=False) as kept:
            meta = json.loads(str(kept["meta"]))
            return Shard(url, kept["labels"], tuple(meta["names"]) if meta["names"] else None, meta["column"],
                         kept["groups"] if "groups" in kept else None, kept["members"] if "members" in kept else None)
    except Exception:  # missing, cut short or not ours: read the shard
        return None


def index_shards(urls: list[str], columns: tuple[str | None, str | None], cache: Path | None = None) -> list[Shard]:
    """Every shard's index, shard i indexed by process i mod P and shared through one all_gather; a shard that cannot be
    read stops every process with its line."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine, error = {}, None
    try:
        for i in range(rank, len(urls), world):
            mine[i] = index_shard(urls[i], columns, cache)
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
    image, label, names = image_and_label(datasets.Features.from_arrow_schema(pf.schema_arrow), url, columns)
    labels = pf.read(columns=[label]).column(0).to_numpy(zero_copy_only=False).astype(np.int64)
    sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
    return Shard(url, labels, names, column=image, groups=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))


def _index_tar(url: str, f) -> Shard:
    """A webdataset tar's index: samples are members sharing a key (name up to its first dot), an image and a KEY.cls
    class number; hidden files left out. Only headers and .cls members are read."""
    images, classes, keys = {}, {}, []
    with tarfile.open(fileobj=f, mode="r:") as tar:
        for m in tar:
            folder, _, name = m.name.rpartition("/")
            if not m.isfile() or name.startswith("."):
                continue
            stem, _, ext = name.partition(".")
            key = f"{folder}/{stem}"
            if key not in images and key not in classes:
                keys.append(key)
            if f".{ext.lower()}" in IMAGE_SUFFIXES:
                images[key] = (m.offset_data, m.size)
            elif ext == "cls":
                classes[key] = m
        labels = []
        for key in keys:
            missing = [what for what, found in ((".cls label", classes), ("image", images)) if key not in found]
            if missing:
                has = "an image" if key in images else "a .cls label" if key in classes else "other files"
                raise UserError(f"{url}: the sample {key.lstrip('/')} has {has} but no {' and no '.join(missing)}.")
            member = tar.extractfile(classes[key])
            text = member.read().decode(errors="replace").strip()
            if not text.isdigit():
                raise UserError(f"{url}: {key.lstrip('/')}.cls holds {text[:20]!r}, not a class number.")
            labels.append(int(text))
    return Shard(url, np.array(labels, dtype=np.int64), None,
                 members=np.array([images[k] for k in keys], dtype=np.int64).reshape(-1, 2))


@dataclass
class Plan:
    """One epoch's reading: `order` (the sampler's), `stream` (the rows as readers read them), `cuts` (each window's
    first position, then the end), `ranges` (each reader's first position, then the end)."""
    order: np.ndarray
    stream: np.ndarray
    cuts: np.ndarray
    ranges: np.ndarray


def stream_plan(counts: np.ndarray, keep: int, layout: tuple[int, int, int], window: int, block: int = 1,
                key: np.ndarray | None = None, labels: np.ndarray | None = None) -> Plan:
    """One epoch's reading of the first `keep` rows over shards of `counts` rows, in layout (processes, workers,
    micro-batch). Training (`key`): blocks of `block` rows ordered by hash (stratified by `labels`: `spread_blocks`),
    each window's rows shuffled by (key, row). Evaluation (key None): in order."""
    processes, workers, micro = layout
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    if key is None:
        stream = np.arange(keep, dtype=np.int64)
    else:
        firsts = np.concatenate([np.arange(a, b, block) for a, b in zip(starts[:-1], starts[1:])]).astype(np.int64)
        ends = np.minimum(firsts + block, starts[np.searchsorted(starts, firsts, "right")])
        drawn = spread_blocks(splitmix64(np.arange(len(firsts), dtype=np.uint64) ^ splitmix64(key)),
                              None if labels is None else labels[firsts])
        lengths = (ends - firsts)[drawn]
        stream = (np.repeat(firsts[drawn] - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum()))[:keep]
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
    ranges = ranges.astype(np.int64)
    cuts = np.unique(np.concatenate([np.arange(a, b, window) for a, b in zip(ranges[:-1], ranges[1:])] +
                                    [[keep]]).astype(np.int64))
    emitted = np.arange(keep)
    if key is not None:  # each window's rows in an order keyed by (seed, epoch, row)
        win = np.searchsorted(cuts, emitted, "right") - 1
        emitted = np.lexsort((splitmix64(stream.astype(np.uint64) ^ key), win))
    order = emitted[np.repeat(start - (np.cumsum(sizes) - sizes), sizes) + np.arange(keep)]
    return Plan(stream[order], stream, cuts, ranges)


def spread_blocks(h: np.ndarray, classes: np.ndarray | None) -> np.ndarray:
    """The blocks' order from their hashes `h`; given each block's class, stratified: class c's n_c blocks take places
    (j + u_j) / n_c of the epoch, so any window holds classes in about their proportions, even for shards written class
    by class."""
    if classes is None:
        return np.argsort(h, kind="stable")
    by_class = np.lexsort((h, classes))
    sizes = np.bincount(classes)
    j = np.empty(len(h), dtype=np.int64)
    j[by_class] = np.arange(len(h)) - np.repeat(np.cumsum(sizes) - sizes, sizes)  # rank within its class
    u = (splitmix64(h) >> np.uint64(11)).astype(np.float64) / 2.0 ** 53
    return np.lexsort((h, (j + u) / sizes[classes]))


def class_mix(order: np.ndarray, labels: np.ndarray, micro: int) -> tuple[float, float]:
    """(the mean number of classes in a micro-batch of `order`, that of a uniform shuffle: the sum over classes of 1 -
    C(N - n_c, b) / C(N, b))."""
    n = len(order) // micro * micro
    batches = np.sort(labels[order[:n]].reshape(-1, micro), axis=1)
    planned = float(((np.diff(batches, axis=1) != 0).sum(axis=1) + 1).mean())

    def log_falling(a: int) -> float:  # log a! / (a - b)!
        return math.lgamma(a + 1) - math.lgamma(a - micro + 1)

    total = len(order)
    uniform = sum(1 - (math.exp(log_falling(total - c) - log_falling(total)) if total - c >= micro else 0.0)
                  for c in np.bincount(labels[order]) if c)
    return planned, uniform


def warn_if_poorly_mixed(plan: Plan, labels: np.ndarray, micro: int, window: int, block: int) -> None:
    """One line when micro-batches hold fewer than POOR_MIX of a uniform shuffle's classes."""
    planned, uniform = class_mix(plan.order, labels, micro)
    if micro > 1 and planned < POOR_MIX * uniform:
        main_print(f"warning: the stream's shuffle puts {planned:.1f} classes in a micro-batch of {micro} on average, "
                   f"where a uniform shuffle puts {uniform:.1f}: each window of --shuffle-buffer {window} rows mixes "
                   f"only about {max(1, window // block)} blocks of --shuffle-block {block} rows. Raise "
                   f"--shuffle-buffer, lower --shuffle-block, or write the shards with their rows shuffled.")


class _Window:
    """A window's encoded images as its reads deliver them."""

    def __init__(self, pieces: list):
        self.pieces, self.images = pieces, None

    def get(self, row: int) -> bytes:
        if self.images is None:
            self.images = {}
            for rows, read in self.pieces:
                self.images.update(zip(rows.tolist(), read.result()))
        return self.images[row]


class _OpenFiles(threading.local):
    """A reading thread's open parquet shards, at most two."""

    def __init__(self):
        self.files = {}


class StreamRows(EncodedRows):
    """A split's shards as rows (numbered through the shards in order; `counts` keeps a prefix of each). `fetch` reads
    by window of the current plan: the window of an asked-for row whole, and with read-ahead the next one of the same
    reader; a reader keeps the windows beside the current one."""

    def __init__(self, shards: list[Shard], split: str, settings: StreamSettings, counts: np.ndarray | None = None):
        self.shards, self.split, self.settings = shards, split, settings
        self.counts = np.array([s.rows for s in shards] if counts is None else counts, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.labels = torch.from_numpy(np.concatenate([s.labels[:c] for s, c in zip(shards, self.counts)]))
        self.names = shards[0].names
        self.pid = None  # the process its threads, open files and windows belong to (a forked worker has its own)
        identity = np.arange(len(self), dtype=np.int64)
        self.use_plan(Plan(identity, identity, np.append(identity[::settings.window], len(self)),
                           np.array([0, len(self)], dtype=np.int64)))

    def __len__(self) -> int:
        return int(self.starts[-1])

    def take(self, order: torch.Tensor) -> StreamRows:
        """The first len(order) rows (a stream takes prefixes only)."""
        n = len(order)
        if not torch.equal(order, torch.arange(n)):
            raise ValueError("a stream's rows are taken as a prefix only")
        return StreamRows(self.shards, self.split, self.settings, np.clip(n - self.starts[:-1], 0, self.counts))

    def where(self, row: int) -> str:
        k = int(np.searchsorted(self.starts, row, "right") - 1)
        return f"{self.shards[k].url} row {row - self.starts[k]}"

    def sizes(self) -> np.ndarray:
        """Each row's size for byte_copies: a local tar member's; -1 (not compared) for parquet rows and remote shards
        (one request per row compared)."""
        return np.concatenate([s.members[:c, 1] if s.members is not None and is_local(url_to_fs(s.url)[0]) else
                               np.full(c, -1, dtype=np.int64) for s, c in zip(self.shards, self.counts)])

    def encoded(self, indices, limit: int | None = None) -> list[bytes]:
        """The first `limit` bytes of rows' tar members, one retried request each."""
        out = []
        for row in np.asarray(indices, dtype=np.int64).tolist():
            k = int(np.searchsorted(self.starts, row, "right") - 1)
            offset, size = self.shards[k].members[row - self.starts[k]].tolist()
            fs, path = url_to_fs(self.shards[k].url)
            end = offset + (size if limit is None else min(size, limit))
            out.append(retried(partial(fs.cat_file, path, start=offset, end=end),
                               f"cannot read the {self.split} shard {self.shards[k].url}"))
        return out

    def use_plan(self, plan: Plan) -> None:
        """The epoch's reading order and windows (set before the workers start)."""
        self.plan, self.range_starts = plan, set(plan.ranges.tolist())
        self.position = np.full(len(self), -1, dtype=np.int64)
        self.position[plan.stream] = np.arange(len(plan.stream))
        self.held, self.current = {}, None  # window -> _Window; the window the last row came from

    def fetch(self, rows) -> list[bytes]:
        if self.pid != os.getpid():
            self.pid, self.opened, self.pool, self.held, self.current = os.getpid(), _OpenFiles(), None, {}, None
        out = []
        for row in np.asarray(rows, dtype=np.int64):
            w = int(np.searchsorted(self.plan.cuts, self.position[row], "right") - 1)
            if w != self.current:
                self._enter(w)
            out.append(self.held[w].get(int(row)))
        return out

    def _enter(self, w: int) -> None:
        """Window w becomes current: windows beyond w +- 1 dropped, w asked for, and w + 1 with read-ahead."""
        self.current = w
        for old in [v for v in self.held if abs(v - w) > 1]:
            del self.held[old]
        if w not in self.held:
            self.held[w] = self._ask(w)
        nxt = w + 1
        if (self.settings.read_ahead and nxt not in self.held and nxt + 1 < len(self.plan.cuts)
                and int(self.plan.cuts[nxt]) not in self.range_starts):
            self.held[nxt] = self._ask(nxt)

    def _ask(self, w: int) -> _Window:
        return self.read(self.plan.stream[self.plan.cuts[w]:self.plan.cuts[w + 1]])

    def read(self, rows: np.ndarray) -> _Window:
        """The images of a window's `rows`, one request per piece (a run of a tar's rows; a parquet row group), on the
        read-ahead threads or here."""
        rows = np.sort(rows)
        shard = np.searchsorted(self.starts, rows, "right") - 1
        pieces = []
        for k in np.unique(shard).tolist():
            mine = rows[shard == k] - self.starts[k]
            s = self.shards[k]  # a tar's pieces: runs of consecutive rows; a parquet file's: its row groups
            apart = np.diff(mine) != 1 if s.members is not None else np.diff(np.searchsorted(s.groups, mine, "right"))
            for part in np.split(mine, np.flatnonzero(apart) + 1):
                pieces.append((part + self.starts[k], self._submit(k, part)))
        return _Window(pieces)

    def _submit(self, k: int, part: np.ndarray) -> concurrent.futures.Future:
        if not self.settings.read_ahead:
            done = concurrent.futures.Future()
            done.set_result(self._read_piece(k, part))
            return done
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(self.settings.read_ahead, "stream-read")
        return self.pool.submit(self._read_piece, k, part)

    def _read_piece(self, k: int, part: np.ndarray) -> list[bytes]:
        shard = self.shards[k]
        failed = f"cannot read the {self.split} shard {shard.url}"
        if shard.members is not None:  # consecutive members: one byte range from the first image to the last
            (first, _), (last, size) = shard.members[part[0]], shard.members[part[-1]]
            fs, path = url_to_fs(shard.url)
            data = retried(lambda: fs.cat_file(path, start=int(first), end=int(last + size)), failed)
            return [data[o - first:o - first + n] for o, n in shard.members[part].tolist()]
        return one_line(lambda: self._read_row_group(shard, part, failed), failed)

    def _read_row_group(self, shard: Shard, part: np.ndarray, failed: str) -> list[bytes]:
        files = self.opened.files
        if shard.url not in files:
            for old in list(files)[:-1]:
                self._close(old)
            f = _open(shard.url, failed)
            files[shard.url] = (f, pq.ParquetFile(f))
        g = int(np.searchsorted(shard.groups, part[0], "right") - 1)
        cells = files[shard.url][1].read_row_group(g, columns=[shard.column]).column(0).combine_chunks()
        out = cells.field("bytes").take(part - shard.groups[g]).to_pylist()
        if None in out:  # a row that names a file instead of holding its bytes
            raise UserError(f"{shard.url} row {part[out.index(None)]} holds no image bytes (only a path); a streamed "
                            f"shard must hold its images.")
        return out

    def _close(self, url: str) -> None:
        opened = self.opened.files.pop(url, None)
        if opened:
            opened[0].close()

    def __getstate__(self):  # a worker opens its own files and threads
        return {**self.__dict__, "pid": None, "opened": None, "pool": None, "held": {}, "current": None}

    def sampler(self, dataset, train: bool, seed: int, step_images: int, layout: tuple[int, int, int]):
        return StreamSampler(dataset, self, train, seed, step_images, layout)


class StreamSampler(KeyedSampler):
    """A streamed split's sampler: `stream_plan`'s order for (seed, epoch) in the layout, handed to the rows before the
    workers start. Its state (the epoch, and the layout, window and block it was planned with) is in each checkpoint."""

    def __init__(self, dataset, rows: StreamRows, train: bool, seed: int, step_images: int,
                 layout: tuple[int, int, int]):
        self.dataset, self.rows, self.train, self.seed = dataset, rows, train, seed
        self.own = {"layout": layout, "window": rows.settings.window, "block": rows.settings.block}
        self.keep = len(rows) // step_images * step_images if train else len(rows)
        self.epoch, self.planned, self.resumed = None, self.own, None
        self.set_epoch(0)
        if train:
            warn_if_poorly_mixed(self.plan, rows.labels.numpy(), layout[2], rows.settings.window, rows.settings.block)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.epoch = epoch
        if epoch == self.epoch or (not self.train and self.epoch is not None):
            return
        self.epoch = epoch
        self.planned = self.resumed[1] if self.resumed and self.resumed[0] == epoch else self.own
        key = key_stream(self.seed, epoch, 0) if self.train else None  # the epoch's shuffle: blocks, then windows
        self.plan = stream_plan(self.rows.counts, self.keep, self.planned["layout"], self.planned["window"],
                                self.planned["block"], key, self.rows.labels.numpy())
        self.rows.use_plan(self.plan)

    def __len__(self) -> int:
        return self.keep

    def __iter__(self):
        return iter(self.plan.order.tolist())

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, **self.planned, "layout": list(self.planned["layout"])}

    def load_state_dict(self, state: dict) -> None:
        self.resumed = state["epoch"], {"layout": tuple(state["layout"]), "window": state["window"],
                                        "block": state["block"]}
        if state["epoch"] == self.epoch:
            self.epoch = None  # planned again, as saved
            self.set_epoch(state["epoch"])

    def save_with(self, accelerator) -> None:
        """Puts the state in every checkpoint (STATE_FILE) and takes it back, through Accelerate's save/load hooks:
        JSON, where register_for_checkpointing would pickle."""
        def save(models, weights, folder):
            if accelerator.is_main_process:
                Path(folder, STATE_FILE).write_text(json.dumps(self.state_dict()))

        def load(models, folder):
            if Path(folder, STATE_FILE).exists():
                self.load_state_dict(json.loads(Path(folder, STATE_FILE).read_text()))

        accelerator.register_save_state_pre_hook(save)
        accelerator.register_load_state_pre_hook(load)


def open_stream(data_dir: str, columns: tuple[str | None, str | None], settings: StreamSettings):
    """({'train': StreamRows, 'test': StreamRows}, the class names, a description) of data_dir's shards."""
    found = find_shards(data_dir, settings.index_cache, settings.eval_split)
    eval_split = [s for s in found if s != "train"][0]
    shards = {s: index_shards(urls, columns, settings.index_cache) for s, urls in found.items()}
    rows = {"train": StreamRows(shards["train"], "train", settings),
            "test": StreamRows(shards[eval_split], eval_split, settings)}
    named = {s.url: s.names for s in shards["train"] + shards[eval_split]}
    classes = shared_classes(rows, eval_split, named)  # names, or 0..C-1 for integer labels; every label in range
    return rows, classes, {"source": data_dir, "kind": "shards", "shards": {s: len(u) for s, u in found.items()},
                           "images": {s: len(rows[r]) for s, r in zip(found, rows)}, "eval_split": eval_split,
                           "decode": "stream", "shuffle_block": settings.block}
