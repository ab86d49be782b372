"""Train ResNet-18 on CIFAR-10 with HuggingFace Accelerate: one laptop CPU to many GPU nodes, same file.

    python train_cifar.py --data-dir ../shared/data/cifar10                              # 1 process
    accelerate launch --config_file accelerate_configs/cpu.yaml  train_cifar.py          # 2 gloo ranks, 1 CPU box
    accelerate launch --config_file accelerate_configs/1gpu.yaml train_cifar.py          # 1 GPU
    accelerate launch --config_file accelerate_configs/1gpu.yaml train_cifar.py --recipe fast  # 1 GPU, ResNet-9 (RECIPES)
    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 train_cifar.py  # 8 GPUs, DDP
    accelerate launch --config_file accelerate_configs/fsdp_4gpu.yaml train_cifar.py     # 4 GPUs, FSDP2 (fsdp_cpu.yaml: CPU)
    # 2 nodes x 8 GPUs: run on each node, with --machine_rank 0 on the head and 1 on the other:
    accelerate launch --multi_gpu --num_machines 2 --num_processes 16 --machine_rank 0 \
        --main_process_ip HEAD_IP --main_process_port 29500 train_cifar.py

The launcher (YAML or flags) decides processes, machines and mixed precision; this script never
overrides them. Everything else is in `Config` below: each field is a flag (`lr` -> `--lr`), printed at
start, sent to the tracker and written to summary.json. Read top to bottom: config, model, data,
schedule, evaluation, training loop.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import netrc
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import typing
from dataclasses import asdict, dataclass, field, fields
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState
from accelerate.utils import (
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    InitProcessGroupKwargs,
    set_seed,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm

from utils import UserError, process_count_problem
from utils import checkpoint as ckpt
from utils.data import CLASSES, BatchTransform, load_cifar10, make_loader
from utils.guard import lock_output_dir
from utils.launch import run

REFERENCE_BATCH = 128  # --scale-lr: lr is given for this global batch and scaled linearly from it
HEALTH_CHECK_EVERY = 10  # optimizer steps between the (collective) checks for preemption signals and NaN loss


def opt(default, help: str, choices: tuple | None = None):
    """A Config field with its help text (and allowed values) for the generated command line."""
    return field(default=default, metadata={"help": help, "choices": choices})


# ====================================================================================================
# Config: every hyperparameter and path, in one place
# ====================================================================================================
@dataclass
class Config:
    recipe: str | None = opt(None, "preset defaults for one GPU: fast (ResNet-9, ~94%) or resnet18 (95%+); see RECIPES; flags still win",
                             ("fast", "resnet18"))
    # --- data ---
    data_dir: str | None = opt(None, "folder with train-*.parquet / test-*.parquet (Hub layout); unset: download uoft-cs/cifar10")
    cache_dir: str | None = opt(None, "decoded-tensor cache; unset: <data-dir>/.decoded if writable, else ~/.cache/accelerate-cifar")
    train_subset: int | None = opt(None, "train on the first N training images only")
    eval_subset: int | None = opt(None, "evaluate on the first N test images only")
    augment: str = opt("standard", "standard: random crop (4 px zero padding) + horizontal flip; none", ("standard", "none"))
    data_on_device: bool = opt(False, "keep both splits on the GPU (uint8, 180 MB): no host-to-device copy per batch")
    output_dir: str = opt("runs/cifar10", "summary.json, model.safetensors and tracker files go here")
    # --- model ---
    model: str = opt("resnet18", "resnet18: CIFAR stem (3x3 stride-1 conv, no max-pool); resnet18_imagenet: torchvision's as-is; "
                     "resnet9: Myrtle.ai's fast CIFAR net", ("resnet18", "resnet18_imagenet", "resnet9"))
    channels_last: bool = opt(True, "NHWC memory format: faster convolutions with bf16 on GPUs and CPUs; --no-channels-last: NCHW")
    compile: bool = opt(False, "torch.compile the model (through Accelerate's dynamo backend 'inductor')")
    sync_bn: bool = opt(False, "convert BatchNorm to SyncBatchNorm (CUDA only): batch statistics over all ranks")
    # --- optimisation ---
    epochs: int = opt(30, "passes over the training set")
    batch_size: int = opt(128, "images per process per micro-step; global batch = batch_size x processes x grad_accum")
    global_batch_size: int | None = opt(None, "fix the global batch instead: batch_size = this / (processes x grad_accum), exactly")
    lr: float = opt(0.1, "peak learning rate, reached after warmup")
    scale_lr: bool = opt(False, f"linear scaling rule: lr x global_batch / {REFERENCE_BATCH}")
    optimizer: str = opt("sgd", "sgd (momentum 0.9, Nesterov) or adamw", ("sgd", "adamw"))
    weight_decay: float = opt(5e-4, "L2 penalty (SGD) / decoupled weight decay (AdamW), on all parameters")
    label_smoothing: float = opt(0.0, "cross-entropy label smoothing, in [0, 1)")
    tta_flip: bool = opt(False, "evaluate each test image and its mirror image (mean of the two logits)")
    warmup_epochs: float = opt(1.0, "linear warmup from 0 to lr, then cosine decay to 0")
    grad_accum: int = opt(1, "micro-steps per optimizer step (no gradient all-reduce on the others)")
    grad_clip: float = opt(5.0, "clip the global gradient norm to this; 0: no clipping")
    bf16_grad_sync: bool = opt(True, "DDP under bf16 mixed precision: all-reduce gradients in bf16 (half the bytes); "
                               "--no-bf16-grad-sync: in fp32")
    max_steps: int | None = opt(None, "stop after this many optimizer steps (the schedule is planned for them)")
    seed: int = opt(0, "seeds the weights (same on every rank), data order and augmentation")
    deterministic: bool = opt(False, "deterministic kernels; on CPU also 1 thread, so 1 process matches N launched processes bitwise")
    # --- checkpoints ---
    resume: str | None = opt(None, "auto: continue from the newest sound checkpoint in <output-dir>/checkpoints (fresh if none); or a checkpoint folder")
    checkpoint_every_steps: int | None = opt(None, "also checkpoint every N optimizer steps (always at the end of each epoch)")
    keep_last: int = opt(2, "checkpoints kept, besides the best one")
    overwrite: bool = opt(False, "start fresh in an output dir holding an earlier run's checkpoints, deleting them")
    dist_timeout: int = opt(600, "seconds a collective waits for a missing process before the job fails")
    # --- logging ---
    tracker: str = opt("wandb" if importlib.util.find_spec("wandb") else "none",
                       "wandb (the default when installed; offline by itself without credentials), tensorboard (<output-dir>/<project>/) or none",
                       ("wandb", "tensorboard", "none"))
    wandb_project: str | None = opt(None, "W&B project (TensorBoard: the folder name); unset: $WANDB_PROJECT, else cifar10-accelerate")
    run_name: str | None = opt(None, "W&B run name; unset: $WANDB_NAME, else W&B picks one")
    group: str | None = opt(None, "W&B group, e.g. one per setting run with several seeds (compare_runs.py --by-group)")
    tags: str | None = opt(None, "comma-separated W&B tags (or $WANDB_TAGS)")
    log_every: int = opt(50, "optimizer steps between train/loss, train/lr and train/images_per_sec logs")

    def validate(self) -> None:
        positive = ["epochs", "batch_size", "global_batch_size", "lr", "grad_accum", "log_every", "train_subset",
                    "eval_subset", "max_steps", "checkpoint_every_steps", "keep_last", "dist_timeout"]
        for name in positive:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive (got {value:g}).")
        for name in ["weight_decay", "warmup_epochs", "grad_clip"]:
            if getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must not be negative (got {getattr(self, name)}).")
        if not 0 <= self.label_smoothing < 1:
            raise UserError(f"--label-smoothing must be in [0, 1) (got {self.label_smoothing}).")


# --recipe NAME: presets for one GPU (global batch = batch_size; more GPUs: add --global-batch-size). They set
# defaults only: flags given on the command line still win. Not tuned on a GPU yet (none was available).
RECIPES = {
    # Myrtle.ai's ResNet-9 schedule (lr 0.4 and weight decay 5e-4 per mean loss, batch 512), shortened by label
    # smoothing and test-time flip; the whole dataset on the GPU, augmented a batch at a time; bf16 from the YAML.
    "fast": dict(model="resnet9", epochs=18, batch_size=512, lr=0.4, weight_decay=5e-4, label_smoothing=0.2,
                 warmup_epochs=4, grad_clip=0.0, tta_flip=True, channels_last=True, compile=True, data_on_device=True),
    # ResNet-18 (CIFAR stem) to 95%+: a standard cosine schedule with label smoothing and test-time flip.
    "resnet18": dict(model="resnet18", epochs=60, batch_size=256, lr=0.2, weight_decay=5e-4, label_smoothing=0.1,
                     warmup_epochs=2, tta_flip=True, channels_last=True, compile=True, data_on_device=True),
}


def parse_config(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    hints = typing.get_type_hints(Config)
    for f in fields(Config):
        flag, kind = "--" + f.name.replace("_", "-"), hints[f.name]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            kind = next(t for t in typing.get_args(kind) or (kind,) if t is not type(None))  # X | None -> X
            parser.add_argument(flag, type=kind, default=f.default, choices=f.metadata["choices"],
                                help=f.metadata["help"].replace("%", "%%") + " (default: %(default)s)")
    first = argparse.ArgumentParser(add_help=False)  # the recipe's defaults must be in place before --help
    first.add_argument("--recipe", choices=sorted(RECIPES))
    recipe = first.parse_known_args(argv)[0].recipe
    if recipe:
        parser.set_defaults(**RECIPES[recipe])
    cfg = Config(**vars(parser.parse_args(argv)))
    cfg.validate()
    return cfg


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint, restored on resume."""
    epoch: int = 0  # current epoch, from 0
    batches_in_epoch: int = 0  # micro-batches each process has taken from the current epoch
    global_step: int = 0  # optimizer steps done
    images_seen: int = 0  # training images, all processes
    train_seconds: float = 0.0  # training time without evaluation
    best_top1: float = 0.0
    best_checkpoint: str | None = None  # kept by the rotation
    tracker_run_id: str | None = None  # the W&B run a resumed job continues


# ====================================================================================================
# Model and optimizer
# ====================================================================================================
class Residual(nn.Sequential):
    def forward(self, x):
        return x + super().forward(x)


def conv_bn(c_in: int, c_out: int, pool: bool = False) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), *([nn.MaxPool2d(2)] if pool else []), nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True)]


def resnet9(num_classes: int) -> nn.Module:
    """The 'ResNet-9' of Myrtle.ai's DAWNBench CIFAR-10 record (6.5M parameters): 3 pooled stages of 3x3 convs,
    two with a residual pair, max-pooled to a scaled linear classifier; far fewer FLOPs than ResNet-18."""
    return nn.Sequential(*conv_bn(3, 64), *conv_bn(64, 128, pool=True), Residual(*conv_bn(128, 128), *conv_bn(128, 128)),
                         *conv_bn(128, 256, pool=True), *conv_bn(256, 512, pool=True),
                         Residual(*conv_bn(512, 512), *conv_bn(512, 512)), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
                         nn.Linear(512, num_classes, bias=False), Scale(0.125))


class Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def build_model(name: str, num_classes: int = len(CLASSES), sync_bn: bool = False) -> nn.Module:
    """torchvision's ResNet-18; 'resnet18' swaps the ImageNet stem (7x7 stride-2 conv + max-pool, which
    shrinks 32x32 inputs to 8x8 before the first block) for a 3x3 stride-1 conv; or 'resnet9' (below).
    sync_bn turns every BatchNorm into a SyncBatchNorm (statistics over all ranks' batches; CUDA only)."""
    model = resnet9(num_classes) if name == "resnet9" else torchvision.models.resnet18(num_classes=num_classes)
    if name == "resnet18":
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision does
        model.maxpool = nn.Identity()
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync_bn else model


def build_optimizer(cfg: Config, model: nn.Module, lr: float, fused: bool = True) -> torch.optim.Optimizer:
    # fused: one kernel for the whole update, on CPU and CUDA (torch's default is a per-tensor loop on CPU,
    # foreach on GPUs). ResNet-18 on 1 CPU thread: SGD 24 ms per step (loop) / 10.8 (foreach) / 3.5 (fused),
    # AdamW 35 (foreach) / 5.3 (fused). Under FSDP2, foreach: DTensor has no sharding rule for aten._fused_sgd_.
    kernel = {"fused": True} if fused else {"foreach": True}
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=cfg.weight_decay, **kernel)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay, **kernel)


def warmup_cosine(warmup_steps: int, total_steps: int):
    """LR multiplier at optimizer step k: linear 0 -> 1 over warmup_steps, then cosine 1 -> 0 at total_steps."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


# ====================================================================================================
# Evaluation: every rank evaluates its shard; gather_for_metrics drops the padding Accelerate adds
# to make shards even, so each test image counts exactly once
# ====================================================================================================
@torch.no_grad()
def share_bn_statistics(accelerator: Accelerator, model) -> None:
    """Copies rank 0's BatchNorm running statistics to every rank under FSDP. They drift apart (each rank
    normalises its own batches); DDP (broadcast_buffers=True) copies rank 0's at every forward, FSDP never
    does. Done by hand before each evaluation and checkpoint (no library call does it), so FSDP evaluates and
    saves exactly the statistics DDP would."""
    if accelerator.distributed_type == DistributedType.FSDP:
        for buffer in model.buffers():
            torch.distributed.broadcast(buffer, src=0)


@torch.no_grad()
def evaluate(model, loader, transform: BatchTransform, accelerator: Accelerator, tta_flip: bool = False) -> dict:
    # Every rank evaluates with rank 0's BatchNorm statistics, the exported ones: DDP copied them at the
    # first forward (broadcast_buffers=True); FSDP needs the copy.
    share_bn_statistics(accelerator, model)
    model.eval()
    dev = accelerator.device
    loss_sum, top1, top5 = (torch.zeros((), device=dev, dtype=torch.float64) for _ in range(3))
    confusion = torch.zeros(len(CLASSES) * len(CLASSES), device=dev, dtype=torch.long)  # row: true class, column: predicted
    for images, labels in loader:
        inputs = transform(images, train=False)
        logits = (model(inputs) + model(inputs.flip(3))) / 2 if tta_flip else model(inputs)
        logits, labels = accelerator.gather_for_metrics((logits.float(), labels))
        loss_sum += F.cross_entropy(logits, labels, reduction="sum")
        best5 = logits.topk(5, dim=1).indices
        hit = best5[:, 0] == labels
        top1 += hit.sum()
        top5 += (best5 == labels[:, None]).any(dim=1).sum()
        confusion += torch.bincount(labels * len(CLASSES) + best5[:, 0], minlength=len(CLASSES) ** 2)
    confusion = confusion.view(len(CLASSES), len(CLASSES))
    n = int(confusion.sum())
    per_class = (100.0 * confusion.diagonal() / confusion.sum(1).clamp(min=1)).tolist()
    return {"loss": loss_sum.item() / n, "top1": 100.0 * top1.item() / n, "top5": 100.0 * top5.item() / n,
            "examples": n, "class_top1": dict(zip(CLASSES, per_class)), "confusion": confusion.tolist()}


# ====================================================================================================
# Helpers for the run's surroundings
# ====================================================================================================
def check_output_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise UserError(f"--output-dir {path} cannot be written ({e.strerror or e}).") from None


def wandb_offline_without_credentials() -> None:
    """W&B would stop and ask for a key; with none configured, log offline instead (`wandb sync` later)."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        if netrc.netrc().authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    os.environ["WANDB_MODE"] = "offline"
    print("wandb: no credentials found; logging offline (upload later with `wandb sync`)", file=sys.stderr)


def fsdp_plugin_from_launcher() -> FullyShardedDataParallelPlugin | None:
    """The launcher's FSDP settings (its FSDP_* variables), None without FSDP. FSDP2 only: its checkpoints and
    full-weight export are what the tests prove. One change to Accelerate's default: parameters stay fp32 in
    FSDP and `--mixed_precision bf16` is autocast (as under DDP). FSDP's own bf16 policy casts BatchNorm's
    weights to bf16 while its running statistics stay fp32, a mix BatchNorm refuses (on CPU and CUDA alike);
    the price is fp32 all-gathers, nothing for a ResNet whose activations dominate the traffic."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    if os.environ.get("FSDP_VERSION", "1") != "2":
        raise UserError("the launch config asks for FSDP version 1; this script runs FSDP2: set fsdp_version: 2 "
                        "(see accelerate_configs/fsdp_4gpu.yaml).")
    return FullyShardedDataParallelPlugin(mixed_precision_policy=MixedPrecisionPolicy())


def shard_on_cpu_too(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """Runs FSDP2 for real when an FSDP config is launched on CPU (gloo), where Accelerate would fall back
    to DDP silently: it builds MULTI_CPU whenever cpu=True and ignores the FSDP plugin, yet its FSDP2 code
    (fully_shard in prepare, sharded save_state/load_state, full get_state_dict) works on CPU. So set
    distributed_type FSDP and the plugin in Accelerate's shared state, in both PartialState and
    AcceleratorState (they keep separate copies; setting one alone is undone before save_state). This
    touches Accelerate internals: tested with the Accelerate range pinned in requirements.txt, and the
    wrapper is asserted after prepare(). On GPUs Accelerate does all of it itself; this does nothing."""
    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def git_commit() -> str | None:
    """The commit of this script's checkout, '+dirty' with uncommitted changes; None outside git."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=30)
    try:
        head, changes = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if changes.stdout.strip() else "") if head.returncode == 0 else None


def note_wandb_folder(run_folder: Path, output_dir: Path) -> None:
    """A W&B run folder outside the output folder ($WANDB_DIR) is listed in <output-dir>/wandb_runs.txt, one line
    per life of the run, so compare_runs.py finds it from the output folder."""
    if output_dir.resolve() not in run_folder.resolve().parents:
        with open(output_dir / "wandb_runs.txt", "a") as f:
            f.write(f"{run_folder.resolve()}\n")


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak: memory allocated by tensors on a GPU, else the resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024) / 2**30


def wandb_confusion_matrix(confusion: list[list[int]], wanted: bool) -> dict:
    """{"eval/confusion_matrix": W&B's confusion-matrix plot} from counts (rows: true class), or {}."""
    if not wanted:
        return {}
    import wandb

    pairs = [(true, pred) for true, row in enumerate(confusion) for pred, count in enumerate(row) for _ in range(count)]
    return {"eval/confusion_matrix": wandb.plot.confusion_matrix(
        y_true=[t for t, _ in pairs], preds=[q for _, q in pairs], class_names=list(CLASSES))}


def check_distributed_setup(accelerator: Accelerator, cfg: Config, fsdp_asked: bool) -> int:
    """Stops on the misconfigurations that otherwise train silently with the wrong setup; returns the
    per-process batch size."""
    world = accelerator.num_processes
    problem = process_count_problem(world)
    if problem:
        raise UserError(f"{problem} ({accelerator.distributed_type.value}).")
    if fsdp_asked and accelerator.distributed_type != DistributedType.FSDP:
        raise UserError(f"the launch config asks for FSDP but Accelerate set up {accelerator.distributed_type.value}.")
    if cfg.global_batch_size is None:
        return cfg.batch_size
    per_process, rest = divmod(cfg.global_batch_size, world * cfg.grad_accum)
    if rest or per_process == 0:
        raise UserError(f"--global-batch-size {cfg.global_batch_size} does not divide into {world} processes x "
                        f"{cfg.grad_accum} accumulation steps.")
    return per_process


def find_resume_point(cfg: Config, root: Path, accelerator: Accelerator) -> Path | None:
    """The checkpoint to continue from, None to start fresh; refuses to start over another run's checkpoints."""
    if cfg.resume is None:
        earlier = ckpt.finished(root)
        if earlier and not cfg.overwrite:
            theirs = ckpt.read_state(earlier[-1]).get("config", {})
            differ = [k for k, v in asdict(cfg).items() if k not in ("resume", "overwrite") and theirs.get(k, v) != v]
            raise UserError(f"{cfg.output_dir} holds checkpoints of an earlier run"
                            f"{' with another config (' + ', '.join(differ) + ')' if differ else ''}; pass --resume auto "
                            f"to continue it, --overwrite to start over, or another --output-dir.")
        return None
    if cfg.resume == "auto":
        return ckpt.newest_sound(root, warn=lambda m: accelerator.print(f"warning: {m}"))
    path = Path(cfg.resume)
    if not path.is_dir():
        raise UserError(f"--resume {path} does not exist (or is not a folder).")
    why = ckpt.problem(path)
    if why is not None:
        raise UserError(f"--resume {path} is not a usable checkpoint: {why}.")
    theirs = ckpt.read_state(path)["config"]["model"]
    if theirs != cfg.model:
        raise UserError(f"--resume {path} holds weights of --model {theirs}; this run builds --model {cfg.model}.")
    return path


def export_weights(accelerator: Accelerator, model, path: Path) -> None:
    """Full, unwrapped weights (no 'module.' or '_orig_mod.' prefix) as safetensors, written by the main process
    (atomically; a failed write stops every rank with one line naming the last good checkpoint)."""
    state = accelerator.get_state_dict(accelerator.unwrap_model(model, keep_torch_compile=False))
    ckpt.write_weights(accelerator, state, path, root=path.parent / "checkpoints")


def take_prefix(pair, n: int | None, flag: str):
    images, labels = pair
    if n is not None and n > len(labels):
        raise UserError(f"{flag} {n} is larger than the split ({len(labels)} images).")
    return (images[:n], labels[:n]) if n is not None else pair


# ====================================================================================================
# Training
# ====================================================================================================
def main(cfg: Config) -> dict:
    started = time.time()
    check_output_dir(cfg.output_dir)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for reproducible GEMMs
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        if not torch.cuda.is_available():  # kernels (and their rounding) depend on the thread count;
            torch.set_num_threads(1)       # launched processes get OMP_NUM_THREADS=1
    if cfg.tracker == "wandb":
        wandb_offline_without_credentials()
    fsdp = fsdp_plugin_from_launcher()
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # without it, N launched CPU processes each train alone (no gloo group)
        gradient_accumulation_steps=cfg.grad_accum,
        log_with=None if cfg.tracker == "none" else cfg.tracker,
        project_dir=cfg.output_dir,
        dynamo_backend="inductor" if cfg.compile else None,  # None: whatever the launcher configured
        # Seedable sampler: the shuffle depends on the seed and epoch only, not on the world size.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.dist_timeout))],  # a dead peer fails the job
        fsdp_plugin=fsdp,
    )  # no mixed_precision argument on purpose: the launcher's choice must win
    if fsdp is not None:
        shard_on_cpu_too(accelerator, fsdp)
    world = accelerator.num_processes
    batch_size = check_distributed_setup(accelerator, cfg, fsdp_asked=fsdp is not None)
    if cfg.sync_bn and accelerator.device.type != "cuda":
        raise UserError("--sync-bn needs CUDA GPUs: torch's SyncBatchNorm does not run on CPU.")
    _lock = lock_output_dir(accelerator, cfg.output_dir)  # one job per output folder, until main() returns
    root = Path(cfg.output_dir) / "checkpoints"
    resume_from = find_resume_point(cfg, root, accelerator)
    global_batch = batch_size * world * cfg.grad_accum
    lr = cfg.lr * global_batch / REFERENCE_BATCH if cfg.scale_lr else cfg.lr
    accelerator.print(f"config: {json.dumps(asdict(cfg))}")
    accelerator.print(f"{world} process(es), {accelerator.distributed_type.value}, mixed precision "
                      f"{accelerator.mixed_precision}, device {accelerator.device}; global batch {global_batch}, lr {lr:g}")

    # --- data: whole splits as uint8 tensors; Accelerate shards, shuffles per epoch and moves to device ---
    data = load_cifar10(cfg.data_dir, cfg.cache_dir, accelerator)
    train_images, train_labels = take_prefix(data["train"], cfg.train_subset, "--train-subset")
    eval_images, eval_labels = take_prefix(data["test"], cfg.eval_subset, "--eval-subset")
    if len(train_labels) < global_batch // cfg.grad_accum:
        raise UserError(f"{len(train_labels)} training images do not fill one batch of {batch_size} "
                        f"on each of {world} processes.")
    if cfg.data_on_device:  # GPU-resident: Accelerate's move to the device becomes a no-op
        train_images, train_labels, eval_images, eval_labels = (
            t.to(accelerator.device) for t in (train_images, train_labels, eval_images, eval_labels))
    train_loader = make_loader(train_images, train_labels, batch_size, train=True)
    eval_loader = make_loader(eval_images, eval_labels, batch_size, train=False)

    # --- model: same seed on every rank -> same initial weights (DDP also broadcasts rank 0's) ---
    set_seed(cfg.seed)
    model = build_model(cfg.model, sync_bn=cfg.sync_bn)  # converted before prepare(), as DDP requires
    sharded = accelerator.distributed_type == DistributedType.FSDP
    channels_last = cfg.channels_last and not sharded  # FSDP2 shards contiguous parameters only: NCHW under FSDP
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(cfg, model, lr, fused=not sharded)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    if accelerator.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        ddp = getattr(model, "_orig_mod", model)  # under --compile, Accelerate compiles the DDP wrapper
        assert isinstance(ddp, nn.parallel.DistributedDataParallel), type(ddp)  # gradients really are averaged
        if cfg.bf16_grad_sync and accelerator.mixed_precision == "bf16":  # PyTorch's bf16_compress_hook, via Accelerate
            DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BF16).register_comm_hook(ddp)
    if sharded:
        assert isinstance(accelerator.unwrap_model(model, keep_torch_compile=False), FSDPModule), type(model)  # sharded
    params_here = sum((q.to_local() if isinstance(q, DTensor) else q).numel() for q in model.parameters())  # a shard under FSDP
    # Augmentation stream differs per rank (different images must get different crops), fixed by the seed.
    transform = BatchTransform(accelerator.device, cfg.seed * 1000 + accelerator.process_index,
                               augment=cfg.augment == "standard", channels_last=channels_last)

    # --- schedule, counted in optimizer steps. Not passed to prepare(): Accelerate's prepared scheduler
    # steps num_processes times per optimizer step, which would end the schedule world-size times early.
    steps_per_epoch = math.ceil(len(train_loader) / cfg.grad_accum)
    total_steps = cfg.epochs * steps_per_epoch if cfg.max_steps is None else min(cfg.max_steps, cfg.epochs * steps_per_epoch)
    warmup_steps = min(round(cfg.warmup_epochs * steps_per_epoch), total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, warmup_cosine(warmup_steps, total_steps))

    # --- resume: weights, optimizer, RNG of every rank (Accelerate), schedule, augmentation stream, counters ---
    p = Progress()
    if resume_from is not None:
        saved, rank_state = ckpt.load(accelerator, resume_from)
        p = Progress(**saved["progress"])
        changed = [k for k, v in asdict(cfg).items() if k not in ("resume", "overwrite") and saved["config"].get(k) != v]
        if changed:
            accelerator.print(f"warning: resuming with a changed config: {', '.join(changed)}")
        scheduler.load_state_dict(saved["scheduler"])
        transform.load_state_dict(rank_state)
        accelerator.print(f"resumed from {resume_from}: epoch {p.epoch + 1}, batch {p.batches_in_epoch} of "
                          f"{len(train_loader)}, step {p.global_step}")
    elif cfg.overwrite and accelerator.is_main_process:
        shutil.rmtree(root, ignore_errors=True)
    accelerator.wait_for_everyone()

    run_info = {"world_size": world, "distributed_type": accelerator.distributed_type.value,
                "mixed_precision": accelerator.mixed_precision, "channels_last": channels_last, "batch_size_per_process": batch_size,
                "global_batch": global_batch, "effective_lr": lr,
                "versions": {"torch": torch.__version__, "torchvision": torchvision.__version__,
                             "accelerate": sys.modules["accelerate"].__version__, "python": sys.version.split()[0]},
                "git_commit": git_commit()}
    tracked = {**asdict(cfg), **run_info}
    if cfg.tracker == "tensorboard":  # its hparams take numbers, strings and booleans only
        tracked = {k: v if isinstance(v, int | float | str | bool) else json.dumps(v) for k, v in tracked.items()}
    wandb_args = {"dir": os.environ.get("WANDB_DIR") or cfg.output_dir,  # scratch space on clusters, if set
                  "name": cfg.run_name, "group": cfg.group,  # None: W&B's own default / WANDB_*
                  "tags": cfg.tags.split(",") if cfg.tags else None}
    same_run = {"id": p.tracker_run_id, "resume": "allow"} if p.tracker_run_id else {}
    accelerator.init_trackers(cfg.wandb_project or os.environ.get("WANDB_PROJECT", "cifar10-accelerate"), config=tracked,
                              init_kwargs={"wandb": {**{k: v for k, v in wandb_args.items() if v}, **same_run}})
    if cfg.tracker == "wandb" and accelerator.is_main_process:
        wandb_run = accelerator.get_tracker("wandb", unwrap=True)
        p.tracker_run_id = wandb_run.id
        note_wandb_folder(Path(wandb_run.dir).parent, Path(cfg.output_dir))
    # A run killed after its last checkpoint had already logged the steps it trains again now (to the same
    # values: resume is exact); log only past them, so the tracker's steps keep increasing.
    logged_file = Path(cfg.output_dir) / "tracker_logged_step.txt"
    already_logged = int(logged_file.read_text()) if resume_from is not None and logged_file.is_file() else 0

    def log(values: dict, step: int) -> None:
        if step > already_logged:
            accelerator.log(values, step=step)
            if accelerator.is_main_process:
                logged_file.write_text(str(step))

    # --- preemption (SLURM sends SIGTERM, or SIGUSR1 with --signal) and divergence: checked together, on all
    # ranks at the same steps, so every rank stops at the same step boundary ---
    signalled = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: signalled.append(signum))
    first_bad_step = torch.full((), -1, dtype=torch.long, device=accelerator.device)  # no sync per step
    last_checkpoint = resume_from

    def must_stop() -> bool:
        """Collective: True when any rank got a signal; stops the job if any rank saw a non-finite loss."""
        both = accelerator.gather(torch.stack([first_bad_step, torch.tensor(len(signalled), device=accelerator.device)]))
        bad = both.view(-1, 2)[:, 0]
        if (bad >= 0).any():
            raise UserError(f"the loss is not finite (nan or inf) at optimizer step {bad[bad >= 0].min().item()}; "
                            f"stopped. Last good checkpoint: {last_checkpoint or 'none'}.")
        return bool(both.view(-1, 2)[:, 1].any())

    def save_checkpoint() -> Path:
        share_bn_statistics(accelerator, model)  # FSDP would save one arbitrary rank's
        folder = ckpt.save(accelerator, root, p.global_step,
                           {"progress": asdict(p), "config": asdict(cfg), "world_size": world,
                            "scheduler": scheduler.state_dict()},
                           transform.state_dict())
        if accelerator.is_main_process:
            ckpt.rotate(root, cfg.keep_last, keep={p.best_checkpoint})
        return folder

    metrics, train_loss = None, float("nan")
    while p.epoch < cfg.epochs and p.global_step < total_steps:
        model.train()
        epoch_number = p.epoch + 1
        train_loader.set_epoch(p.epoch)  # new shuffle each epoch, same on every rank
        batches = accelerator.skip_first_batches(train_loader, p.batches_in_epoch) if p.batches_in_epoch else train_loader
        bar = tqdm(total=len(train_loader), initial=p.batches_in_epoch, desc=f"epoch {epoch_number}/{cfg.epochs}",
                   leave=False, disable=None if accelerator.is_local_main_process else True)  # None: off when not a tty
        loss_sum = torch.zeros((), device=accelerator.device)  # summed on device: no sync per step
        window_sum, window_batches, epoch_batches, epoch_start = loss_sum.clone(), 0, 0, time.time()
        window_start = epoch_start
        for images, labels in batches:
            with accelerator.accumulate(model):  # skips the all-reduce on non-final micro-steps
                loss = F.cross_entropy(model(transform(images, train=True)), labels, label_smoothing=cfg.label_smoothing)
                accelerator.backward(loss)  # divides by grad_accum
                if accelerator.sync_gradients and cfg.grad_clip > 0:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optimizer.step()  # the prepared optimizer only steps on the final micro-step
                optimizer.zero_grad(set_to_none=True)
            first_bad_step = torch.where((first_bad_step < 0) & ~torch.isfinite(loss.detach()), p.global_step + 1, first_bad_step)
            loss_sum += loss.detach()
            window_sum += loss.detach()
            epoch_batches, window_batches, p.batches_in_epoch = epoch_batches + 1, window_batches + 1, p.batches_in_epoch + 1
            bar.update()
            if not accelerator.sync_gradients:
                continue
            if not optimizer.step_was_skipped:  # fp16 overflow steps leave the schedule where it was
                scheduler.step()
            p.global_step += 1
            if p.global_step % cfg.log_every == 0:
                window = accelerator.reduce(window_sum / window_batches, reduction="mean").item()  # syncs
                log({"train/loss": window, "train/lr": scheduler.get_last_lr()[0], "epoch": epoch_number,
                     "train/images_per_sec": window_batches * batch_size * world / (time.time() - window_start)}, step=p.global_step)
                window_start = time.time()
                bar.set_postfix(loss=f"{window:.3f}")
                window_sum.zero_()
                window_batches = 0
            if p.global_step >= total_steps:
                break
            periodic = cfg.checkpoint_every_steps and p.global_step % cfg.checkpoint_every_steps == 0
            if p.global_step % HEALTH_CHECK_EVERY == 0 or periodic:
                if must_stop():
                    p.images_seen += epoch_batches * batch_size * world
                    p.train_seconds += time.time() - epoch_start
                    folder = save_checkpoint()
                    accelerator.print(f"preempted (signal {signalled[0] if signalled else 'on another rank'}): saved "
                                      f"{folder}; continue with --resume auto")
                    accelerator.wait_for_everyone()
                    accelerator.end_training()  # see utils.launch.release_process_group() for what follows
                    return {"preempted": True, "checkpoint": str(folder)}
                if periodic and p.batches_in_epoch < len(train_loader):  # the epoch's own checkpoint follows
                    last_checkpoint = save_checkpoint()
        train_loss = accelerator.reduce(loss_sum / max(1, epoch_batches), reduction="mean").item()  # syncs
        epoch_seconds = time.time() - epoch_start
        bar.close()
        epoch_images = epoch_batches * batch_size * world
        p.images_seen, p.train_seconds = p.images_seen + epoch_images, p.train_seconds + epoch_seconds
        if p.batches_in_epoch == len(train_loader):
            p.epoch, p.batches_in_epoch = p.epoch + 1, 0

        must_stop()  # raises on a non-finite loss, before anything is saved
        metrics = evaluate(model, eval_loader, transform, accelerator, cfg.tta_flip)
        if metrics["top1"] > p.best_top1:
            p.best_top1, p.best_checkpoint = metrics["top1"], f"step-{p.global_step:08d}"
            export_weights(accelerator, model, Path(cfg.output_dir) / "best.safetensors")
        accelerator.print(f"epoch {epoch_number}/{cfg.epochs}  train_loss {train_loss:.4f}  eval_top1 {metrics['top1']:.2f}%  "
                          f"{epoch_images / epoch_seconds:,.0f} img/s  {epoch_seconds:.1f} s")
        log({"train/epoch_loss": train_loss, "train/epoch_images_per_sec": epoch_images / epoch_seconds,
             "train/epoch_seconds": epoch_seconds, "sys/peak_memory_gb": peak_memory_gb(accelerator.device),
             **{f"eval/{k}": v for k, v in metrics.items() if k not in ("class_top1", "confusion")},
             **{f"eval/top1_{c}": v for c, v in metrics["class_top1"].items()}, "epoch": epoch_number,
             **wandb_confusion_matrix(metrics["confusion"], cfg.tracker == "wandb" and accelerator.is_main_process)},
            step=p.global_step)
        last_checkpoint = save_checkpoint()

    # --- outputs: written once, by the main process; weights unwrapped (no 'module.' prefix) ---
    if metrics is None:  # resumed from a checkpoint of a finished run
        metrics = evaluate(model, eval_loader, transform, accelerator, cfg.tta_flip)
    export_weights(accelerator, model, Path(cfg.output_dir) / "model.safetensors")
    summary = {**run_info, "model": cfg.model, "wrapper": type(model).__name__,
               "parameters": sum(q.numel() for q in model.parameters()),  # DTensors count in full
               "parameters_on_main_process": params_here, "epochs_completed": p.epoch,
               "global_step": p.global_step, "train_images_seen": p.images_seen,
               "train_images_per_sec": p.images_seen / max(p.train_seconds, 1e-9), "train_loss": train_loss,
               "eval_examples": metrics["examples"], "eval_top1": metrics["top1"], "eval_top5": metrics["top5"],
               "eval_loss": metrics["loss"], "eval_class_top1": metrics["class_top1"], "eval_confusion": metrics["confusion"],
               "best_eval_top1": p.best_top1, "peak_memory_gb": peak_memory_gb(accelerator.device),
               "best_checkpoint": p.best_checkpoint, "last_checkpoint": str(last_checkpoint),
               "resumed_from": str(resume_from) if resume_from else None,
               "wall_seconds": time.time() - started, "config": asdict(cfg)}
    if accelerator.is_main_process:
        with open(os.path.join(cfg.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        if cfg.tracker == "wandb":
            accelerator.get_tracker("wandb", unwrap=True).summary.update(summary)  # the run's summary = summary.json
    accelerator.wait_for_everyone()
    accelerator.end_training()  # trackers, process group; utils.launch.run() frees the rest once main() returns
    return summary


if __name__ == "__main__":
    sys.exit(run(lambda: main(parse_config())))  # a UserError: one line, exit 2
