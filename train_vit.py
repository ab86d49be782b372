"""Train a Vision Transformer on CIFAR-10 with HuggingFace Accelerate: DDP or FSDP2, from one CPU to many GPUs.

    python train_vit.py --data-dir ../shared/data/cifar10 --model vit_micro --epochs 1     # 1 process, a first run
    accelerate launch --config_file accelerate_configs/fsdp_cpu.yaml train_vit.py --model vit_tiny  # FSDP2, 2 CPU ranks
    accelerate launch --config_file accelerate_configs/4gpu.yaml      train_vit.py          # 4 GPUs, DDP, ViT-S
    accelerate launch --config_file accelerate_configs/fsdp_4gpu.yaml train_vit.py --model vit_b  # 4 GPUs, FSDP2
    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml train_vit.py --model vit_l \
        --activation-checkpointing                                                     # 8 GPUs, FSDP2, ViT-L

When FSDP: when the model's state (weights, gradients, AdamW's two moments: 16 bytes per parameter in fp32) and its
activations stop fitting one device. FSDP2 shards each transformer block over the processes (each holds 1/N of the
state and gathers one block at a time); under `--mixed_precision bf16` it gathers bf16 copies of the fp32 shards and
reduces gradients in fp32. `--activation-checkpointing` keeps only each block's input and recomputes the rest in
backward. Same YAMLs as train_cifar.py: the ViT declares its block (EncoderBlock) in `_no_split_modules`, which FSDP
shards one by one. For a model that fits, DDP is simpler and faster (docs/launching.md, "FSDP2").

Same structure and edit points as train_cifar.py (its docstring explains them); the differences: a ViT
(utils/models.vit), AdamW without weight decay on biases, norms, the class token and position embeddings, FSDP2 bf16
parameters, activation checkpointing, no BatchNorm (no channels-last, no SyncBN).
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
    print_setup,
    run,
    shard_on_cpu_too,
)
from utils.models import VITS, check_logits, checkpoint_blocks, model_layers, named_model, vit_patch
from utils.optim import parameter_groups
from utils.output_dir import check_output_dir, lock_output_dir
from utils.plan import plan_batches, use_plan
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
    output_dir: str = opt("runs/cifar10-vit", "summary.json, model.safetensors, checkpoints and tracker files go "
                          "here")  # the checkpoints group's field, with this script's default
    # --- model: the network and how it runs ---
    model: str = opt("vit_s", "ViT size: vit_micro (75K parameters at 32 px, tests), vit_tiny (5.4M), vit_s (21M), "
                     "vit_b (85M), vit_l (302M)", tuple(VITS))
    patch_size: int | None = opt(None, "the ViT's patch side in px, a divisor of --image-size; unset: the smallest "
                                 "power of two from 4 giving at most 14 x 14 patches (4 at 32 px, 8 at 64, 16 at 224)")
    activation_checkpointing: bool = opt(False, "recompute each block's activations in backward instead of keeping "
                                         "them: less memory, about a third more compute")
    compile: bool = opt(False, "torch.compile the model (through Accelerate's dynamo backend 'inductor')")
    # --- optimisation: batch, learning rate and its schedule, regularisation, reproducibility ---
    epochs: int = opt(100, "passes over the training set")
    batch_size: int = opt(128, "images per process per micro-step (the micro-batch); global batch = batch_size x "
                          "processes x accumulation")
    global_batch_size: int | None = opt(None, "fix the global batch, so any process count trains the same "
                                        "steps: accumulation = this / (batch_size x processes), exactly; unset: "
                                        "from grad_accum")
    lr: float = opt(5e-4, "peak AdamW learning rate, reached after warmup")
    scale_lr: bool = opt(False, f"linear scaling rule: lr x global_batch / {REFERENCE_BATCH}")
    layer_decay: float | None = opt(None, "layer-wise lr decay: each tensor's lr x this^(its layers below the "
                                    "head's; utils/optim.py), e.g. 0.75 for fine-tuning; unset: off")
    drop_path: float = opt(0.0, "stochastic depth: the chance that a residual block's branch is dropped for an "
                           "image, rising linearly over the blocks to this (timm's and transformers' drop_path_rate; "
                           "the ready models by block), masks keyed by the micro-batch; e.g. 0.1; 0: off")
    weight_decay: float = opt(0.05, "AdamW's decoupled weight decay, on the parameters build_optimizer gives it "
                              "(summary.json records each group's)")
    decay_exemptions: bool = opt(True, "no weight decay on biases, norms, the class token and position embeddings "
                                 "(the ViT/DeiT recipe, utils/optim.py); --no-decay-exemptions: every parameter "
                                 "decays")
    label_smoothing: float = opt(0.1, "cross-entropy label smoothing, in [0, 1)")
    warmup_epochs: float = opt(5.0, "linear warmup from 0 to lr, then cosine decay to 0")
    grad_accum: int | None = opt(None, "micro-steps per optimizer step (no gradient all-reduce on the others); "
                                 "unset: 1, or from --global-batch-size")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0: no clipping")
    bf16_grad_sync: bool = opt(True, "DDP under bf16 mixed precision: all-reduce gradients in bf16 (half the "
                               "bytes); --no-bf16-grad-sync: in fp32. FSDP reduces in fp32")
    max_steps: int | None = opt(None, "stop after this many optimizer steps (the schedule is planned for them)")
    seed: int = opt(0, "seeds the weights (same on every rank), data order and augmentation (by sample: the same at "
                    "any process count)")
    deterministic: bool = opt(False, "deterministic kernels; on CPU also 1 thread, so 1 process matches N launched "
                              "processes bitwise")
    def validate(self) -> None:  # this script's fields; then each inherited group checks its own
        check_ranges(self, positive=["epochs", "batch_size", "global_batch_size", "lr", "grad_accum", "max_steps"],
                     non_negative=["weight_decay", "warmup_epochs", "grad_clip"])
        if not 0 <= self.label_smoothing < 1:
            raise UserError(f"--label-smoothing must be in [0, 1) (got {self.label_smoothing}).")
        if not 0 <= self.drop_path < 1:
            raise UserError(f"--drop-path is a chance per block, in [0, 1) (got {self.drop_path:g}).")
        if self.layer_decay is not None and not 0 < self.layer_decay <= 1:
            raise UserError(f"--layer-decay is a factor per layer, in (0, 1] (got {self.layer_decay:g}).")
        super().validate()
        size = self.image_size or 32
        if self.patch_size is not None and not 0 < self.patch_size <= size:
            raise UserError(f"--patch-size must be in 1 .. {size} (the image size; got {self.patch_size}).")
        if size % (patch := self.patch_size or vit_patch(size)):
            given = "--patch-size" if self.patch_size else "the default for this size"
            raise UserError(f"--image-size {size} is not a multiple of the ViT's patch size {patch} ({given}); give "
                            f"--patch-size P for a P that divides it.")


def parse_config(argv: list[str] | None = None) -> Config:
    return parse(Config, argv, description=__doc__.splitlines()[0])


# ====================================================================================================
# What a copy edits: the model, the data, the optimizer and the loss
# ====================================================================================================
def build_model(cfg: Config, num_classes: int) -> torch.nn.Module:
    """The network: a normalised float batch (N, 3, S, S) in, logits (N, num_classes) out (checked before
    training). torchvision's ViT is built for one image size: --image-size (32 when unset). Its block,
    EncoderBlock, is in `_no_split_modules`: FSDP shards it one by one. evaluate_checkpoint.py rebuilds it here."""
    return named_model(cfg.model, num_classes, image_size=cfg.image_size or 32, drop_path=cfg.drop_path,
                       patch_size=cfg.patch_size)  # unset: 4 at 32 px, growing with the size (utils/models.vit_patch)


def load_data(cfg: Config) -> dict:
    """{"train": (images, labels), "test": (images, labels), "classes": names}, as train_cifar.py's load_data (its
    docstring and docs/customizing.md give the contract): here the built-in source, --data-dir or --dataset."""
    return load_builtin(cfg)  # --data-dir / --dataset by --decode (utils/data/builtin.py)


def build_optimizer(cfg: Config, model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on the weight matrices only (parameter_groups, --decay-exemptions): decaying biases,
    LayerNorm scales, the class token and the position embeddings only pulls them to zero (the ViT/DeiT recipe).
    Built before prepare(); Accelerate then swaps in the sharded parameters under FSDP. foreach under both wrappers:
    the same arithmetic, so DDP and FSDP runs agree bitwise (measured; the fused kernel rounds differently on plain
    tensors and on DTensors, 2e-5 apart after 8 steps). The update is a small part of a ViT step."""
    groups = parameter_groups(model, lr, cfg.weight_decay, exemptions=cfg.decay_exemptions,
                              layer_decay=cfg.layer_decay, layers=model_layers(cfg.model))  # the ViT by block
    return torch.optim.AdamW(groups, lr=lr, foreach=True)


def compute_loss(cfg: Config, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(the loss, a mean over the batch; its named terms), called by training, evaluation and
    evaluate_checkpoint.py, as train_cifar.py's compute_loss (its docstring says how)."""
    return F.cross_entropy(logits, targets, label_smoothing=cfg.label_smoothing), {}


# ====================================================================================================
# Training
# ====================================================================================================
def main(cfg: Config) -> dict:
    check_output_dir(cfg.output_dir)
    if cfg.deterministic:
        make_deterministic()
    tracker = Tracker(cfg, cfg.output_dir)  # the logging flags
    fsdp = fsdp_plugin_from_launcher(bf16_params=True)  # None unless the launch config asks for FSDP
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # without it, N launched CPU processes each train alone (no gloo group)
        log_with=tracker.log_with, project_dir=cfg.output_dir,  # the tracker; the checkpoints' folder
        dynamo_backend="inductor" if cfg.compile else None,  # None: whatever the launcher configured
        dataloader_config=DataLoaderConfiguration(non_blocking=True),  # the order: utils.data.images.EpochSampler
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.dist_timeout))],
        fsdp_plugin=fsdp,
    )  # no mixed_precision argument on purpose: the launcher's choice must win
    shard_on_cpu_too(accelerator, fsdp)  # Accelerate alone would run DDP for an FSDP config on CPU
    check_world(accelerator, fsdp_asked=fsdp is not None)  # one line if the setup is wrong
    check_can_push(cfg.push_to_hub, accelerator)  # --push-to-hub: the Hub and a token, or one line now
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
        data = checked_data(load_data(cfg), cfg=cfg, say=accelerator.print)  # the contract checked; mean, std: whose
        train_loader, eval_loader = build_loaders(data, cfg, accelerator, plan)  # --train-subset, --eval-subset, mixing
        memory = MemoryGuard(accelerator, fsdp is not None, train_loader)  # out of memory: half batches

        # --- model: same seed on every rank -> same initial weights; blocks checkpointed before FSDP shards them ---
        set_seed(cfg.seed)
        model = build_model(cfg, len(data["classes"]))
        check_logits(model, len(data["classes"]), data["image_size"])  # logits (N, classes) for the data's images
        init = init_weights(model, cfg.init_from, cfg.model, accelerator, resume_from, data["classes"])  # --init-from
        if cfg.activation_checkpointing:
            checkpoint_blocks(model)
        optimizer = build_optimizer(cfg, model, lr)
        choose_fsdp_units(accelerator, fsdp, model)  # FSDP: the model's _no_split_modules, else by size; says which
        model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
        check_wrapper(accelerator, model, cfg.bf16_grad_sync)  # DDP or FSDP really wraps it; bf16 all-reduce if asked
        ema = WeightEMA(accelerator, model, cfg.ema_decay) if cfg.ema_decay else None  # updated after each step
        transform = BatchTransform.for_data(data, accelerator.device, channels_last=False)  # mean, std, size, classes
        extra_metrics = load_metrics(cfg.metric, data["classes"], accelerator)  # --metric: loaded, tried once
        run_eval = partial(evaluate, model, eval_loader, transform, accelerator, tta_flip=False,  # each once
                           classes=data["classes"], compute_loss=partial(compute_loss, cfg), metrics=extra_metrics)
        guard = StopGuard(accelerator, HEALTH_CHECK_EVERY, checkpointer)  # preemption signals and a non-finite loss
        # when to evaluate, the best weights by --best-metric (checked now: a metric it evaluates), an early stop
        evaluator = Evaluator(cfg, run_eval, checkpointer, model, tracker, guard, ema, extra_metrics)

        # --- schedule, counted in optimizer steps; not prepared (Accelerate would step it once per process) ---
        steps_per_epoch = len(train_loader) // plan.accumulation  # whole global batches only (EpochSampler)
        total_steps = min(cfg.max_steps or math.inf, cfg.epochs * steps_per_epoch)
        warmup_steps = min(round(cfg.warmup_epochs * steps_per_epoch), total_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, warmup_cosine(warmup_steps, total_steps))

        # --- resume, on any process count: weights, optimizer, RNG (Accelerate), schedule, counters ---
        p = checkpointer.start(resume_from, scheduler, plan, ema)  # fresh: --overwrite clears the old run only now
        accelerator.wait_for_everyone()
        run_info = {**run_facts(accelerator, checkpointer.script, model, optimizer, plan, total_steps, lr),
                    "fsdp_param_dtype": _param_dtype(fsdp), **init}
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
                with accelerator.accumulate(model), memory.micro_step():  # no gradient sync on non-final micro-steps
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

        # --- the end. Preempted: the checkpoint just saved is where to continue. Finished: the outputs (full fp32
        # weights that load into a plain ViT) ---
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


def _param_dtype(fsdp) -> str | None:
    """The dtype FSDP gathers parameters in for compute (None without FSDP; fp32 unless bf16 was launched)."""
    return None if fsdp is None else str(fsdp.mixed_precision_policy.param_dtype or torch.float32).split(".")[-1]


if __name__ == "__main__":
    sys.exit(run(lambda: main(parse_config())))  # a UserError: one line, exit 2
