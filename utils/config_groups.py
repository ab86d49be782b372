"""The Config groups both templates share, defined once: data, evaluation, checkpoints, logging, the Hub. A script's
`Config` inherits them (`class Config(HubConfig, LoggingConfig, CheckpointConfig, EvaluationConfig, DataConfig)`),
so its command line stays flat (`--data-dir`, not `--data.data-dir`), `--help` keeps the groups, and `asdict(cfg)`
stays one flat dict for the tracker and summary.json. The model and optimisation fields, which copiers edit, stay in
the script. Each group checks its own fields in `validate()` and then hands on to the next group (cooperative
`super().validate()`)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from utils import UserError
from utils.cli import check_ranges, opt

REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")  # a Hub repo id: owner/name
MAX_IMAGE_SIZE = 1024  # --image-size's bound against a typo: the largest input of timm's pretrained models
BUILT_IN = ("loss", "top1", "top5", "examples", "class_top1", "confusion")  # evaluate()'s metrics


@dataclass
class Group:
    def validate(self) -> None:
        """The end of the chain: each group checks its fields, then calls super().validate()."""


@dataclass
class DataConfig(Group):
    # --- data: where the images come from, how many, how they are augmented ---
    data_dir: str | None = opt(None, "local data: a folder of train-*.parquet / test-*.parquet (Hub layout) or an "
                               "image folder (train/<class>/*.png, test/<class>/...); or parquet or tar shards, in a "
                               "folder or at a URL (--decode stream)")
    dataset: str | None = opt(None, "a Hub image-classification dataset, when --data-dir is unset (each machine's "
                              "first process downloads it); unset: uoft-cs/cifar10")
    image_column: str | None = opt(None, "the data's image column; unset: img or image")
    label_column: str | None = opt(None, "the data's label column; unset: label, labels or fine_label")
    eval_split: str | None = opt(None, "the source's split to evaluate on (validation, val, test, ...); unset: its "
                                 "validation split, else its test split, else --val-fraction of train")
    val_fraction: float | None = opt(None, "evaluate on this fraction of the training images, held out (each "
                                     "class's share, fixed); unset: the validation (val/) or test split, else 0.1 "
                                     "held out")
    cache_dir: str | None = opt(None, "decoded-tensor cache, and --decode stream's shard indices; unset: "
                                "<data-dir>/.decoded if writable, else ~/.cache/accelerate-cifar")
    decode_workers: int | None = opt(None, "processes that decode the source into the cache (the first run on a "
                                     "machine); unset: one per core")
    image_size: int | None = opt(None, "resize every image to S x S (8-1024), as decoded once; unset: the images' "
                                 "own size, which they must then all share")
    train_subset: int | None = opt(None, "train on the first N training images only")
    eval_subset: int | None = opt(None, "evaluate on the first N test (or held-out) images only")
    decode: str = opt("auto", "cache: decode every image once into a uint8 cache file; workers: keep the images "
                      "encoded and decode each batch in the loader's worker processes (full-size images); stream: "
                      "read parquet or tar shards (a folder or a URL) block by block with no local copy, decoded as "
                      "workers does; gpu: keep the images encoded and decode each batch's JPEGs on the GPU (nvJPEG, "
                      "through TorchCodec), then crop and resize them there; auto: stream for a URL or tar shards, "
                      "workers for --augment resized-crop or when the decoded images would not fit the cache "
                      "folder's free space, else cache",
                      ("auto", "cache", "workers", "stream", "gpu"))
    full_decode: bool = opt(False, "decode every JPEG at full size; unset: at the smallest of 1/8, 1/4, 1/2 or full "
                            "scale that still holds the pixels its crop or resize needs (faster for large photos)")
    data_workers: int | None = opt(None, "--decode workers / stream, or a Dataset from load_data: loader worker "
                                   "processes per process; unset: this process's share of the cores")
    shuffle_buffer: int = opt(4096, "--decode stream: each reader shuffles its rows within windows of this many "
                              "images (it holds at most three windows' encoded images)")
    shuffle_block: int = opt(64, "--decode stream: the shards are cut into blocks of this many rows, shuffled across "
                             "all shards each epoch (one read each); a window mixes about buffer / block of them")
    read_ahead: int = opt(4, "--decode stream: reads in flight per loader worker, the next window read while this "
                          "one is decoded; 0: each read when asked")
    augment: str = opt("standard", "standard: random crop (zero padding of S/8 px) + horizontal flip, on the device; "
                       "resized-crop: the natural-image recipe, a random-resized crop to S x S + flip in training, "
                       "resize to S / --eval-crop + centre crop in evaluation; none",
                       ("standard", "resized-crop", "none"))
    crop_scale: tuple[float, float] = opt((0.08, 1.0), "--augment resized-crop: the range of the crop's share of the "
                                          "image's area")
    crop_ratio: tuple[float, float] = opt((0.75, 4 / 3), "--augment resized-crop: the range of the crop's aspect "
                                          "ratio (width / height), drawn log-uniform")
    eval_crop: float | None = opt(None, "--augment resized-crop: evaluate on the centre S x S of each image resized "
                                  "to S / this on its shorter side; unset: a pretrained --model's crop fraction, "
                                  "else 0.875")
    interpolation: str | None = opt(None, "--augment resized-crop: the resize filter of its crops, in training and "
                                    "evaluation; unset: a pretrained --model's, else bilinear",
                                    ("bilinear", "bicubic"))
    mixup: float = opt(0.0, "mixup: blend each training image with another of its batch, lambda ~ Beta(A, A) (e.g. "
                       "0.2); drawn per image from the seed, epoch and image, as the crops; 0: off")
    cutmix: float = opt(0.0, "cutmix: paste a box of another image of the batch, of area 1 - lambda, lambda ~ Beta(A, "
                        "A) (e.g. 1.0); the labels weighted by the pasted area; with --mixup, each image one or the "
                        "other; 0: off")
    mix_prob: float = opt(1.0, "the share of training images that --mixup / --cutmix mix")
    random_erase: float = opt(0.0, "random erasing (torchvision's RandomErasing, random values): the chance that a "
                              "training image has a box of 2-33% of its area (aspect 0.3-3.3) replaced by normal "
                              "noise after normalising, drawn per image as the crops (e.g. 0.25); 0: off")
    auto_augment: str = opt("none", "a per-image augmentation policy, torchvision's: ta_wide (TrivialAugmentWide), ra "
                            "(RandAugment), augmix (AugMix), on each training image after its crop and flip, drawn per "
                            "image as the crops", ("none", "ta_wide", "ra", "augmix"))
    ra_ops: int = opt(2, "--auto-augment ra: ops per image, at least 1")
    ra_magnitude: int = opt(9, "--auto-augment ra: the ops' magnitude bin, 0-30")
    augmix_severity: int = opt(3, "--auto-augment augmix: magnitudes from the first N of 10 bins, 1-10")
    data_on_device: bool = opt(False, "keep both splits on the GPU (uint8, CIFAR-10: 176 MiB, in every process): no "
                               "host-to-device copy per batch")

    def validate(self) -> None:
        check_ranges(self, positive=["train_subset", "eval_subset", "mix_prob", "decode_workers", "data_workers",
                                     "shuffle_buffer", "shuffle_block", "ra_ops"],
                     non_negative=["mixup", "cutmix", "read_ahead", "random_erase"])
        if self.mix_prob > 1:
            raise UserError(f"--mix-prob is a share of the images, at most 1 (got {self.mix_prob:g}).")
        if self.random_erase > 1:
            raise UserError(f"--random-erase is a chance per image, at most 1 (got {self.random_erase:g}).")
        if (self.mixup or self.cutmix) and self.augment == "none":
            raise UserError("--mixup and --cutmix mix augmented images: they need --augment standard or resized-crop.")
        if self.random_erase and self.augment == "none":
            raise UserError("--random-erase erases augmented images: it needs --augment standard or resized-crop.")
        if self.auto_augment != "none" and self.augment == "none":
            raise UserError("--auto-augment augments the training crops: it needs --augment standard or resized-crop.")
        if not 0 <= self.ra_magnitude <= 30:
            raise UserError(f"--ra-magnitude is a bin of RandAugment's 31, 0-30 (got {self.ra_magnitude}).")
        if not 1 <= self.augmix_severity <= 10:
            raise UserError(f"--augmix-severity is 1-10, AugMix's (got {self.augmix_severity}).")
        self.crop_scale, self.crop_ratio = tuple(self.crop_scale), tuple(self.crop_ratio)
        if not 0 < self.crop_scale[0] <= self.crop_scale[1] <= 1:
            raise UserError(f"--crop-scale takes two shares of the area, 0 < MIN <= MAX <= 1 (got {self.crop_scale}).")
        if not 0 < self.crop_ratio[0] <= self.crop_ratio[1]:
            raise UserError(f"--crop-ratio takes two aspect ratios, 0 < MIN <= MAX (got {self.crop_ratio}).")
        if self.decode == "cache" and self.augment == "resized-crop":
            raise UserError("--augment resized-crop crops whole images as they are decoded: it needs --decode workers "
                            "(or auto), not --decode cache.")
        if is_url(self.data_dir) and self.decode in ("cache", "workers", "gpu"):
            raise UserError(f"--data-dir {self.data_dir} is a URL: its shards are streamed (--decode stream or auto), "
                            f"not read through --decode {self.decode}.")
        if self.decode == "stream" and self.val_fraction is not None:
            raise UserError("--decode stream evaluates on the source's own test or validation shards; --val-fraction "
                            "holds rows out of a table, not of a stream.")
        if self.eval_crop is not None and not 0 < self.eval_crop <= 1:
            raise UserError(f"--eval-crop must be in (0, 1] (got {self.eval_crop:g}).")
        if self.image_size is not None and not 8 <= self.image_size <= MAX_IMAGE_SIZE:
            raise UserError(f"--image-size must be between 8 and {MAX_IMAGE_SIZE} pixels (got {self.image_size}).")
        check_source(self.data_dir, self.dataset, self.val_fraction, self.eval_split)
        super().validate()


@dataclass
class EvaluationConfig(Group):
    # --- evaluation: when, of which weights; when a run stops for lack of progress ---
    eval_every_steps: int | None = opt(None, "also evaluate every N optimizer steps within an epoch (always at each "
                                       "epoch's end), each followed by a checkpoint; the best weights are kept from "
                                       "any of them")
    ema_decay: float | None = opt(None, "keep an exponential moving average of the weights with this decay (e.g. "
                                  "0.999; warmed up as min(D, (1+t)/(10+t)) at update t), evaluated beside them "
                                  "(eval/ema_*), choosing best.safetensors unless --best-metric says otherwise, "
                                  "exported as model_ema.safetensors")
    best_metric: str | None = opt(None, "the evaluation metric that picks best.safetensors and drives "
                                  "--early-stop-patience: loss, top1, top5, a --metric's key (eval/KEY), or ema_ and "
                                  "any of these with --ema-decay; lower is better for loss, higher for the others, "
                                  "unless NAME:min or NAME:max says otherwise; unset: ema_top1 with --ema-decay, "
                                  "else top1")
    early_stop_patience: int | None = opt(None, "stop after this many evaluations in a row without a gain in "
                                          "--best-metric of more than --early-stop-min-delta (decided on all ranks "
                                          "together; the outputs as at the end); unset: never")
    early_stop_min_delta: float = opt(0.0, "what an evaluation must beat the last gain's --best-metric value by, in "
                                      "that metric's units (top-1: points), to count as a gain (the first evaluation "
                                      "is one)")

    def validate(self) -> None:
        check_ranges(self, positive=["eval_every_steps", "early_stop_patience"], non_negative=["early_stop_min_delta"])
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise UserError(f"--ema-decay must be between 0 and 1, e.g. 0.999 (got {self.ema_decay}).")
        self.best()  # its form; the name is checked against the evaluation's keys once the metrics are loaded
        super().validate()

    def best(self) -> tuple[str, str]:
        """(metric key, mode: max or min) of --best-metric; unset: ema_top1 with --ema-decay, else top1."""
        if self.best_metric is None:
            return ("ema_top1" if self.ema_decay else "top1"), "max"
        name, _, mode = self.best_metric.partition(":")
        if mode not in ("", "max", "min") or not name:
            raise UserError(f"--best-metric {self.best_metric}: NAME, NAME:max or NAME:min (e.g. loss, top1, "
                            f"f1_macro:max).")
        if name.startswith("ema_") and not self.ema_decay:
            raise UserError(f"--best-metric {self.best_metric}: an EMA's metric needs --ema-decay.")
        return name, mode or ("min" if name.removeprefix("ema_") == "loss" else "max")


@dataclass
class CheckpointConfig(Group):
    # --- checkpoints: where the outputs go; resume, how often, how many; how long to wait for a missing process ---
    output_dir: str = opt("runs/cifar10", "summary.json, model.safetensors, checkpoints and tracker files go here")
    resume: str | None = opt(None, "auto: continue from the newest sound checkpoint in <output-dir>/checkpoints "
                             "(fresh if none); or a checkpoint folder")
    checkpoint_every_steps: int | None = opt(None, "also checkpoint every N optimizer steps (always at the end of "
                                             "each epoch)")
    keep_last: int = opt(2, "checkpoints kept, besides the best one")
    overwrite: bool = opt(False, "start fresh in an output dir holding an earlier run's checkpoints, deleting them")
    dist_timeout: int = opt(600, "seconds a collective waits for a missing process before the job fails (a "
                            "loader worker gets half of it to give each batch)")

    def validate(self) -> None:
        check_ranges(self, positive=["checkpoint_every_steps", "keep_last", "dist_timeout"], non_negative=[])
        if (trial := sweep_trial()) is not None:  # each trial its own folder, continued when the agent restarts it
            self.output_dir, self.resume = str(Path(self.output_dir) / trial), self.resume or "auto"
        super().validate()


@dataclass
class LoggingConfig(Group):
    # --- logging: the tracker, the run's name and group, how often it hears from the run ---
    tracker: str = opt("wandb" if importlib.util.find_spec("wandb") else "none",
                       "wandb (the default when installed; offline by itself without credentials), tensorboard "
                       "(<output-dir>/<project>/) or none", ("wandb", "tensorboard", "none"))
    wandb_project: str | None = opt(None, "W&B project (TensorBoard: the folder name); unset: $WANDB_PROJECT, else "
                                    "cifar10-accelerate")
    run_name: str | None = opt(None, "W&B run name; unset: $WANDB_NAME, else W&B picks one")
    group: str | None = opt(None, "W&B group, e.g. one per setting run with several seeds (compare_runs.py "
                            "--by-group)")
    tags: str | None = opt(None, "comma-separated W&B tags (or $WANDB_TAGS)")
    wandb_log_model: str = opt("none", "keep the weights as versions of the W&B model artifact model-<run id>, "
                               "linked to the run, each a folder predict.py and evaluate_checkpoint.py read "
                               "(wandb:ENTITY/PROJECT/model-RUNID:ALIAS): end: once finished, the best weights (alias "
                               "best) and the run's folder (latest, step-N); best: also each new best's weights (best, "
                               "step-N); checkpoints: also every checkpoint folder, resumable (step-N); none",
                               ("none", "end", "best", "checkpoints"))
    log_predictions: int = opt(0, "a W&B table of N evaluation images at each new best and at the end: the "
                               "misclassified first, the most confident first among them; each row the image as "
                               "evaluation saw it, its index, true class, predicted class and probability, and the "
                               "top 5; 0: none")
    log_every: int = opt(50, "optimizer steps between train/loss, train/lr, train/images_per_sec, train/grad_norm logs")
    profile: bool = opt(False, "trace optimizer steps 6-8 with torch.profiler (through Accelerate): a Chrome trace per "
                        "rank in <output-dir>/profile/, and the ten most expensive ops printed")
    progress_every: float = opt(60.0, "without a terminal (SLURM logs): seconds between console progress lines (step, "
                                "loss, img/s, ETA), printed at log steps; 0: at every log step")

    def validate(self) -> None:
        check_ranges(self, positive=["log_every"], non_negative=["progress_every", "log_predictions"])
        if self.log_predictions and self.tracker != "wandb":
            raise UserError(f"--log-predictions {self.log_predictions} logs a W&B table: it needs --tracker wandb (got "
                            f"--tracker {self.tracker}).")
        if self.wandb_log_model != "none" and self.tracker != "wandb":
            raise UserError(f"--wandb-log-model {self.wandb_log_model} logs to W&B: it needs --tracker wandb (got "
                            f"--tracker {self.tracker}).")
        super().validate()


@dataclass
class HubConfig(Group):
    # --- hub: start from trained weights, metrics by name, share the result ---
    init_from: str | None = opt(None, "start from trained weights: a .safetensors file or run folder, a Hub model repo "
                                "(owner/name[@revision]) or torchvision:IMAGENET1K_V1 (the ResNet-18s); the head's "
                                "rows matched by class name (a run's), else new when the class count differs; a "
                                "resumed run keeps its checkpoint's weights")
    metric: list[str] | None = opt(None, "also compute this `evaluate` metric at each evaluation, on the gathered "
                                   "top-1 predictions: NAME[:key=value,...] (e.g. f1:average=macro) or a local "
                                   "metric script; logged as eval/NAME; give the flag once per metric")
    push_to_hub: str | None = opt(None, "at the end of a finished run, upload the exported weights, summary.json, the "
                                  "config and a model card to this Hub model repo (owner/name)")

    def validate(self) -> None:
        labels = [metric_label(*parse_metric(spec)) for spec in self.metric or ()]  # one line for a malformed spec
        if len(set(labels)) < len(labels):
            raise UserError(f"--metric: each metric once (got {', '.join(self.metric)}).")
        if self.push_to_hub is not None and not REPO_ID.fullmatch(self.push_to_hub):
            raise UserError(f"--push-to-hub takes a Hub model repo id, owner/name (got {self.push_to_hub!r}).")
        super().validate()


# The validators' helpers (also used by utils/data/decode.py and utils/evaluation.py) -------------------------------
DATA_LAYOUTS = ("--data-dir takes a folder of train-*.parquet / test-*.parquet files (a Hub dataset's layout) or an "
                "image folder (train/<class>/*.png, test/<class>/... or val/<class>/...; or <class>/*.png alone); "
                "leave it out to download uoft-cs/cifar10 from the Hub, or pass --dataset OWNER/NAME.")


def is_url(path: str | None) -> bool:
    """Whether --data-dir names shards at a URL (s3://, hf://, https://: read through fsspec, utils/data/stream.py)."""
    return path is not None and "://" in path


def sweep_trial() -> str | None:
    """Under a W&B sweep agent (WANDB_SWEEP_ID set): its run id for this trial (WANDB_RUN_ID), the name of the
    trial's folder in --output-dir; else None."""
    if not os.environ.get("WANDB_SWEEP_ID"):
        return None
    run_id = os.environ.get("WANDB_RUN_ID", "")
    if not re.fullmatch(r"\w[\w.-]*", run_id):
        raise UserError(f"WANDB_SWEEP_ID is set, but WANDB_RUN_ID is {run_id!r}, not a W&B run id: start a sweep's "
                        f"trials with `wandb agent SWEEP_ID`, which sets both.")
    return run_id


def check_source(data_dir: str | None, dataset: str | None, val_fraction: float | None,
                 eval_split: str | None = None) -> None:
    """One line for source flags that contradict each other or are out of range (the data group's validate() and
    utils.data.decode.load_source)."""
    if eval_split is not None and val_fraction is not None:
        raise UserError(f"pass either --eval-split ({eval_split}, a split of the source) or --val-fraction "
                        f"({val_fraction:g}, a part of train held out), not both.")
    if eval_split == "train":
        raise UserError("--eval-split train: the training split is trained on; name the source's evaluation split "
                        "(validation, test, ...), or hold a part of train out with --val-fraction.")
    if data_dir is not None and dataset is not None:
        raise UserError(f"pass either --data-dir ({data_dir}) or --dataset ({dataset}), not both.")
    if data_dir is not None and not is_url(data_dir) and not Path(data_dir).exists():  # URLs: when listed
        raise UserError(f"--data-dir {data_dir} does not exist. {DATA_LAYOUTS}")
    if val_fraction is not None and not 0 < val_fraction < 1:
        raise UserError(f"--val-fraction must be between 0 and 1 (got {val_fraction:g}).")


# --metric NAME[:key=value,...] ------------------------------------------------------------------------------------
def parse_metric(spec: str) -> tuple[str, dict]:
    """'f1:average=macro' -> ('f1', {'average': 'macro'}): the name (or a local script's path) and the keyword
    arguments of the metric's compute(); a value is a Python literal (1, 0.5, None, True) or else a string."""
    name, _, options = spec.partition(":")
    kwargs = {}
    for option in filter(None, options.split(",")):
        key, eq, value = option.partition("=")
        if not eq or not key.isidentifier():
            raise UserError(f"--metric {spec}: options are key=value pairs separated by commas, e.g. "
                            f"f1:average=macro.")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    if not name:
        raise UserError(f"--metric {spec!r} names no metric (e.g. --metric f1:average=macro).")
    return name, kwargs


def metric_label(name: str, kwargs: dict) -> str:
    """The key a metric is logged under (eval/<label>): its name, or a script's file name without .py, then the
    option values: f1:average=macro -> f1_macro. The built-in keys are taken."""
    stem = Path(name).stem if name.endswith(".py") else Path(name).name
    label = re.sub(r"\W+", "_", "_".join([stem, *map(str, kwargs.values())])).strip("_").lower()
    if label in BUILT_IN:
        raise UserError(f"--metric {name}: {label} is a built-in metric already (eval/{label}).")
    return label
