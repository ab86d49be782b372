"""The seed's plain-PyTorch DDP script, done right with HuggingFace Accelerate: ResNet-18 on CIFAR-10, nothing else.

    python train_minimal.py --data-dir ../shared/data/cifar10                                   # 1 process
    accelerate launch --config_file accelerate_configs/cpu.yaml  train_minimal.py --data-dir DATA   # 2 gloo ranks
    accelerate launch --config_file accelerate_configs/4gpu.yaml train_minimal.py --data-dir DATA   # 4 GPUs, DDP

The same training as train_cifar.py with --no-channels-last --grad-clip 0 --scale-lr (the tests hold the two to the
same losses and weights), without its surroundings: no atomic checkpoints, preemption handling, NaN guard, FSDP,
run continuation in W&B or recipes. Copy train_cifar.py when you need those. The data path (decode once, shard,
augment on the device) comes from utils/data/ (decode.py, loaders.py, transform.py), the model from utils/models.py; the
Accelerate idioms (prepare, accumulate, gather_for_metrics, save_state) are written out here on purpose, though
train_cifar.py uses them too.
"PITFALL" marks each line that avoids one of the classic silent failures of the seed (its sections 12-14).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed

from utils import UserError, process_count_problem
from utils.cli import FlagParser, write_config_file
from utils.config_groups import sweep_trial
from utils.data.decode import load_source
from utils.data.draws import crop_padding
from utils.data.loaders import check_one_batch, make_loader, take_prefix
from utils.data.transform import BatchTransform
from utils.launch import run
from utils.models import named_model
from utils.optim import parameter_groups
from utils.schedule import warmup_cosine
from utils.tracking import wandb_offline_without_credentials

REFERENCE_BATCH = 128  # --lr is the learning rate for this many images per optimizer step


def parse_config(argv=None) -> argparse.Namespace:
    p = FlagParser(description=__doc__.splitlines()[0])  # argparse: whole names, --config FILE.yaml, one-line errors
    p.add_argument("--data-dir", help="folder with the Hub's parquet files; unset: download uoft-cs/cifar10")
    p.add_argument("--output-dir", default="runs/minimal", help="checkpoints, summary.json, model.safetensors")
    p.add_argument("--epochs", type=int, default=30, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=128, help="images per process per micro-step")
    p.add_argument("--lr", type=float, default=0.1, help=f"peak lr for a global batch of {REFERENCE_BATCH}")
    p.add_argument("--train-subset", type=int, help="train on the first N training images only")
    p.add_argument("--eval-subset", type=int, help="evaluate on the first N test images only")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--seed", type=int, default=0, help="weights, data order and augmentation")
    p.add_argument("--tracker", default="wandb" if importlib.util.find_spec("wandb") else "none",
                   choices=["wandb", "tensorboard", "none"], help="wandb, tensorboard or none")
    p.add_argument("--resume", nargs="?", const="auto", choices=["auto"],
                   help="continue from the newest epoch checkpoint in --output-dir (fresh if none); `auto` optional")
    args = p.parse_args(argv)  # also W&B sweep agents' spelling: --batch_size=64, a boolean's --flag=True
    if (trial := sweep_trial()) is not None:  # a W&B sweep agent's trial: its own folder, continued when restarted
        args.output_dir, args.resume = str(Path(args.output_dir) / trial), args.resume or "auto"
    for name in ("epochs", "batch_size", "lr", "grad_accum", "train_subset", "eval_subset"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive (got {getattr(args, name)}).")
    return args


@torch.no_grad()
def evaluate(model, loader, transform, accelerator) -> tuple[int, float]:
    """(test images, top-1 %) over all ranks. PITFALL (duplicated validation): each rank evaluates its own shard of
    the test set, and gather_for_metrics drops the padding that evened the shards, so every image counts once."""
    model.eval()
    correct = total = 0
    for images, labels in loader:
        predictions = model(transform(images)).argmax(dim=1)
        predictions, labels = accelerator.gather_for_metrics((predictions, labels))
        correct += (predictions == labels).sum()
        total += len(labels)
    return total, 100.0 * float(correct) / max(total, 1)


def main(args: argparse.Namespace) -> dict:
    if args.tracker == "wandb":
        wandb_offline_without_credentials()  # W&B would stop to ask for a key; offline instead (`wandb sync` later)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # on CPU, launched processes form a gloo group only with cpu=True
        gradient_accumulation_steps=args.grad_accum,
        log_with=None if args.tracker == "none" else args.tracker,
        # Checkpoints go to <output-dir>/checkpoints/checkpoint_<i>, the newest 2 kept.
        project_config=ProjectConfiguration(args.output_dir, automatic_checkpoint_naming=True, total_limit=2),
    )  # no mixed_precision here: the launcher's (YAML or --mixed_precision) is what runs
    problem = process_count_problem(accelerator.num_processes)  # N launched processes that would each train alone
    if problem:
        raise UserError(problem)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":  # on CPU, Accelerate would run DDP silently
        raise UserError("train_minimal.py runs DDP; for an FSDP launch config use train_cifar.py.")
    world, out = accelerator.num_processes, Path(args.output_dir)
    done = sorted((out / "checkpoints").glob("checkpoint_*"), key=lambda f: int(f.name.split("_")[1]))  # epochs
    if done and not args.resume:  # checked first: a fresh run never overwrites an earlier one
        raise UserError(f"{out} holds checkpoints of an earlier run; pass --resume or use another --output-dir.")
    global_batch = args.batch_size * world * args.grad_accum
    lr = args.lr * global_batch / REFERENCE_BATCH  # PITFALL (LR not scaled): linear scaling rule
    accelerator.print(f"{world} process(es), {accelerator.distributed_type.value}, mixed precision "
                      f"{accelerator.mixed_precision}; global batch {global_batch}, lr {lr:g}")
    if os.environ.get("WANDB_SWEEP_ID"):
        accelerator.print(f"W&B sweep {os.environ['WANDB_SWEEP_ID']}: this trial trains in {out}")

    # Data: whole splits as uint8 tensors (decoded once, cached); prepare() shards them over the processes.
    data = load_source(args.data_dir, None if args.data_dir else "uoft-cs/cifar10")  # decoded once per machine
    train_split = take_prefix(data["train"], args.train_subset, "--train-subset")
    check_one_batch(train_split[1], args.batch_size, world, args.grad_accum)  # fewer would train nothing
    # PITFALL (no set_epoch): the sampler reshuffles every epoch (train_loader.set_epoch below) from the seed, the
    # same order on every rank, each rank taking its own slice. Each batch brings its crops and flips, keyed by
    # (seed, epoch, image): different images get different crops, the same image the same one at any world size.
    train_loader = make_loader(*train_split, args.batch_size, train=True, seed=args.seed, augment=True,
                               pad=crop_padding(train_split[0].image_size), global_batch=global_batch)
    eval_loader = make_loader(*take_prefix(data["test"], args.eval_subset, "--eval-subset"), args.batch_size,
                              train=False)

    set_seed(args.seed)  # PITFALL (different init per rank): same seed, same weights (and DDP broadcasts rank 0's)
    model = named_model("resnet18", len(data["classes"]))  # torchvision's ResNet-18 with a CIFAR stem
    # weight decay 5e-4 on the weights, none on biases and BatchNorm tensors (utils/optim.py, as train_cifar.py)
    optimizer = torch.optim.SGD(parameter_groups(model, lr, 5e-4), lr=lr, momentum=0.9, nesterov=True, fused=True)
    # PITFALL (BN without SyncBN): DDP copies rank 0's BatchNorm statistics at the first forward after a training one
    # (broadcast_buffers), so every rank evaluates and saves the same ones; SyncBatchNorm would also pool batch
    # statistics (CUDA only).
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    assert world == 1 or isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)  # grads averaged
    transform = BatchTransform(accelerator.device, channels_last=False, pad=crop_padding(train_split[0].image_size),
                               mean=data["mean"], std=data["std"])  # the batch's crops + flips, then normalise
    steps_per_epoch = len(train_loader) // args.grad_accum
    # Stepped once per optimizer step, by us: a prepared scheduler would step world-size times per optimizer step.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer,
                                                  warmup_cosine(steps_per_epoch, args.epochs * steps_per_epoch))
    accelerator.register_for_checkpointing(scheduler)  # saved and restored with the model and optimizer

    start_epoch = 0
    if done:  # --resume
        accelerator.load_state(done[-1])  # model, optimizer, scheduler, every rank's RNG
        start_epoch = accelerator.project_configuration.iteration = int(done[-1].name.split("_")[1]) + 1
        accelerator.print(f"resumed from {done[-1]}: epoch {start_epoch + 1}")
    config = {**vars(args), "model": "resnet18", "world_size": world, "global_batch": global_batch, "effective_lr": lr}
    project = os.environ.get("WANDB_PROJECT", "cifar10-accelerate")
    accelerator.init_trackers(project, config, init_kwargs={"wandb": {"dir": str(out)}})  # W&B files
    if accelerator.is_main_process:
        write_config_file(vars(args), out)  # the flags: --config RUN/config.yaml --output-dir NEW repeats the run

    train_seconds, images_seen, top1, examples, train_loss = 0.0, 0, 0.0, 0, float("nan")
    for epoch in range(start_epoch, args.epochs):
        model.train()
        train_loader.set_epoch(epoch)  # PITFALL (no set_epoch): a new shuffle each epoch
        loss_sum, batches, started = torch.zeros((), device=accelerator.device), 0, time.time()
        for images, labels, draws in train_loader:
            with accelerator.accumulate(model):  # PITFALL (all-reduce at every micro-step): only at the last one
                loss = F.cross_entropy(model(transform(images, draws.flip_crop)), labels)
                accelerator.backward(loss)  # scales by 1/grad_accum; DDP averages the gradients over ranks
                optimizer.step()  # a no-op on non-final micro-steps
                optimizer.zero_grad(set_to_none=True)
            if accelerator.sync_gradients and not optimizer.step_was_skipped:  # fp16 overflow: no step, no schedule
                scheduler.step()
            loss_sum += loss.detach()  # summed on the device: no host sync per step
            batches += 1
        train_loss = accelerator.reduce(loss_sum / batches, reduction="mean").item()  # the mean over all ranks
        seconds, images = time.time() - started, batches * args.batch_size * world
        train_seconds, images_seen = train_seconds + seconds, images_seen + images
        examples, top1 = evaluate(model, eval_loader, transform, accelerator)
        accelerator.print(f"epoch {epoch + 1}/{args.epochs}  train_loss {train_loss:.4f}  eval_top1 {top1:.2f}%")
        accelerator.log({"train/epoch_loss": train_loss, "train/lr": scheduler.get_last_lr()[0], "eval/top1": top1,
                         "train/epoch_images_per_sec": images / seconds, "epoch": epoch + 1},
                        step=(epoch + 1) * steps_per_epoch)  # the keys train_cifar.py uses: compare_runs.py reads both
        # PITFALL (saving from every rank): save_state writes the shared state from the main process, each rank's RNG
        accelerator.save_state()  # from that rank

    if start_epoch >= args.epochs:  # resumed a finished run (a requeued job): nothing to train, evaluate once
        examples, top1 = evaluate(model, eval_loader, transform, accelerator)
    # Outputs, written once. PITFALL ('module.' prefix): weights of the unwrapped model, loadable into a plain one.
    summary = {"world_size": world, "global_batch": global_batch, "effective_lr": lr, "epochs_completed": args.epochs,
               "train_loss": train_loss, "eval_examples": examples, "eval_top1": top1,
               "train_images_per_sec": images_seen / max(train_seconds, 1e-9), "config": config}
    accelerator.save_model(model, out, safe_serialization=True)  # main process only: model.safetensors
    if accelerator.is_main_process:  # PITFALL (saving from every rank): one writer
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    sys.exit(run(lambda: main(parse_config())))  # bad input: one line and exit status 2
