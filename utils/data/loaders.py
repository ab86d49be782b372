"""The loaders, from a split's images of any kind (utils/data/images.py's `Images`, the only thing used of them) to
batches the same at any process count:
  1. the kind's training order (`EpochSampler`: by (seed, epoch) alone, cut to whole global batches; a stream's own),
  2. its loader dataset's `__getitems__`, one whole batch per call with each image's draws from (seed, epoch, index),
     so the DataLoader that `accelerator.prepare` wraps (sharding, skip_first_batches, gather_for_metrics all stay
     Accelerate's) does no per-image Python work,
  3. then, on the device, utils/data/transform.py's BatchTransform.
"""

from __future__ import annotations

import torch
from accelerate.utils import broadcast_object_list

from utils import UserError
from utils.data.draws import Mixing, crop_padding
from utils.data.images import WORKER_START, Images, LoaderDataset, as_images
from utils.data.transform import Policy, augment_policy


def check_one_batch(labels: torch.Tensor, batch_size: int, processes: int, accumulation: int = 1) -> None:
    """Training keeps whole global batches only: a split smaller than one would train nothing."""
    if len(labels) < batch_size * processes * accumulation:
        raise UserError(f"{len(labels)} training images do not fill one global batch of "
                        f"{batch_size * processes * accumulation} ({batch_size} on each of {processes} processes x "
                        f"{accumulation} accumulation steps).")


def take_prefix(pair: tuple[Images | torch.Tensor, torch.Tensor], n: int | None, flag: str):
    """The first n (images, labels) of a split (all with n None), the images as an `Images` kind (as_images); a
    prefix is class-balanced (rows are shuffled)."""
    images, labels = as_images(pair[0]), pair[1]
    if n is not None and n > len(labels):
        raise UserError(f"{flag} {n} is larger than the split ({len(labels)} images).")
    return (images, labels) if n is None else (images.prefix(n), labels[:n])


def say_counts(train_labels: torch.Tensor, eval_labels: torch.Tensor, classes: tuple[str, ...], say,
               evaluated: str | None = None) -> None:
    """One line of what trains and what is evaluated (after --train-subset and --eval-subset): the images, the split
    evaluated on (when the source names it), the classes and the fewest and most training images a class has; and a
    warning naming the classes without a training image, which the model cannot learn, and one naming those without
    an evaluation image, whose accuracy is not measured."""
    counts = torch.bincount(train_labels.cpu(), minlength=len(classes)).tolist()
    few, many = counts.index(min(counts)), counts.index(max(counts))
    images = f"{counts[few]:,} training image{'s' * (counts[few] != 1)}"
    spread = f"{images} each" if counts[few] == counts[many] else \
        f"{images} of {classes[few]} to {counts[many]:,} of {classes[many]}"
    split = f" ({evaluated})" if evaluated else ""
    say(f"data: {len(train_labels):,} training and {len(eval_labels):,} evaluation images{split} of {len(classes)} "
        f"classes ({spread})")
    eval_counts = torch.bincount(eval_labels.cpu(), minlength=len(classes)).tolist()
    for held, what, why in ((counts, "training", "the model cannot learn them"),
                            (eval_counts, "evaluation", "their accuracy is not measured")):
        missing = [name for name, n in zip(classes, held) if n == 0]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5:,} more" if len(missing) > 5 else "")
            say(f"warning: {len(missing):,} of the {len(classes)} classes have no {what} image ({shown}): {why}")


def keep_batch(batch):
    """collate_fn for LoaderDataset: `__getitems__` already returned the collated batch."""
    return batch


def make_loader(images: Images | torch.Tensor, labels: torch.Tensor, batch_size: int, train: bool, seed: int = 0,
                augment: bool = False, pad: int = 4, global_batch: int | None = None, mixing: Mixing | None = None,
                processes: int = 1, timeout: float = 0, erasing: float = 0.0,
                policy: Policy | None = None) -> torch.utils.data.DataLoader:
    """A plain DataLoader for `accelerate.prepare`, over any kind of images (a bare uint8 tensor is TensorImages).
    Training: the kind's sampler (EpochSampler: reshuffled per epoch from the seed, whole global batches only;
    global_batch unset: batch_size) and batches (images, labels, draws; `erasing`: --random-erase's chance;
    `policy`: --auto-augment's);
    evaluation keeps every image in order, as (images, labels). The kind's loader workers read and decode (none for
    images in memory); `timeout`: seconds a worker may take to give its batch before the loader raises (0: forever;
    utils.launch.run says it in one line; the worker has written its stacks to stderr at half of it)."""
    images = as_images(images)
    watch_s = timeout / 2 if images.workers else 0.0  # a hung worker's stacks, well before the loader gives up
    dataset = LoaderDataset(images, labels, seed if train else None, augment, pad, mixing, erasing, policy, watch_s)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=images.sampler(dataset, train, seed, global_batch or batch_size, batch_size, processes),
        drop_last=train,
        collate_fn=keep_batch,
        pin_memory=torch.cuda.is_available() and not images.on_device,  # asynchronous copies
        # not persistent: each epoch's workers start after set_epoch, with the epoch that keys their draws
        num_workers=images.workers,
        timeout=timeout if images.workers else 0,  # a hung worker stops the job instead of hanging it
        multiprocessing_context=WORKER_START if images.workers else None,
    )


def rebatched(loader: torch.utils.data.DataLoader, batch_size: int) -> torch.utils.data.DataLoader:
    """make_loader's DataLoader (before prepare()) again, over the same dataset and sampler, in batches of
    batch_size: the same images in the same order, cut finer (utils.guard.MemoryGuard)."""
    return torch.utils.data.DataLoader(loader.dataset, batch_size=batch_size, sampler=loader.sampler,
                                       drop_last=loader.drop_last, collate_fn=loader.collate_fn,
                                       pin_memory=loader.pin_memory, num_workers=loader.num_workers,
                                       timeout=loader.timeout, multiprocessing_context=loader.multiprocessing_context)


def build_loaders(data: dict, cfg, accelerator, plan):
    """Training and evaluation DataLoaders over checked_data's splits; prepare() then shards them and moves batches
    to the device. The training order and augmentation are keyed by --seed, the epoch and the sample, and every
    epoch is whole optimizer steps of the plan's global batch (utils.plan.BatchPlan). cfg: the data group of a
    script's Config (train_subset, eval_subset, data_on_device, seed, augment, mixup, cutmix, mix_prob,
    random_erase, auto_augment and its strengths, data_workers; and dist_timeout: a loader worker that gives no
    batch within half of it stops the job, so the rank waiting on it says so before its peers' collectives time out)."""
    train_split = take_prefix(data["train"], cfg.train_subset, "--train-subset")
    eval_split = take_prefix(data["test"], cfg.eval_subset, "--eval-subset")
    check_one_batch(train_split[1], plan.micro, accelerator.num_processes, plan.accumulation)
    say_counts(train_split[1], eval_split[1], data["classes"], accelerator.print,
               data.get("dataset", {}).get("eval_split"))
    if cfg.data_on_device:  # GPU-resident: Accelerate's move to the device becomes a no-op
        train_split, eval_split = ((images.to(accelerator.device), labels.to(accelerator.device))
                                   for images, labels in (train_split, eval_split))
    if cfg.augment == "resized-crop" and not train_split[0].crops_whole:
        raise UserError("--augment resized-crop crops whole images as they are decoded: load_data must return images "
                        "decoded on the fly (a torch Dataset, or the built-in --data-dir with --decode workers or "
                        "stream), not decoded arrays or tensors.")
    if train_split[0].workers and cfg.data_workers:  # the flag over a kind's own share of the cores
        train_split[0].workers = eval_split[0].workers = cfg.data_workers
    if train_split[0].workers and accelerator.num_processes > 1:  # main's count of loader workers on every process
        # (machines may have other core counts): a stream's plan is laid out by it
        train_split[0].workers = eval_split[0].workers = broadcast_object_list([train_split[0].workers])[0]
    mixing = Mixing(cfg.mixup, cfg.cutmix, cfg.mix_prob) if cfg.mixup or cfg.cutmix else None
    timeout = cfg.dist_timeout / 2
    train = make_loader(*train_split, plan.micro, train=True, seed=cfg.seed, augment=cfg.augment != "none",
                        pad=crop_padding(data["image_size"]), global_batch=plan.global_batch, mixing=mixing,
                        processes=plan.processes, timeout=timeout, erasing=cfg.random_erase,
                        policy=augment_policy(cfg))
    train.sampler.save_with(accelerator)  # a stream's: the layout its epoch was planned in, in each checkpoint
    return train, make_loader(*eval_split, plan.micro, train=False, processes=plan.processes, timeout=timeout)
