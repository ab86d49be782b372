"""What a run reports: to W&B or TensorBoard (through Accelerate's trackers) and to the console; what summary.json
records of the run (`run_facts`; utils/export.py writes it).

`Tracker` owns the policies: W&B offline without credentials, the same W&B run continued across resumes, the logged
numbers kept in the run's folder too (HISTORY_FILE) and a resumed job logging only what they lack, the
confusion-matrix plot, progress lines when there is no terminal, the W&B run's summary. `TrainMeter` sums the training
loss and its named terms on the device (no host sync per step) and reads them once per log window and per epoch."""

from __future__ import annotations

import importlib.metadata
import json
import netrc
import os
import resource
import shlex
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate.utils import ProfileKwargs

from utils import UserError
from utils.output_dir import LIBRARY_CONFIG, PREPROCESSOR_FILE, SUMMARY_FILE

if TYPE_CHECKING:
    from utils.config_groups import LoggingConfig

HISTORY_FILE = "history.jsonl"  # every logged step's numbers, whatever the tracker (compare_runs.py draws them)
MAX_PER_CLASS_KEYS = 20  # more classes: no eval/top1_<class> keys and no confusion plot (summary.json has them all)
PROFILE = {"wait": 4, "warmup": 1, "active": 3, "repeat": 1}  # --profile: torch.profiler.schedule, in optimizer steps
# --wandb-log-model: which events log versions of the run's model artifact. Each version is a run folder the tools
# read (predict.py, evaluate_checkpoint.py: wandb:ENTITY/PROJECT/model-RUNID:ALIAS) whose model.safetensors holds the
# weights its alias names: best, the best weights; latest at the end, the final ones (with best.safetensors beside).
MODEL_EVENTS = {"none": (), "end": ("end",), "best": ("end", "best"), "checkpoints": ("end", "best", "checkpoint")}
REBUILD_FILES = ("config.yaml", LIBRARY_CONFIG, PREPROCESSOR_FILE, SUMMARY_FILE)  # how to rebuild and feed the weights


class Tracker:
    """One run's tracker (wandb, tensorboard or none), from the logging flags (utils.config_groups.LoggingConfig).
    Build it before the Accelerator (pass `log_with`), then `start()` once the run's config is known."""

    def __init__(self, cfg: LoggingConfig, output_dir: str):
        self.kind, self.output_dir, self.log_every = cfg.tracker, Path(output_dir), cfg.log_every
        self.model_events = MODEL_EVENTS[cfg.wandb_log_model]
        # Without a terminal (SLURM logs, CI) tqdm's bar is off: print a progress line instead, at a log step at least
        # progress_every seconds after the previous line (with a terminal the bar shows loss, speed and ETA).
        self.progress_every, self.last_line = cfg.progress_every, None
        self.console = not sys.stderr.isatty()
        self.log_with = None if self.kind == "none" else self.kind
        self.project = cfg.wandb_project or os.environ.get("WANDB_PROJECT", "cifar10-accelerate")
        self.wandb_args = {"dir": os.environ.get("WANDB_DIR") or output_dir,  # scratch space on clusters, if set
                           "name": cfg.run_name, "group": cfg.group,  # None: W&B's own default / WANDB_*
                           "tags": cfg.tags.split(",") if cfg.tags else None}
        self.accelerator, self.wandb_run, self.logged = None, None, (0, set())
        if self.kind == "wandb":
            wandb_offline_without_credentials()

    def start(self, accelerator, config: dict, run_id: str | None, resumed: bool) -> str | None:
        """Starts (or, with the `run_id` of a resumed job, continues) the run; returns its id for the checkpoints.
        `config`: the run's flags and facts, including epochs, total_steps and global_batch (for the console)."""
        self.accelerator = accelerator
        self.epochs, self.total_steps = config["epochs"], config["total_steps"]
        self.global_batch = config["global_batch"]
        if self.kind == "tensorboard":  # its hparams take numbers, strings and booleans only
            config = {k: v if isinstance(v, int | float | str | bool) else json.dumps(v) for k, v in config.items()}
        same_run = {"id": run_id, "resume": "allow"} if run_id else {}
        project = self.project
        if self.kind == "wandb" and os.environ.get("WANDB_SWEEP_ID"):  # a sweep agent's trial: its run and project
            project, same_run = None, {"resume": "allow"} if run_id else {}  # are the agent's (W&B ignores ours)
            config = {k: v for k, v in config.items() if k not in sweep_parameters()}  # the sweep's own, locked
        accelerator.init_trackers(project, config=config, init_kwargs={
            "wandb": {**{k: v for k, v in self.wandb_args.items() if v}, **same_run}})
        if self.kind == "wandb" and accelerator.is_main_process:
            self.wandb_run = accelerator.get_tracker("wandb", unwrap=True)
            run_id = self.wandb_run.id
            note_wandb_folder(Path(self.wandb_run.dir).parent, self.output_dir)
        # A run killed after its last checkpoint had already logged the steps it trains again now (to the same
        # values: resume is exact); log only what its history lacks, so the tracker's steps keep increasing.
        history = self.output_dir / HISTORY_FILE
        if accelerator.is_main_process and not resumed:  # a run started over (--overwrite) keeps no earlier history
            history.unlink(missing_ok=True)
        self.logged = last_logged(history, accelerator.is_main_process) if resumed else (0, set())
        return run_id

    def after_step(self, progress, meter, lr: float, bar) -> None:
        """The loop's call after every optimizer step: every --log-every steps, the window's mean loss over all
        processes (a sync) and speed to the tracker and the progress bar."""
        if not self.logs_at(progress.global_step):
            return
        losses, speed = meter.window(self.accelerator)
        self.log_train(progress.global_step, progress.epoch + 1, losses, lr, speed, meter.last_grad_norm())
        bar.set_postfix(loss=f"{losses['loss']:.3f}", img_s=f"{speed:,.0f}")

    def logs_at(self, step: int) -> bool:
        """Whether optimizer step `step` is a log step (every --log-every)."""
        return step % self.log_every == 0

    def log(self, values: dict, step: int) -> None:
        """`values` at optimizer step `step` to the tracker and, their numbers, as a line of the run's HISTORY_FILE
        (main process): a run's curves without a tracker, and without W&B's reader. A resumed job skips what the
        history holds: the steps before its last, and at its last the calls whose numbers it has (the training log of
        a step whose evaluation a kill interrupted; not that evaluation)."""
        numbers = {k: v for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        last, names = self.logged
        if step < last or step == last and numbers.keys() <= names:
            return
        self.accelerator.log(values, step=step)
        if self.accelerator.is_main_process and numbers:  # a table alone (--log-predictions): W&B's only
            with open(self.output_dir / HISTORY_FILE, "a") as f:
                f.write(json.dumps({"_step": step, "_timestamp": time.time(), **numbers}) + "\n")

    def log_train(self, step: int, epoch: int, losses: dict, lr: float, images_per_sec: float,
                  grad_norm: float | None = None) -> None:
        """A log step's training numbers (`losses`: the loss and compute_loss's terms, window means) to the tracker
        as train/<name> and, without a terminal, now and then to the console."""
        norm = {} if grad_norm is None else {"train/grad_norm": grad_norm}
        loss = losses["loss"]
        self.log({**{f"train/{name}": value for name, value in losses.items()}, "train/lr": lr, "epoch": epoch,
                  "train/images_per_sec": images_per_sec, **norm}, step)
        now = time.time()
        if not self.console or (self.last_line is not None and now - self.last_line < self.progress_every):
            return
        self.last_line = now
        eta = round((self.total_steps - step) * self.global_batch / max(images_per_sec, 1e-9))  # training, not eval
        hours, minutes, seconds = eta // 3600, eta % 3600 // 60, eta % 60
        self.accelerator.print(f"step {step}/{self.total_steps} (epoch {epoch}/{self.epochs})  loss {loss:.4f}  "
                               f"lr {lr:.4g}  {images_per_sec:,.0f} img/s  ETA {hours}h{minutes:02d}m{seconds:02d}s")

    def log_eval(self, step: int, epoch: int, metrics: dict) -> None:
        """An evaluation's metrics at optimizer step `step` of epoch `epoch` (from 1): eval/* (an EMA's as eval/ema_*);
        with at most MAX_PER_CLASS_KEYS classes also eval/top1_<class> and W&B's confusion-matrix plot (of the
        model's weights)."""
        scalars = {f"eval/{k}": v for k, v in metrics.items() if isinstance(v, int | float)}  # numbers only
        classes = list(metrics["class_top1"])
        few = len(classes) <= MAX_PER_CLASS_KEYS
        per_class = {f"eval/top1_{c}": v for c, v in metrics["class_top1"].items() if v is not None} if few else {}
        plot = wandb_confusion_matrix(metrics["confusion"], classes) if self.wandb_run is not None and few else {}
        self.log({**scalars, **per_class, "epoch": epoch, **plot}, step=step)

    def log_predictions(self, step: int, rows: list[dict]) -> None:
        """--log-predictions: `rows` (utils.evaluation.Examples.rows) as the W&B table eval/predictions at `step`:
        the image, its index in the evaluation split, true and predicted class, the prediction's probability and
        the top 5 ("cat 0.61, dog 0.22, ...")."""
        if self.wandb_run is None:
            return
        import wandb

        image = [None if row["image"] is None else wandb.Image(row["image"]) for row in rows]  # None: not gathered
        table = wandb.Table(columns=["image", "index", "true", "predicted", "probability", "top5"], data=[
            [picture, row["index"], row["true"], row["predicted"], row["probability"],
             ", ".join(f"{name} {p:.4f}" for name, p in row["top5"])] for picture, row in zip(image, rows)])
        self.log({"eval/predictions": table}, step=step)

    def log_epoch(self, epoch: int, step: int, losses: dict, images: int, seconds: float, metrics: dict) -> None:
        """The end of an epoch (numbered from 1): one console line (with the evaluation's top-1, which log_eval
        logged); to the tracker the epoch's training loss and loss terms (`losses`, epoch means: train/epoch_<name>),
        speed and the peak memory."""
        ema = f" (EMA {metrics['ema_top1']:.2f}%)" if "ema_top1" in metrics else ""
        self.accelerator.print(f"epoch {epoch}/{self.epochs}  train_loss {losses['loss']:.4f}  eval_top1 "
                               f"{metrics['top1']:.2f}%{ema}  {images / seconds:,.0f} img/s  {seconds:.1f} s")
        self.log({**{f"train/epoch_{name}": value for name, value in losses.items()},
                  "train/epoch_images_per_sec": images / seconds,
                  "train/epoch_seconds": seconds, "sys/peak_memory_gb": peak_memory_gb(self.accelerator.device),
                  "epoch": epoch}, step=step)

    def finish(self, summary: dict) -> None:
        """The W&B run's summary is the run's `summary` (summary.json: utils/export.py), which names the W&B run."""
        if self.accelerator.is_main_process and self.wandb_run is not None:
            summary["wandb_run"] = {"id": self.wandb_run.id, "project": self.wandb_run.project,
                                    "url": self.wandb_run.url if not self.wandb_run.offline else None}
            self.wandb_run.summary.update(summary)

    def log_model(self, event: str, folder: Path, step: int) -> None:
        """--wandb-log-model, on the main process: at `event` (best: a new best's weights were written; checkpoint: a
        checkpoint's folder; end: the finished run's folder) versions of the W&B model artifact model-<run id>,
        logged by the run that made them: a best's (aliases best, step-<step>), a checkpoint's (step-<step>: every
        file, resumable), and at the end first the best weights (best) and then the whole folder (step-<step>); W&B
        adds latest to each. W&B copies each file as it is added: a later write changes nothing uploaded."""
        if self.wandb_run is None or event not in self.model_events:
            return
        folder = Path(folder)
        if event == "checkpoint":
            self._log_version({p.name: p for p in sorted(folder.iterdir()) if p.is_file()}, [f"step-{step}"], step)
            return
        if (folder / "best.safetensors").is_file():
            best = {"model.safetensors": folder / "best.safetensors", **{name: folder / name for name in REBUILD_FILES}}
            self._log_version(best, ["best"] + ([f"step-{step}"] if event == "best" else []), step)
        if event == "end":
            names = ("model.safetensors", "best.safetensors", "model_ema.safetensors", *REBUILD_FILES)
            self._log_version({name: folder / name for name in names}, [f"step-{step}"], step)

    def _log_version(self, files: dict[str, Path], aliases: list[str], step: int) -> None:
        """`files` (name in the artifact -> file; those that do not exist left out) as a version of model-<run id>."""
        import wandb

        artifact = wandb.Artifact(f"model-{self.wandb_run.id}", type="model", metadata={"step": step})
        for name, path in files.items():
            if path.is_file():
                artifact.add_file(str(path), name=name)
        self.wandb_run.log_artifact(artifact, aliases=aliases)


def last_logged(history: Path, main: bool) -> tuple[int, set[str]]:
    """The last step a run's HISTORY_FILE holds and the names of the numbers logged at it ((0, none): no history). On
    the main process a last line cut short by a kill is cut off the file, so that the next line starts whole."""
    try:
        text = history.read_bytes()
    except FileNotFoundError:
        return 0, set()
    whole = text[:text.rfind(b"\n") + 1]
    if main and len(whole) < len(text):
        with open(history, "r+b") as f:
            f.truncate(len(whole))
    rows = []
    for line in whole.splitlines():
        try:
            rows.append(dict(json.loads(line)))
        except (TypeError, ValueError):  # a line edited by hand: compare_runs.py passes over it too
            continue
    last = max((row.get("_step", 0) for row in rows), default=0)
    return last, {k for row in rows if row.get("_step", 0) == last for k in row} - {"_step", "_timestamp"}


class StepProfiler:
    """--profile: torch.profiler, through Accelerate's `profile()`, over optimizer steps PROFILE["wait"] +
    PROFILE["warmup"] + 1 on (after warm-up: the first steps, compilation, the profiler's own warm-up step) for
    PROFILE["active"] steps. Then each rank's Chrome trace goes to <output-dir>/profile/profile_<rank>.json and the
    main process prints the ten ops that took the most time on the device (self time). A run with fewer steps writes
    no trace. Without --profile (`enabled` False) nothing of it runs: `step()` returns at once."""

    def __init__(self, accelerator, output_dir: str | Path, enabled: bool):
        self.cuda = accelerator.device.type == "cuda"
        self.steps_left = PROFILE["wait"] + PROFILE["warmup"] + PROFILE["active"] if enabled else 0
        if enabled:
            handler = ProfileKwargs(activities=["cpu", "cuda"] if self.cuda else ["cpu"], schedule_option=PROFILE,
                                    on_trace_ready=self.report if accelerator.is_main_process else None,
                                    output_trace_dir=str(Path(output_dir) / "profile"))
            self.context = accelerator.profile(handler)
            self.profiler = self.context.__enter__()

    def step(self) -> None:
        """The loop's call after every optimizer step: the profiler's step; after the last traced one, the traces are
        written (every rank, then a barrier) and profiling is over."""
        if not self.steps_left:
            return
        self.profiler.step()
        self.steps_left -= 1
        if not self.steps_left:
            self.context.__exit__(None, None, None)

    def report(self, profiler) -> None:
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        print(f"--profile: the ten most expensive ops of optimizer steps {PROFILE['wait'] + PROFILE['warmup'] + 1}-"
              f"{PROFILE['wait'] + PROFILE['warmup'] + PROFILE['active']}, by {sort}:\n"
              f"{profiler.key_averages().table(sort_by=sort, row_limit=10)}", flush=True)


class TrainMeter:
    """The training loss, and the named terms a script's compute_loss gives beside it (`terms`), summed on the device,
    and the time, over one epoch and over the current log window; and the global gradient norm (before clipping) of
    the last optimizer step that measured it, kept on the device. A value logged is the mean of every process's
    micro-batch values in the span. `carried`: the sums a mid-epoch checkpoint stored (`so_far`), {"names": the
    terms', "epoch": [sums, micro-batches], "window": [...]} over all processes, which a resumed epoch adds to its
    own, so it logs what the uninterrupted epoch logs."""

    def __init__(self, device: torch.device, images_per_batch: int, carried: dict | None = None):
        self.grad_norm: torch.Tensor | None = None  # the loop sets it: every step when clipping, else at log steps
        self.images_per_batch = images_per_batch  # all processes together
        self.device = device
        carried = carried or {}
        self.names: list[str] | None = carried.get("names")  # the terms': the first add() fixes them for the run
        self.carried = {k: (list(carried[k][0]), carried[k][1]) if k in carried else None for k in ("epoch", "window")}
        self.sums: torch.Tensor | None = None  # rows: epoch, window; columns: the loss, then each term
        self.epoch_batches = self.window_batches = 0
        self.epoch_start = self.window_start = time.time()

    def add(self, loss: torch.Tensor, terms: dict | None = None) -> None:
        """One micro-batch's loss and its named terms (scalar tensors; the same names at every call)."""
        terms = terms or {}
        if self.sums is None:
            self.names = check_terms(terms, self.names)
            self.sums = torch.zeros(2, 1 + len(self.names), device=self.device)
        elif list(terms) != self.names:
            raise UserError(f"the loss terms changed names within the run ({', '.join(self.names)} before, "
                            f"{', '.join(terms)} now); give the same terms at every step.")
        self.sums += torch.stack([loss.detach().float().reshape(()),
                                  *(terms[name].detach().float().reshape(()) for name in self.names)])
        self.epoch_batches += 1
        self.window_batches += 1

    def window(self, accelerator) -> tuple[dict, float]:
        """({"loss": mean over all processes, each term: its mean}, images per second) since the last call; syncs
        with the device."""
        sums, count = self._totals(accelerator)["window"]
        speed = self.window_batches * self.images_per_batch / (time.time() - self.window_start)
        if self.sums is not None:
            self.sums[1].zero_()
        self.window_batches, self.window_start, self.carried["window"] = 0, time.time(), None
        return self._means(sums, count), speed

    def so_far(self, accelerator) -> dict:
        """The epoch's and the log window's sums and micro-batch counts over all processes, carried ones included,
        and the terms' names: what a mid-epoch checkpoint stores for the resumed epoch's meter. Collective; syncs."""
        totals = self._totals(accelerator)
        return {"names": self.names or [], **{k: [sums, count] for k, (sums, count) in totals.items()}}

    def _totals(self, accelerator) -> dict:
        columns = 1 + len(self.names or [])
        local = self.sums if self.sums is not None else torch.zeros(2, columns, device=self.device)
        summed = accelerator.reduce(local, reduction="sum").tolist()
        n = accelerator.num_processes
        totals = {}
        for row, (key, batches) in enumerate((("epoch", self.epoch_batches), ("window", self.window_batches))):
            earlier_sums, earlier_batches = self.carried[key] or ([0.0] * columns, 0)
            totals[key] = ([a + b for a, b in zip(earlier_sums, summed[row], strict=True)],
                           earlier_batches + n * batches)
        return totals

    def _means(self, sums: list[float], count: int) -> dict:
        return {name: total / max(1, count) for name, total in zip(["loss", *(self.names or [])], sums, strict=True)}

    def last_grad_norm(self) -> float | None:
        """The last measured gradient norm as a number (a sync); under FSDP2 a DTensor, made whole on every rank."""
        if self.grad_norm is None:
            return None
        norm = self.grad_norm.full_tensor() if hasattr(self.grad_norm, "full_tensor") else self.grad_norm
        return norm.item()

    @contextmanager
    def paused(self):
        """Time inside (an evaluation within the epoch) is not training time: not in the epoch's or window's speed."""
        start = time.time()
        try:
            yield
        finally:
            gap = time.time() - start
            self.epoch_start += gap
            self.window_start += gap

    def images(self) -> int:
        return self.epoch_batches * self.images_per_batch

    def seconds(self) -> float:
        return time.time() - self.epoch_start

    def end_epoch(self, accelerator) -> tuple[dict, int, float]:
        """The epoch's ({"loss": mean over all processes, each term: its mean}, images, seconds); syncs with the
        device. The images and seconds are this job's part (a resumed epoch's earlier part is counted by the
        checkpoint's Progress)."""
        sums, count = self._totals(accelerator)["epoch"]
        return self._means(sums, count), self.images(), self.seconds()


RESERVED_TERMS = ("loss", "lr", "grad_norm", "images_per_sec")  # train/<name> keys taken by the loop's own values


def check_terms(terms: dict, carried: list[str] | None) -> list[str]:
    """The names of compute_loss's terms, checked once (the first micro-batch): identifiers that are not train/*
    keys already, each a one-element tensor, the names a resumed epoch's checkpoint carried."""
    for name, value in terms.items():
        if not isinstance(name, str) or not name.isidentifier() or name in RESERVED_TERMS or name.startswith("epoch_"):
            raise UserError(f"loss term {name!r}: a term's name is an identifier, not one of "
                            f"{', '.join(RESERVED_TERMS)} and not starting with epoch_ (it is logged as train/<name>).")
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise UserError(f"loss term {name!r} must be a one-element tensor, as the loss is (got "
                            f"{type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}).")
    if carried is not None and list(terms) != carried:
        raise UserError(f"the loss terms are {', '.join(terms) or 'none'}; the checkpoint resumed from has "
                        f"{', '.join(carried) or 'none'}: resume with the script that saved it.")
    return list(terms)


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


def sweep_parameters() -> set[str]:
    """The names of the parameters a W&B sweep agent gave this trial: the keys of the file it names in
    WANDB_SWEEP_PARAM_PATH (none without one). W&B sets them in the run's config itself and locks them."""
    import yaml

    try:
        return set(yaml.safe_load(Path(os.environ["WANDB_SWEEP_PARAM_PATH"]).read_text()) or {})
    except (KeyError, OSError, yaml.YAMLError):
        return set()


def note_wandb_folder(run_folder: Path, output_dir: Path) -> None:
    """A W&B run folder outside the output folder ($WANDB_DIR) is listed in <output-dir>/wandb_runs.txt, one line
    per life of the run, so compare_runs.py finds it from the output folder."""
    if output_dir.resolve() not in run_folder.resolve().parents:
        with open(output_dir / "wandb_runs.txt", "a") as f:
            f.write(f"{run_folder.resolve()}\n")


def wandb_confusion_matrix(confusion: list[list[int]], classes: list[str]) -> dict:
    """{"eval/confusion_matrix": W&B's confusion-matrix plot} from counts (rows: true class)."""
    import wandb

    pairs = [(true, pred) for true, row in enumerate(confusion) for pred, count in enumerate(row) for _ in range(count)]
    return {"eval/confusion_matrix": wandb.plot.confusion_matrix(
        y_true=[t for t, _ in pairs], preds=[q for _, q in pairs], class_names=list(classes))}


def run_facts(accelerator, script: dict, model, optimizer, plan, total_steps: int, lr: float) -> dict:
    """What the run is, for the tracker's config and summary.json: what the script built (the model and the
    optimizer: `model_record`, `optimizer_record`; in the tracker's config they stand where the --model and
    --optimizer flags would, which a copy's own build_model or build_optimizer does not follow), processes,
    precision, the batch plan, the planned optimizer steps, the learning rate as scaled, the wrapper, the training
    script (its name, path and sha256: utils.scripts, as the checkpointer records it), the launch command, library
    versions, commit. `model`, `optimizer`: as prepared."""
    from torch.distributed.tensor import DTensor

    return {"model": model_record(accelerator.unwrap_model(model, keep_torch_compile=False)),
            "optimizer": optimizer_record(optimizer.optimizer),
            "world_size": accelerator.num_processes, "distributed_type": accelerator.distributed_type.value,
            "mixed_precision": accelerator.mixed_precision, "batch_size_per_process": plan.micro,
            "grad_accum": plan.accumulation, "global_batch": plan.global_batch, "total_steps": total_steps,
            "effective_lr": lr, "wrapper": type(model).__name__,
            "parameters_on_main_process": sum((q.to_local() if isinstance(q, DTensor) else q).numel()
                                              for q in model.parameters()),  # FSDP2: this process's shards
            "script": script, "command": launch_command(), **environment()}


def model_record(model: torch.nn.Module) -> dict:
    """The network a script built (unwrapped): its class (an FSDP2-sharded model's own, not the FSDP subclass), the
    name it was built under if it declares one (`model_name`: utils.models.named_model's models do; a copy's own
    network does not, and then has no name here), its parameters (DTensors count in full)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model).__bases__[-1] if isinstance(model, FSDPModule) else type(model)  # fully_shard: FSDP<cls>
    return {"name": getattr(model, "model_name", None), "class": cls.__qualname__,
            "parameters": sum(q.numel() for q in model.parameters())}


def optimizer_record(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer a script built: its class and, per parameter group, its name (utils/optim.py's; None for a
    group built otherwise), the tensors and parameters it holds, its peak learning rate (before the schedule scales
    it) and its weight decay."""
    return {"class": type(optimizer).__qualname__, "groups": [
        {"name": group.get("name"), "tensors": len(group["params"]),
         "parameters": sum(q.numel() for q in group["params"]),
         "lr": group.get("initial_lr", group["lr"]), "weight_decay": group.get("weight_decay")}
        for group in optimizer.param_groups]}


def launch_command() -> str:
    """The command that started the run: the launcher's (`accelerate launch ...` or `torchrun ...`, read from the
    parent process's command line on Linux) when a launcher started this process, else `python <argv>`."""
    try:
        words = [w.decode() for w in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if w]
    except OSError:  # not Linux
        words = []
    for i, word in enumerate(words):
        if word == "launch" and i and words[i - 1].endswith("accelerate"):  # .../bin/accelerate launch ...
            return shlex.join(["accelerate", *words[i:]])
        if word in ("accelerate.commands.launch", "torch.distributed.run") or word.endswith("/torchrun"):  # -m ...
            launcher = ["accelerate", "launch"] if word.startswith("accelerate") else ["torchrun"]
            return shlex.join([*launcher, *words[i + 1:]])
    return shlex.join(["python", *sys.argv])


def environment() -> dict:
    """Library versions and the code's git commit, for the tracker's config and summary.json."""
    import accelerate
    import safetensors
    import torchvision

    # datasets' version from its installed metadata: a run whose data comes from the decoded cache never imports
    # datasets, and importing it only to read the version costs each process 1.6 s on a 2-core Zen 3.
    return {"versions": {"torch": torch.__version__, "torchvision": torchvision.__version__,
                         "accelerate": accelerate.__version__, "datasets": importlib.metadata.version("datasets"),
                         "safetensors": safetensors.__version__, "python": sys.version.split()[0]},
            "git_commit": git_commit()}


def git_commit() -> str | None:
    """The commit of this checkout, '+dirty' with uncommitted changes; None outside git."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                              timeout=30)
    try:
        head, changes = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if changes.stdout.strip() else "") if head.returncode == 0 else None


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak: memory allocated by tensors on a GPU, else the resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024) / 2**30
