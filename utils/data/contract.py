"""The contract of a template's `load_data` (docs/customizing.md): `checked_data` checks what it returns and makes each
split an `Images` kind; `data_facts` is what summary.json records of the data."""

from __future__ import annotations

import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch

from utils import UserError, first_line
from utils.data.decode import say_repeated
from utils.data.images import WORKER_START, EncodedImages, Images, TensorImages, worker_share
from utils.data.pixels import crop_recipe
from utils.data.sources import SPLITS, DatasetRows, byte_copies
from utils.launch import is_main_process

CHANNELS = ("red", "green", "blue")


def checked_data(data: dict, where: str = "load_data", cfg=None, model_stats: dict | None = None,
                 say=None) -> dict:
    """A template's load_data(cfg) result, checked (one line naming `where` for a broken contract) and put in the
    loaders' form. The contract: 'train' and 'test', each a pair (uint8 images N x H x W x 3 or N x 3 x H x W, square,
    one size; integer labels 0 .. C-1) as arrays or tensors or an `Images` kind, or each a map-style Dataset of (image,
    label) items of any size (`cfg` gives --image-size and the crop recipe); 'classes' (at least 2). Optional: 'mean'
    and 'std', 'dataset' (for summary.json), 'eval_crop' and 'interpolation'. Returns each split's images as an `Images`
    kind, int64 labels, 'image_size', and the mean and std by `normalisation`'s rule, said by `say`."""
    if not isinstance(data, dict) or not {"train", "test", "classes"} <= data.keys():
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise UserError(f"{where} must return a dict with 'train', 'test' and 'classes' (got {got}).")
    classes = tuple(str(c) for c in data["classes"])
    if len(classes) < 2:  # trains to a loss of 0 and a top-1 of 100% that mean nothing
        raise UserError(f"{where} gives {len(classes)} class{'es' * (len(classes) != 1)} ({', '.join(classes)}); a "
                        f"classifier needs at least 2 (an image folder: a folder of images per class, in train/ and "
                        f"test/).")
    out = {"classes": classes, "dataset": data.get("dataset", {"source": where})}
    recipe = crop_recipe(cfg) if cfg is not None else None
    if recipe and any(isinstance(data[s], torch.utils.data.Dataset) for s in SPLITS):  # how it evaluates, for export
        data = {"eval_crop": recipe.eval_crop, "interpolation": recipe.interpolation} | data
    items = {}  # each Dataset split's rows
    for split in SPLITS:
        if isinstance(data[split], torch.utils.data.Dataset):  # a copy's own: read once here, in the workers later
            fixed = out["train"][0].image_size if split == "test" else None  # the test items: the train items' size
            items[split], side = DatasetRows.read(data[split], split, f"{where}: the {split} Dataset",
                                                  cfg and cfg.image_size, fixed)
            images = EncodedImages(items[split], side, recipe, worker_share(), not (cfg and cfg.full_decode))
            labels = items[split].labels
        else:
            try:
                images, labels = data[split]
            except (TypeError, ValueError):
                raise UserError(f"{where}: data[{split!r}] must be a pair (images, labels) or a torch Dataset.") \
                    from None
            images = images if isinstance(images, Images) else TensorImages(_images(images, f"{where}: the {split} "
                                                                                            f"images"))
        out[split] = images, _labels(labels, len(classes), where, split)
        if len(out[split][0]) != len(out[split][1]):
            raise UserError(f"{where}: the {split} split has {len(out[split][0])} images but {len(out[split][1])} "
                            f"labels.")
    if len(items) == 2 and is_main_process() and (found := byte_copies(items["train"], items["test"])):
        say_repeated(say or print, found, items, "byte for byte or pixel for pixel")
    for split in items:  # after byte_copies: pickling a PIL image decodes it
        check_pickles(data[split], f"{where}: the {split} Dataset")
    size, test_size = (out[split][0].image_size for split in SPLITS)
    if size != test_size:
        raise UserError(f"{where}: the train images are {size} px and the test images {test_size} px; give both "
                        f"splits one size.")
    out |= normalisation(data, model_stats or {}, out["train"][0], where, say)
    view = {k: data[k] for k in ("eval_crop", "interpolation") if k in data}  # the built-in loader's resized crops
    return out | {"image_size": int(size)} | view


def check_pickles(dataset, what: str) -> None:
    """Where loader workers start from a forkserver, each gets the Dataset pickled: one that does not pickle is one line
    now, not a worker's traceback."""
    if WORKER_START:
        try:
            ForkingPickler.dumps(dataset)  # as the DataLoader sends it (tensors through shared memory)
        except Exception as e:  # noqa: BLE001 - whatever pickling raises, said in one line
            raise UserError(f"{what} cannot be pickled ({first_line(e)}); on Python before 3.11.10 the loader's "
                            f"workers start from a forkserver and receive it pickled: define its class at the top "
                            f"level of a module and keep no open file, lock or lambda in it, or use Python 3.11.10 "
                            f"or newer.") from None


def normalisation(data: dict, model_stats: dict, images: Images, where: str, say=None) -> dict:
    """{'mean', 'std', 'stats_from'} by one rule, the first that exists: load_data's own, the pretrained model's
    (`model_stats`), the training images' (a constant channel gets std 1, not 0). `say`: one line naming them, where
    they came from and what they won over."""
    model = {k: tuple(map(float, model_stats[k])) for k in ("mean", "std") if k in model_stats}
    if "mean" in data and "std" in data:
        stats, source, whose = {k: tuple(map(float, data[k])) for k in ("mean", "std")}, where, f"{where}'s"
    elif len(model) == 2:
        stats, source, whose = model, "pretrained model", "the pretrained model's"
    else:
        stats, source, whose = dict(zip(("mean", "std"), images.channel_stats())), "training images", \
            "the training images'"
    flat = [name for name, std in zip(CHANNELS, stats["std"]) if not std > 0]  # dividing by it: inputs of inf, NaN
    if flat and source != "training images":
        raise UserError(f"{whose} std ({', '.join(f'{v:.4f}' for v in stats['std'])}) is not above 0 for "
                        f"{', '.join(flat)}: the inputs are divided by it.")
    if flat:  # a channel the same in every pixel (synthetic or single-channel data) carries nothing: left unscaled
        stats["std"] = tuple(1.0 if name in flat else std for name, std in zip(CHANNELS, stats["std"]))
    if say is not None:
        beaten = (f"; the pretrained model's ({_shown(model)}) are not used: {where}'s own win"
                  if len(model) == 2 and source == where and model != stats else "")
        unscaled = (f"; the {' and '.join(flat)} channel{'s are' if len(flat) > 1 else ' is'} the same in every "
                    f"training pixel: std 1 there, not 0" if flat else "")
        say(f"normalising with {whose} {_shown(stats)}{beaten}{unscaled}")
    return stats | {"stats_from": source}


def _shown(stats: dict) -> str:
    return " and ".join(f"{k} ({', '.join(f'{v:.4f}' for v in stats[k])})" for k in ("mean", "std"))


def data_facts(data: dict) -> dict:
    """For summary.json: the source, classes, image size, the mean and std and where they came from, and the
    evaluation's resize and crop."""
    return {"dataset": data["dataset"], "classes": list(data["classes"]), "image_size": data["image_size"],
            "image_mean": [float(m) for m in data["mean"]], "image_std": [float(s) for s in data["std"]],
            "image_stats_from": data["stats_from"],
            **{k: data[k] for k in ("eval_crop", "interpolation") if k in data}}


def _images(images, what: str) -> torch.Tensor:
    """uint8 N x H x W x 3 or N x 3 x H x W (numpy or torch) -> an (N, 3, S, S) tensor, a view where possible."""
    if isinstance(images, np.ndarray):
        with warnings.catch_warnings():  # a read-only memory map: torch warns that writing would be undefined
            warnings.simplefilter("ignore", UserWarning)
            images = torch.from_numpy(images)
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4:
        kind = (f"{str(images.dtype).removeprefix('torch.')} {tuple(images.shape)}" if isinstance(images, torch.Tensor)
                else type(images).__name__)
        raise UserError(f"{what} must be uint8 (0-255), N x H x W x 3 or N x 3 x H x W (got {kind}).")
    if images.shape[1] != 3 and images.shape[3] == 3:
        images = images.permute(0, 3, 1, 2)  # NHWC -> an NCHW view of channels-last memory
    if images.shape[1] != 3 or images.shape[2] != images.shape[3]:
        raise UserError(f"{what} must be square with 3 channels (got {tuple(images.shape)}).")
    return images


def _labels(labels, classes: int, where: str, split: str) -> torch.Tensor:
    labels = torch.as_tensor(np.asarray(labels) if not isinstance(labels, torch.Tensor) else labels)
    if labels.dim() != 1 or labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise UserError(f"{where}: the {split} labels must be integers, one per image (got "
                        f"{str(labels.dtype).removeprefix('torch.')} "
                        f"{tuple(labels.shape)}).")
    labels = labels.to(torch.int64)
    bad = torch.nonzero((labels < 0) | (labels >= classes)).flatten()
    if len(bad):
        raise UserError(f"{where}: the {split} split has label {int(labels[bad[0]])} at row {int(bad[0])}; with "
                        f"{classes} classes, labels are 0-{classes - 1}.")
    return labels
