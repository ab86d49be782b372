"""Train ResNet-18 on CIFAR-10 with HuggingFace Accelerate: one laptop CPU to many GPU nodes, same file.

    python train_cifar.py --data-dir ../shared/data/cifar10                              # 1 process
    accelerate launch --config_file accelerate_configs/cpu.yaml  train_cifar.py          # 2 gloo ranks, 1 CPU box
    accelerate launch --config_file accelerate_configs/1gpu.yaml train_cifar.py          # 1 GPU
    accelerate launch --config_file accelerate_configs/1gpu.yaml train_cifar.py --recipe fast  # 1 GPU, ResNet-9
    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 train_cifar.py  # 8 GPUs, DDP
    accelerate launch --config_file accelerate_configs/fsdp_4gpu.yaml train_cifar.py     # 4 GPUs, FSDP2
    # the same optimizer steps on 8 GPUs and on 1 (accumulation 8 there); a checkpoint resumes on either:
    accelerate launch --multi_gpu --num_processes 8 train_cifar.py --batch-size 64 --global-batch-size 512
    python train_cifar.py --batch-size 64 --global-batch-size 512
    # 2 nodes x 8 GPUs: run on each node, with --machine_rank 0 on the head and 1 on the other:
    accelerate launch --multi_gpu --num_machines 2 --num_processes 16 --machine_rank 0 \
        --main_process_ip HEAD_IP --main_process_port 29500 train_cifar.py

The launcher (YAML or flags) decides processes, machines and mixed precision; this script never overrides them.
Everything else is in `Config` below: each field is a flag (`lr` -> `--lr`), printed at start, sent to the tracker
and written to summary.json (its data, evaluation, checkpoints, logging and hub groups: utils/config_groups.py,
shared with train_vit.py). Read top to bottom: config, recipes, optimizer, then main(): setup, data, model,
schedule, resume, the training loop, the end. The run's surroundings (tracking, checkpoints, preemption and
divergence, launcher quirks, the Hub) are small objects in utils/, each named where main() uses it.
Fine-tuning from trained weights (--init-from), metrics by name (--metric), sharing on the Hub: docs/hub.md.

Copy this file to start your own project. What a copy edits is here, below the Config: `build_model` (your
network), `load_data` (your images: a parquet folder, an image folder or a Hub dataset work as they are, through
`--data-dir` / `--dataset`), `build_optimizer` and `compute_loss`. main() and the tools (evaluate_checkpoint.py)
call them by name, so sharding, augmentation, exact resume, EMA, evaluation and export keep
working with nothing changed in utils/ (the contracts: docs/customizing.md).
Smaller starting point: train_minimal.py (the same training, under 200 lines, no surroundings).
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from tqdm.auto import tqdm

from utils import UserError
from utils.checkpoint import Checkpointer
from utils.cli import check_ranges, opt, parse
from utils.config_groups import CheckpointConfig, DataConfig, EvaluationConfig, HubConfig, LoggingConfig
from utils.data.builtin import load_builtin
from utils.data.contract import checked_data, data_facts
from utils.data.loaders import build_loaders
from utils.data.transform import BatchTransform
from utils.ema import WeightEMA
from utils.evaluation import Evaluator, evaluate, load_metrics
from utils.export import export_model
from utils.guard import MemoryGuard, StopGuard
from utils.hub import check_can_push, push_to_hub
from utils.launch import (
    check_world,
    check_wrapper,
    choose_fsdp_units,
    fsdp_plugin_from_launcher,
    make_deterministic,
    optimizer_kernel,
    print_setup,
    run,
    shard_on_cpu_too,
)
from utils.models import MODELS, check_logits, model_layers, named_model
from utils.optim import parameter_groups
from utils.output_dir import check_output_dir, lock_output_dir
from utils.plan import plan_batches, use_plan
from utils.pretrained import apply_preprocessing, freeze_backbone, is_pretrained
from utils.schedule import warmup_cosine
from utils.tracking import StepProfiler, Tracker, TrainMeter, peak_memory_gb, run_facts
from utils.weights import init_weights

REFERENCE_BATCH = 128  # --scale-lr: lr is given for this global batch and scaled linearly from it
HEALTH_CHECK_EVERY = 10  # optimizer steps between the (collective) checks for preemption signals and NaN loss


# ====================================================================================================
# Config: every hyperparameter and path, in one place
# ====================================================================================================
@dataclass
class Config(HubConfig, LoggingConfig, CheckpointConfig, EvaluationConfig, DataConfig):  # utils/config_groups.py
    # --- recipe: presets of the other flags ---
    recipe: str | None = opt(None, "preset defaults: fast (Myrtle.ai's ResNet-9 schedule) or resnet18, for one GPU; "
                             "finetune, for a pretrained --model (RECIPES, with their evidence); flags still win",
                             ("fast", "resnet18", "finetune"))
    # --- model: the network and how it runs ---
    model: str = opt("resnet18", "resnet18: CIFAR stem (3x3 stride-1 conv, no max-pool); resnet18_imagenet: "
                     "torchvision's as-is; resnet9: Myrtle.ai's fast CIFAR net; resnet8: He et al.'s CIFAR net at "
                     "78k parameters, for a first run on a laptop. Pretrained: a timm or transformers model folder "
                     "or Hub id (OWNER/NAME), its head replaced for the data's classes and its preprocessing taken "
                     "(docs/finetuning.md); timm:NAME, a timm architecture without weights")
    channels_last: bool = opt(True, "NHWC memory format: faster convolutions with bf16 on GPUs and CPUs; "
                              "--no-channels-last: NCHW")
    compile: bool = opt(False, "torch.compile the model (through Accelerate's dynamo backend 'inductor')")
    sync_bn: bool = opt(False, "convert BatchNorm to SyncBatchNorm (CUDA only): batch statistics over all ranks")
    # --- optimisation: batch, learning rate and its schedule, regularisation, reproducibility ---
    epochs: int = opt(30, "passes over the training set")
    batch_size: int = opt(128, "images per process per micro-step (the micro-batch); global batch = batch_size x "
                          "processes x accumulation")
    global_batch_size: int | None = opt(None, "fix the global batch, so any process count trains the same "
                                        "steps: accumulation = this / (batch_size x processes), exactly; unset: "
                                        "from grad_accum")
    lr: float = opt(0.1, "peak learning rate, reached after warmup")
    backbone_lr_factor: float = opt(1.0, "a pretrained --model's pretrained tensors train at lr x this, its new "
                                    "head at lr; 0: frozen, with their batch-norm statistics (a linear probe)")
    layer_decay: float | None = opt(None, "layer-wise lr decay: each tensor's lr x this^(its layers below the "
                                    "head's; utils/optim.py), e.g. 0.75 for fine-tuning; unset: off")
    drop_path: float = opt(0.0, "stochastic depth: the chance that a residual block's branch is dropped for an "
                           "image, rising linearly over the blocks to this (timm's and transformers' drop_path_rate; "
                           "the ready models by block), masks keyed by the micro-batch; e.g. 0.1; 0: off")
    scale_lr: bool = opt(False, f"linear scaling rule: lr x global_batch / {REFERENCE_BATCH}")
    optimizer: str = opt("sgd", "sgd (momentum 0.9, Nesterov) or adamw", ("sgd", "adamw"))
    weight_decay: float = opt(5e-4, "L2 penalty (SGD) / decoupled weight decay (AdamW), on the parameters "
                              "build_optimizer gives it (summary.json records each group's)")
    decay_exemptions: bool = opt(True, "no weight decay on biases, norms, tokens and position embeddings (timm's and "
                                 "DeiT's rule, utils/optim.py); --no-decay-exemptions: every parameter decays")
    label_smoothing: float = opt(0.0, "cross-entropy label smoothing, in [0, 1)")
    tta_flip: bool = opt(False, "evaluate each test image and its mirror image (mean of the two logits)")
    warmup_epochs: float = opt(1.0, "linear warmup from 0 to lr, then cosine decay to 0")
    grad_accum: int | None = opt(None, "micro-steps per optimizer step (no gradient all-reduce on the others); "
                                 "unset: 1, or from --global-batch-size")
    grad_clip: float = opt(5.0, "clip the global gradient norm to this; 0: no clipping")
    bf16_grad_sync: bool = opt(True, "DDP under bf16 mixed precision: all-reduce gradients in bf16 (half the "
                               "bytes); --no-bf16-grad-sync: in fp32")
    max_steps: int | None = opt(None, "stop after this many optimizer steps (the schedule is planned for them)")
    seed: int = opt(0, "seeds the weights (same on every rank), data order and augmentation (by sample: the same at "
                    "any process count)")
    deterministic: bool = opt(False, "deterministic kernels; on CPU also 1 thread, so 1 process matches N launched "
                              "processes bitwise")

    def validate(self) -> None:  # this script's fields; then each inherited group checks its own
        check_ranges(self, non_negative=["weight_decay", "warmup_epochs", "grad_clip", "backbone_lr_factor"],
                     positive=["epochs", "batch_size", "global_batch_size", "lr", "grad_accum", "max_steps"])
        if self.model not in MODELS and not is_pretrained(self.model):
            raise UserError(f"--model {self.model}: not one of {', '.join(MODELS)}, a model folder, a Hub model id "
                            f"(OWNER/NAME) or timm:NAME.")
        if not 0 <= self.label_smoothing < 1:
            raise UserError(f"--label-smoothing must be in [0, 1) (got {self.label_smoothing}).")
        if not 0 <= self.drop_path < 1:
            raise UserError(f"--drop-path is a chance per block, in [0, 1) (got {self.drop_path:g}).")
        if self.layer_decay is not None and not 0 < self.layer_decay <= 1:
            raise UserError(f"--layer-decay is a factor per layer, in (0, 1] (got {self.layer_decay:g}).")
        if self.backbone_lr_factor == 0 and (self.model in MODELS or self.model.startswith("timm:")):
            raise UserError(f"--backbone-lr-factor 0 trains a pretrained model's new head alone; --model {self.model} "
                            f"holds no pretrained tensors.")
        super().validate()


# --recipe NAME: presets (global batch = batch_size B; on N GPUs, the same steps: --batch-size B/N
# --global-batch-size B). They set defaults only: flags given on the command line still win. The evidence: fast and
# resnet18 are the literature's values; no accuracy or time of either has been measured here (no GPU has run them).
RECIPES = {
    # Myrtle.ai's ResNet-9 schedule (lr 0.4 and weight decay 5e-4 per mean loss, batch 512; its authors report 94%
    # test top-1), shortened by label smoothing and test-time flip; the data on the GPU; bf16 from the YAML.
    "fast": dict(model="resnet9", epochs=18, batch_size=512, lr=0.4, weight_decay=5e-4, label_smoothing=0.2,
                 warmup_epochs=4, grad_clip=0.0, tta_flip=True, channels_last=True, compile=True, data_on_device=True),
    # ResNet-18 (CIFAR stem): a standard cosine schedule with label smoothing and test-time flip.
    "resnet18": dict(model="resnet18", epochs=60, batch_size=256, lr=0.2, weight_decay=5e-4, label_smoothing=0.1,
                     warmup_epochs=2, tta_flip=True, channels_last=True, compile=True, data_on_device=True),
    # Fine-tuning a pretrained --model: AdamW with weight decay 0.05 and label smoothing 0.1 (the literature's: the
    # DeiT and ConvNeXt fine-tuning settings), random-resized crops at the model's own input size (--image-size
    # unset), a short warmup. The lr, epochs and batch are ours. The backbone trains at the head's lr
    # (--backbone-lr-factor 1): measured against 0.1 and 0.3 and training from scratch, mean of 3 seeds,
    # docs/performance.md ("Fine-tuning a pretrained timm model").
    "finetune": dict(optimizer="adamw", lr=1e-3, weight_decay=0.05, label_smoothing=0.1, warmup_epochs=0.5,
                     epochs=10, batch_size=64, augment="resized-crop", grad_clip=1.0),
}


def parse_config(argv: list[str] | None = None) -> Config:
    return parse(Config, argv, description=__doc__.splitlines()[0], presets=RECIPES)


# ====================================================================================================
# What a copy edits: the model, the data, the optimizer and the loss
# ====================================================================================================
def build_model(cfg: Config, num_classes: int) -> torch.nn.Module:
    """The network: a float batch (N, 3, S, S), normalised, channels-last unless --no-channels-last, in; logits
    (N, num_classes) out (checked before training). Built after set_seed, so every rank starts from the same weights.
    Under FSDP, the block classes listed in its `_no_split_modules` are sharded one by one (none listed: a fallback,
    docs/customizing.md). evaluate_checkpoint.py rebuilds the model through this function, with the run's config."""
    return named_model(cfg.model, num_classes, drop_path=cfg.drop_path)  # the ready models: utils/models.py


def load_data(cfg: Config) -> dict:
    """{"train": (images, labels), "test": (images, labels), "classes": names}: uint8 images N x H x W x 3 or
    N x 3 x H x W, square, as numpy arrays (memory-mapped is fine) or tensors, or each split a torch Dataset of
    (image, label) items of any size (decoded in the loader's workers); integer labels 0 .. C-1. Optional:
    "mean" and "std" per channel in [0, 1] (computed from the training images when absent), "dataset" (a description
    for summary.json). Called on every process, with the same result. The built-in source: --data-dir (parquet or an
    image folder) or --dataset (the Hub), decoded once per machine into a cache that its other processes read, or
    (--decode workers, full-size images) kept encoded and decoded by batch in the loader's workers, or (--decode
    stream) parquet or tar shards read block by block from a folder or a URL, decoded the same way."""
    return load_builtin(cfg)  # --data-dir / --dataset by --decode (utils/data/builtin.py)


def build_optimizer(cfg: Config, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """Built before prepare(), which shards it under FSDP. parameter_groups: a pretrained --model's new head at lr
    (the first group, the lr logged), its pretrained tensors at lr x --backbone-lr-factor (0: frozen, batch-norm
    statistics too: freeze_backbone), each x --layer-decay per layer below the head's; weight decay on weight
    matrices and kernels only (--decay-exemptions). optimizer_kernel(): fused SGD / AdamW (one kernel for the whole
    update), foreach under FSDP2 (utils/launch.py says why)."""
    if cfg.backbone_lr_factor == 0:  # a linear probe; here, not in build_model: the tools rebuild the model unfrozen
        freeze_backbone(model)
    params = parameter_groups(model, lr, cfg.weight_decay, backbone_lr_factor=cfg.backbone_lr_factor,
                              exemptions=cfg.decay_exemptions, layer_decay=cfg.layer_decay,
                              layers=model_layers(cfg.model))  # a copy's own model: its layers, for --layer-decay
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True, weight_decay=cfg.weight_decay,
                               **optimizer_kernel())
    return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, **optimizer_kernel())


def compute_loss(cfg: Config, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(the loss, a mean over the batch; its named terms, {} for one term). Training backpropagates it; evaluation
    reports it as eval/loss (what --best-metric loss picks by) and evaluate_checkpoint.py as "loss", so a copy's own
    loss is the one measured everywhere. A loss of several parts names each: (ce + l2, {"ce": ce, "l2": l2}) logs
    train/ce, train/l2, eval/ce, eval/l2. targets: labels (N,), or in training under --mixup / --cutmix class
    probabilities (N, C), which F.cross_entropy takes as they are."""
    return F.cross_entropy(logits, targets, label_smoothing=cfg.label_smoothing), {}


# ====================================================================================================
# Training
# ====================================================================================================
def main(cfg: Config) -> dict:
    check_output_dir(cfg.output_dir)
    if cfg.deterministic:
        make_deterministic()
    tracker = Tracker(cfg, cfg.output_dir)  # the logging flags
    fsdp = fsdp_plugin_from_launcher()  # None unless the launch config asks for FSDP
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # without it, N launched CPU processes each train alone (no gloo group)
        log_with=tracker.log_with, project_dir=cfg.output_dir,  # the tracker; the checkpoints' folder
        dynamo_backend="inductor" if cfg.compile else None,  # None: whatever the launcher configured
        dataloader_config=DataLoaderConfiguration(non_blocking=True),  # the order: utils.data.images.EpochSampler
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.dist_timeout))],  # a dead peer fails
        fsdp_plugin=fsdp,
    )  # no mixed_precision argument on purpose: the launcher's choice must win
    shard_on_cpu_too(accelerator, fsdp)  # Accelerate alone would run DDP for an FSDP config on CPU
    check_world(accelerator, fsdp_asked=fsdp is not None, sync_bn=cfg.sync_bn)  # one line if the setup is wrong
    check_can_push(cfg.push_to_hub, accelerator)  # --push-to-hub: the Hub and a token, or one line now
    model_stats = apply_preprocessing(cfg, accelerator.print)  # a pretrained --model: its size, crop, mean, std
    with lock_output_dir(accelerator, cfg.output_dir):  # one job per output folder, until the job ends
        checkpointer = Checkpointer(accelerator, cfg, tracker)  # the checkpoint flags; saves the whole config
        resume_from = checkpointer.resume_point()
        if (finished := checkpointer.finished_run(resume_from)) is not None:  # said; nothing trained or rewritten
            push_to_hub(cfg.push_to_hub, accelerator, cfg.output_dir, finished)  # --push-to-hub: the run as it is
            return finished
        # micro-batch x processes x accumulation; a resume on another process count keeps the global batch
        plan = plan_batches(accelerator.num_processes, cfg.batch_size, cfg.global_batch_size, cfg.grad_accum,
                            saved=checkpointer.saved_plan(resume_from), say=accelerator.print)
        use_plan(accelerator, plan)  # Accelerate's accumulation steps
        lr = cfg.lr * plan.global_batch / REFERENCE_BATCH if cfg.scale_lr else cfg.lr
        print_setup(accelerator, cfg, plan, lr)  # the config, then the processes, precision, device and batch

        # --- data: shuffled and augmented by (seed, epoch, sample); Accelerate shards and moves to the device ---
        data = checked_data(load_data(cfg), cfg=cfg, model_stats=model_stats, say=accelerator.print)  # mean, std: whose
        train_loader, eval_loader = build_loaders(data, cfg, accelerator, plan)  # --train-subset, --eval-subset, mixing
        memory = MemoryGuard(accelerator, fsdp is not None, train_loader)  # out of memory: half batches

        # --- model: same seed on every rank -> same initial weights (DDP also broadcasts rank 0's) ---
        set_seed(cfg.seed)
        model = build_model(cfg, len(data["classes"]))
        check_logits(model, len(data["classes"]), data["image_size"])  # logits (N, classes) for the data's images
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) if cfg.sync_bn else model  # before prepare()
        init = init_weights(model, cfg.init_from, cfg.model, accelerator, resume_from, data["classes"])  # --init-from
        channels_last = cfg.channels_last and fsdp is None  # FSDP2 shards contiguous parameters only: NCHW under FSDP
        model = model.to(memory_format=torch.channels_last) if channels_last else model
        optimizer = build_optimizer(cfg, model, lr)
        choose_fsdp_units(accelerator, fsdp, model)  # FSDP: the model's _no_split_modules, else by size; says which
        model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
        check_wrapper(accelerator, model, cfg.bf16_grad_sync)  # DDP or FSDP really wraps it; bf16 all-reduce if asked
        ema = WeightEMA(accelerator, model, cfg.ema_decay) if cfg.ema_decay else None  # updated after each step
        transform = BatchTransform.for_data(data, accelerator.device, channels_last)  # its mean, std, size, classes
        extra_metrics = load_metrics(cfg.metric, data["classes"], accelerator)  # --metric: loaded, tried once
        run_eval = partial(evaluate, model, eval_loader, transform, accelerator, tta_flip=cfg.tta_flip,  # each once
                           classes=data["classes"], compute_loss=partial(compute_loss, cfg), metrics=extra_metrics)
        guard = StopGuard(accelerator, HEALTH_CHECK_EVERY, checkpointer)  # preemption signals and a non-finite loss
        # when to evaluate, the best weights by --best-metric (checked now: a metric it evaluates), an early stop
        evaluator = Evaluator(cfg, run_eval, checkpointer, model, tracker, guard, ema, extra_metrics)

        # --- schedule, in optimizer steps; not prepared: Accelerate's would step once per process per step ---
        steps_per_epoch = len(train_loader) // plan.accumulation  # whole global batches only (EpochSampler)
        total_steps = min(cfg.max_steps or math.inf, cfg.epochs * steps_per_epoch)
        warmup_steps = min(round(cfg.warmup_epochs * steps_per_epoch), total_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, warmup_cosine(warmup_steps, total_steps))

        # --- resume, on any process count: weights, optimizer, RNG (Accelerate), schedule, counters ---
        p = checkpointer.start(resume_from, scheduler, plan, ema)  # fresh: --overwrite clears the old run only now
        accelerator.wait_for_everyone()
        run_info = {**run_facts(accelerator, checkpointer.script, model, optimizer, plan, total_steps, lr),
                    "channels_last": channels_last, **init}
        p.tracker_run_id = tracker.start(accelerator, {**asdict(cfg), **run_info}, p.tracker_run_id, bool(resume_from))
        profiler = StepProfiler(accelerator, cfg.output_dir, enabled=cfg.profile)  # --profile: a trace of a few steps

        metrics = None
        while p.epoch < cfg.epochs and p.global_step < total_steps and not p.stopped_early:
            model.train()
            epoch_number = p.epoch + 1
            train_loader.set_epoch(p.epoch)  # new shuffle and augmentation each epoch, same on every rank
            skip = p.batches_in_epoch  # resuming in the middle of an epoch: the batches already trained
            batches = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
            bar = tqdm(batches, f"epoch {epoch_number}/{cfg.epochs}", len(train_loader), initial=skip,
                       leave=False, disable=None if accelerator.is_local_main_process else True)  # no bar without a tty
            # a resumed epoch's meter starts from the loss sums its checkpoint stored: it logs as if uninterrupted
            meter = TrainMeter(accelerator.device, plan.micro * plan.processes, p.resumed_losses())
            for images, labels, draws in bar:  # draws: each image's crop, flip and mixing (utils.data.draws.Draws)
                with accelerator.accumulate(model), memory.micro_step():  # no all-reduce on non-final micro-steps
                    inputs, targets = transform.train(images, labels, draws)  # crop, flip, mix, normalise on device
                    torch.manual_seed(draws.forward)  # drop path, dropout: keyed by the micro-batch (any world size)
                    loss, terms = compute_loss(cfg, model(inputs), targets)  # terms: train/<name>
                    accelerator.backward(loss)  # divides by grad_accum
                    if accelerator.sync_gradients and (cfg.grad_clip > 0 or tracker.logs_at(p.global_step + 1)):
                        meter.grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
                    optimizer.step()  # the prepared optimizer only steps on the final micro-step
                    optimizer.zero_grad(set_to_none=True)
                if memory.hit:  # out of memory (every rank): half the micro-batch, twice the accumulation
                    train_loader, plan = memory.shrink(p, optimizer, plan)
                    break
                guard.observe(loss, p.global_step + 1)  # on the device: no sync per step
                meter.add(loss, terms)  # summed on the device: no sync either
                p.took_batch()
                if not accelerator.sync_gradients:
                    continue
                if not optimizer.step_was_skipped:  # fp16 overflow steps: no schedule step, no EMA update
                    scheduler.step()
                    if ema is not None:
                        ema.update()  # the weights' moving average
                p.took_step()
                profiler.step()  # --profile: traces optimizer steps 6-8
                tracker.after_step(p, meter, scheduler.get_last_lr()[0], bar)  # every --log-every steps: syncs and logs
                if p.global_step >= total_steps:
                    break
                evaluated = evaluator.after_step(p, meter, len(train_loader))  # every --eval-every-steps in the epoch
                stop = guard.should_stop(p.global_step, now=evaluated or checkpointer.due(p.global_step))  # all ranks
                checkpointer.after_step(p, meter, model, scheduler, plan, len(train_loader), evaluated, stopping=stop)
                if stop or p.stopped_early:
                    break  # preempted (saved where every rank stopped), or stopped early
            if guard.preempted:
                break
            if memory.shrunk:  # the epoch goes on at the interrupted step's first micro-batch, the new size
                continue
            losses, epoch_images, epoch_seconds = meter.end_epoch(accelerator)  # the loss and terms' means; syncs
            bar.close()
            p.end_epoch(losses, epoch_images, epoch_seconds, len(train_loader))

            metrics = evaluator(p)  # raises on a non-finite loss first; best.safetensors; eval/*; an early stop
            tracker.log_epoch(epoch_number, p.global_step, losses, epoch_images, epoch_seconds, metrics)
            checkpointer.save(p, model, scheduler, plan)

        # --- the end. Preempted: the checkpoint just saved is where to continue. Finished: the outputs ---
        if guard.preempted:
            accelerator.print(f"preempted ({guard.reason()}): saved {checkpointer.last}; continue with --resume auto")
            summary = {"preempted": True, "checkpoint": str(checkpointer.last)}
        else:
            metrics = metrics or evaluator.metrics()  # None: resumed from a checkpoint of a finished run
            summary = {**run_info, **data_facts(data), **p.summary(),
                       **{f"eval_{k}": v for k, v in metrics.items()}, "last_checkpoint": str(checkpointer.last),
                       "peak_memory_gb": peak_memory_gb(accelerator.device), "batch_plan": asdict(plan),
                       "resumed_from": resume_from and str(resume_from), "config": asdict(cfg)}
            evaluator.log_predictions(p.global_step)  # --log-predictions: the last evaluation's table
            tracker.finish(summary)  # the W&B run's summary; names the W&B run in `summary`
            export_model(accelerator, model, ema, data, cfg.output_dir, summary)  # weights, preprocessing, summary
            tracker.log_model("end", cfg.output_dir, p.global_step)  # --wandb-log-model: the run's folder, to W&B
            push_to_hub(cfg.push_to_hub, accelerator, cfg.output_dir, summary)  # --push-to-hub: with a model card
        accelerator.wait_for_everyone()
        accelerator.end_training()  # trackers, process group; utils.launch.run() frees the rest once main() returns
        return summary


if __name__ == "__main__":
    sys.exit(run(lambda: main(parse_config())))  # a UserError: one line, exit 2
