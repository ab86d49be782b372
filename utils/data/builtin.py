"""The built-in sources for a template's load_data (--data-dir, --dataset), on the path --decode chooses: the decode
cache (decode.py), the loader's workers (images.py), the GPU, or a stream of shards (stream.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from utils import UserError, first_line
from utils.config_groups import is_url
from utils.data.decode import default_cache_dir, load_source, say_repeated
from utils.data.images import EncodedImages, TensorImages, worker_share
from utils.data.pixels import CropRecipe, crop_recipe
from utils.data.sources import SPLITS, Source, byte_copies, fingerprint, first_size, locate
from utils.data.stream import StreamSettings, open_stream
from utils.launch import first_on_each_machine, is_main_process, main_print


def load_encoded(data_dir: str | None, dataset: str | None = None, image_size: int | None = None,
                 columns: tuple[str | None, str | None] = (None, None), val_fraction: float | None = None,
                 recipe: CropRecipe | None = None, workers: int | None = None, stream: StreamSettings | None = None,
                 reduce: bool = True, source: Source | None = None, device: str | None = None) -> dict:
    """The built-in sources with EncodedImages in place of the image tensors: nothing decoded here. image_size: None:
    the first image's; recipe: --augment resized-crop's or None; workers: None: this process's share of the cores;
    stream: read data_dir's shards as a stream with these settings; reduce: False for --full-decode; source: located
    already; device: 'cuda' for --decode gpu (no loader workers)."""
    if stream:
        rows, classes, description = open_stream(data_dir or f"hf://datasets/{dataset}", columns, stream)
    else:
        source = source or locate(data_dir, dataset, val_fraction)
        rows, classes = source.rows(columns)
        source.announce_held_out(main_print, len(rows["train"]), len(rows["test"]))
        key = fingerprint(source.paths, {"columns": list(columns), "val_fraction": source.fraction,
                                         "eval_split": source.source_eval})
        description = {**source.describe(key), "decode": "gpu" if device else "workers"}
    if is_main_process() and (found := byte_copies(rows["train"], rows["test"])):  # no cache: no pixel digests
        say_repeated(main_print, found, rows, "byte for byte")
    size = image_size or first_size(rows)[0]
    workers = 0 if device else workers or worker_share()
    data = {s: (EncodedImages(rows[s], size, recipe, workers, reduce, device), rows[s].labels) for s in SPLITS}
    view = {"eval_crop": recipe.eval_crop, "interpolation": recipe.interpolation} if recipe else {}  # how it evaluates
    return data | {"classes": classes, "dataset": description} | view


def check_gpu_decode() -> None:
    """--decode gpu needs TorchCodec and a CUDA device: one line if either is missing."""
    import torch

    try:
        import torchcodec.decoders  # noqa: F401 - the decoder --decode gpu calls
    except Exception as e:  # noqa: BLE001 - not installed, or built for another torch: one line either way
        raise UserError(f"--decode gpu decodes through TorchCodec, which does not import here ({first_line(e)}); "
                        f"pip install torchcodec (a release built for this torch), or use --decode workers.") \
            from None
    if not torch.cuda.is_available():
        raise UserError("--decode gpu decodes JPEGs on the GPU (nvJPEG), and this process has no CUDA device; use "
                        "--decode workers (or auto) to decode in the loader's workers.")


def load_builtin(cfg) -> dict:
    """The built-in sources by a script's data flags (--data-dir or --dataset; neither: CIFAR-10 from the Hub), on the
    path choose_decode picks."""
    dataset = cfg.dataset or (None if cfg.data_dir else "uoft-cs/cifar10")
    columns = (cfg.image_column, cfg.label_column)
    decode, source = choose_decode(cfg, dataset)  # printed, with why; the source located (and read) once
    if decode == "cache":  # the cache's mean and std are the data's: kept with its images (the rule: checked_data)
        data = load_source(cfg.data_dir, dataset, cfg.image_size, columns, cfg.val_fraction, cfg.cache_dir,
                           cfg.decode_workers, not cfg.full_decode, source)
        stats = data.pop("mean"), data.pop("std")
        return data | {s: (TensorImages(data[s][0], stats), data[s][1]) for s in SPLITS}
    recipe = crop_recipe(cfg)
    stream = None
    if decode == "stream":
        local = cfg.data_dir if cfg.data_dir and not is_url(cfg.data_dir) else None
        stream = StreamSettings(cfg.shuffle_buffer, cfg.shuffle_block, cfg.read_ahead,
                                Path(cfg.cache_dir or default_cache_dir(local)) / "stream-index", cfg.eval_split)
    return load_encoded(cfg.data_dir, dataset, cfg.image_size, columns, cfg.val_fraction, recipe, cfg.data_workers,
                        stream, not cfg.full_decode, source, "cuda" if decode == "gpu" else None)


def choose_decode(cfg, dataset: str | None) -> tuple[str, Source | None]:
    """The path --decode takes ('cache', 'workers', 'gpu' or 'stream'), said with why, and the source, located once
    (None for a stream). auto: stream for a URL or tar shards; workers for --augment resized-crop, or when the decoded
    images (N x 3 x S x S bytes) would not fit the cache folder's free space; else the cache."""
    choice, why = (cfg.decode, f"--decode {cfg.decode}") if cfg.decode != "auto" else (None, "--decode auto")
    if choice == "gpu":
        check_gpu_decode()
    if choice is None and is_url(cfg.data_dir):
        choice, why = "stream", "--decode auto: --data-dir is a URL"
    source = None if choice == "stream" else first_on_each_machine(lambda: locate(cfg.data_dir, dataset,
                                                                                  cfg.val_fraction, cfg.eval_split))
    if source and source.kind == "shards":
        if choice is not None:
            raise UserError(f"--decode {choice}: --data-dir {cfg.data_dir} holds tar shards, which are read as a "
                            f"stream (--decode stream, or auto).")
        choice, why, source = "stream", "--decode auto: --data-dir holds tar shards", None
    if choice is None and cfg.augment == "resized-crop":
        choice, why = "workers", "--decode auto: --augment resized-crop crops whole images"
    elif choice is None:
        side = cfg.image_size or first_size(source.rows((cfg.image_column, cfg.label_column))[0])[0]
        need = source.count() * 3 * side ** 2
        folder = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir(cfg.data_dir)
        while not folder.exists():
            folder = folder.parent
        free = shutil.disk_usage(folder).free
        choice = "workers" if need > free else "cache"
        why = (f"--decode auto: the decoded images take {need / 2**20:,.1f} MiB at {side} x {side} px, {folder} has "
               f"{free / 2**20:,.1f} MiB free")
    main_print({"workers": f"decoding each batch in the loader's workers ({why})",
                "stream": f"streaming the shards, each batch decoded in the loader's workers ({why})",
                "gpu": f"decoding each batch's JPEGs on the GPU ({why})",
                "cache": f"reading the decoded images from the cache, decoded once on a first run ({why})"}[choice])
    return choice, source
