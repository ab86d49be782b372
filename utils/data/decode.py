"""Image classification data decoded once: a source (utils/data/sources.py) decoded in parallel straight into a
safetensors cache file through a memory map, one (N, S, S, 3) uint8 tensor per split, keyed by the source files and the
decode settings. Every process reads it through a map of that file: a machine's processes share one copy in the page
cache, and data larger than memory trains from disk. `load_source` is the entry point."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import torch

from utils import UserError, first_line
from utils.data.images import channel_stats
from utils.data.pixels import open_image, row_pixels, square_pixels
from utils.data.sources import SIZE_ADVICE, SPLITS, Rows, Source, fingerprint, first_size, locate
from utils.launch import first_on_each_machine, main_print

CACHE_FORMAT = 10  # bump when the cache file's contents change


def _decode_rows(rows: Rows, size: int, out: tuple[np.ndarray, np.ndarray], start: int, stop: int,
                 same_as: str | None = None, reduce: bool = True) -> None:
    """Decodes rows start..stop-1 into out's images (a memory map of the cache), each resized to S x S (or, with
    same_as, checked to be S x S), and each image's 64-bit digest into its digests."""
    images, digests = out
    for first in range(start, stop, FETCH_ROWS):
        for i, source in enumerate(rows.fetch(range(first, min(first + FETCH_ROWS, stop))), first):
            im = open_image(source, rows, i)
            if im.size != (size, size) and same_as:
                im.close()
                raise UserError(f"the images do not share one square size ({same_as}, {im.size[0]}x{im.size[1]} "
                                f"(the {rows.split} split's {rows.where(i)})); {SIZE_ADVICE}.")
            images[i] = row_pixels(rows, i, im, partial(square_pixels, size=size, reduce=reduce))
            digests[i] = np.frombuffer(hashlib.blake2b(images[i].tobytes(), digest_size=8).digest(), np.int64)[0]


DECODE_CHUNK = 512  # rows a decode worker takes at a time
FETCH_ROWS = 64  # encoded images read from the table at once (camera-size JPEGs: about 250 MB)
_JOB = None  # (rows, outputs, size, same_as, reduce) of the running parallel decode: forked workers inherit it


def _decode_chunk(role: str, start: int, stop: int) -> None:
    rows, outputs, size, same_as, reduce = _JOB
    _decode_rows(rows[role], size, outputs[role], start, stop, same_as, reduce)


def decode_all(rows: dict[str, Rows], outputs: dict[str, tuple[np.ndarray, np.ndarray]], size: int, workers: int,
               same_as: str | None = None, reduce: bool = True) -> None:
    """Decodes every split's rows into its outputs with `workers` forked processes that inherit the rows and the
    memory-mapped outputs (no image crosses a pipe). Forked even where the loaders use a forkserver: the pool starts
    before any other thread calls into Python. Each row decoded alone: the same bits at any worker count; a bad row
    stops the decode with its line. Written with concurrent.futures: datasets' map(num_proc) would write every decoded
    image to an Arrow cache first."""
    global _JOB
    chunks = [(role, a, min(a + DECODE_CHUNK, len(r))) for role, r in rows.items() for a in range(0, len(r),
                                                                                                 DECODE_CHUNK)]
    if workers <= 1 or len(chunks) <= 1:
        for role, start, stop in chunks:
            _decode_rows(rows[role], size, outputs[role], start, stop, same_as, reduce)
        return
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    _JOB = rows, outputs, size, same_as, reduce
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


def _writable_dir(path: Path, create: bool = True) -> bool:
    """Whether files can be written in `path`; create=False: judged without making it."""
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        elif not path.exists():
            path = path.parent
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def default_cache_dir(data_dir: str | None) -> Path:
    """<data-dir>/.decoded when writable (a folder without write permission bits counts as read-only, even for root),
    else a per-user cache folder."""
    if data_dir is not None and os.stat(data_dir).st_mode & 0o222 and _writable_dir(Path(data_dir) / ".decoded",
                                                                                   create=False):
        return Path(data_dir) / ".decoded"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "accelerate-cifar"


def _read_cache(path: Path) -> dict | None:
    """The cached splits as tensors over a memory map of the file (safetensors' safe_open)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            t, about = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        return {**{s: (t[f"{s}_images"].permute(0, 3, 1, 2), t[f"{s}_labels"]) for s in SPLITS},
                "classes": tuple(json.loads(about["classes"])), "mean": tuple(t["mean"].tolist()),
                "std": tuple(t["std"].tolist()), "repeated": repeated(t["train_digests"], t["test_digests"])}
    except Exception as e:  # a truncated or foreign file: decode again rather than fail
        print(f"warning: ignoring unreadable cache {path} ({first_line(e)}); decoding the source again")
        return None


def _layout(counts: dict[str, int], size: int, classes: tuple[str, ...]) -> tuple[bytes, dict, int]:
    """The cache file's safetensors header and each tensor's (dtype, shape, offset), and the file size: the 8-byte
    tensors first, then the images, so all are aligned. Written by hand because safetensors' writers need the tensors in
    memory, and these are decoded straight into the file."""
    specs = [*((f"{s}_{kind}", np.int64, "I64", (counts[s],)) for s in SPLITS for kind in ("labels", "digests")),
             ("mean", np.float64, "F64", (3,)), ("std", np.float64, "F64", (3,)),
             *((f"{s}_images", np.uint8, "U8", (counts[s], size, size, 3)) for s in SPLITS)]
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


def _decode_into_cache(path: Path, rows: dict[str, Rows], size: int, same_as: str | None, classes, workers: int,
                       log, reduce: bool = True) -> dict:
    """Decodes into a new cache file at `path` through a memory map, renamed into place once complete, then read back;
    where the folder cannot be written, a temporary file deleted once mapped."""
    header, places, total = _layout({role: len(r) for role, r in rows.items()}, size, classes)
    keep = _writable_dir(path.parent)
    if not keep:
        print(f"warning: cache folder {path.parent} is not writable; decoding into a temporary file in "
              f"{tempfile.gettempdir()}, and the next run will decode again")  # said by each machine's first process
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
        decode_all(rows, {role: (views[f"{role}_images"], views[f"{role}_digests"]) for role in rows}, size, workers,
                   same_as, reduce)
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


def load_source(data_dir: str | None, dataset: str | None = None, image_size: int | None = None,
                columns: tuple[str | None, str | None] = (None, None), val_fraction: float | None = None,
                cache_dir: str | None = None, decode_workers: int | None = None, reduce: bool = True,
                source: Source | None = None) -> dict:
    """The built-in sources as a template's load_data returns them: {'train': (images, labels), 'test': ...} with
    'classes', 'mean', 'std' and 'dataset'; the images (N, 3, S, S) uint8 views of the cache file's memory map. data_dir
    or the Hub `dataset`; image_size: the square size (None: the images' own, which they must share); columns: (image,
    label) names (None: found by name); val_fraction: the part of train held out (None: the source's evaluation split,
    else VAL_FRACTION); cache_dir: default_cache_dir; decode_workers: None: one per core; reduce: False for
    --full-decode; source: located already. The first process of each machine decodes and writes the cache while the
    others wait; where it cannot be written, each process decodes for itself."""
    settings = {"image_size": image_size, "columns": list(columns), "val_fraction": val_fraction, "reduce": reduce}
    workers = decode_workers or len(os.sched_getaffinity(0))
    log = main_print
    if int(os.environ.get("LOCAL_RANK", "0")) > 0:
        workers = max(1, workers // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return first_on_each_machine(lambda: _load(source or locate(data_dir, dataset, val_fraction), data_dir, cache_dir,
                                               log, settings, workers))


def _load(source: Source, data_dir, cache_dir, log, settings: dict, workers: int):
    key = fingerprint(source.paths, {**settings, "val_fraction": source.fraction, "eval_split": source.source_eval},
                      CACHE_FORMAT)  # a Hub dataset's files are all of its splits, whichever is evaluated on
    path = (Path(cache_dir) if cache_dir else default_cache_dir(data_dir)) / f"images-{key}.safetensors"
    data = _read_cache(path) if path.exists() else None
    if data is None:
        log(f"decoding the images once into uint8 tensors; cache: {path}")
        rows, classes = source.rows(tuple(settings["columns"]))
        size, same_as = (settings["image_size"], None) if settings["image_size"] else first_size(rows)
        data = _decode_into_cache(path, rows, size, same_as, classes, workers, log, settings["reduce"])
    source.announce_held_out(log, len(data["train"][1]), len(data["test"][1]))
    if found := data.pop("repeated"):  # rare: the rows are read again to name the first pair's files
        say_repeated(log, found, source.rows(tuple(settings["columns"]))[0], "pixel for pixel")
    data["dataset"] = source.describe(key)
    return data


def say_repeated(log, found: list[tuple[int, int]], rows: dict[str, Rows], how: str) -> None:
    """One warning line: how many evaluation images are training images too, and the first pair's files."""
    j, i = found[0]
    are = "is also a training image" if len(found) == 1 else "are also training images"
    log(f"warning: {len(found):,} of the {len(rows['test']):,} evaluation images {are}, {how} (the first: "
        f"{rows['test'].where(j)} and {rows['train'].where(i)}); the evaluation counts them as unseen.")


def repeated(train: torch.Tensor, test: torch.Tensor) -> list[tuple[int, int]]:
    """(evaluation index, training index) of each evaluation image whose decoded pixels a training image has (by
    digest): pixel for pixel only, not a resized or re-encoded copy."""
    first = {d: i for i, d in reversed(list(enumerate(train.tolist())))}
    return [(j, first[d]) for j, d in enumerate(test.tolist()) if d in first]


