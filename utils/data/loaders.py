"""The loaders, from a split's images of any kind (images.py's `Images`, the only thing used of them): the kind's
training order, its LoaderDataset's one call per batch with each image's draws (so the DataLoader that
`accelerator.prepare` shards does no per-image Python work), then transform.py's BatchTransform on the device."""

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
    """The first n (images, labels) of a split (all with n None), the images as an `Images` kind."""
    images, labels = as_images(pair[0]), pair[1]
    if n is not None and n > len(labels):
        raise UserError(f"{flag} {n} is larger than the split ({len(labels)} images).")
    return (images, labels) if n is None else (images.prefix(n), labels[:n])


def say_counts(train_labels: torch.Tensor, eval_labels: torch.Tensor, classes: tuple[str, ...], say,
               evaluated: str | None = None) -> None:
    """One line of what trains and what is evaluated (images, split, classes, the fewest and most per class) and a
    warning naming classes without a training or an evaluation image."""
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
    """A DataLoader for prepare() over any kind of images. Training: the kind's sampler (whole global batches of
    global_batch) and batches (images, labels, Draws); evaluation: every image in order. `timeout`: seconds a loader
    worker may take for a batch (0: forever; its stacks go to stderr at half of it)."""
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
    """make_loader's DataLoader again over the same dataset and sampler in batches of batch_size: the same images in the
    same order, cut finer (utils.guard.MemoryGuard)."""
    return torch.utils.data.DataLoader(loader.dataset, batch_size=batch_size, sampler=loader.sampler,
                                       drop_last=loader.drop_last, collate_fn=loader.collate_fn,
                                       pin_memory=loader.pin_memory, num_workers=loader.num_workers,
                                       timeout=loader.timeout, multiprocessing_context=loader.multiprocessing_context)


def build_loaders(data: dict, cfg, accelerator, plan):
    """Training and evaluation DataLoaders over checked_data's splits, for prepare(): order and augmentation keyed by
    --seed, epoch and sample, every epoch whole steps of the plan's global batch. A loader worker giving no batch within
    half of --dist-timeout stops the job before the peers' collectives time out."""
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
