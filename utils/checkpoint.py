"""Checkpoints that count only when complete, for any script that trains with Accelerate.

A checkpoint is a folder `<root>/step-00000123/` written as
  1. `accelerator.save_state(<root>/.tmp-step-00000123)`: model, optimizer, grad scaler, RNG of every rank;
  2. `trainer_state.json` (counters, config, batch plan, tracker run id, scheduler) with a manifest: size and
     sha256 of every other file in the folder;
  3. one atomic rename to the final name.
A crash at any point leaves either no new checkpoint or a `.tmp-` folder that resume never trusts. At resume
the manifest is checked, so a checkpoint truncated or corrupted later is skipped with a warning and the
previous one is used. Nothing here deletes a checkpoint it could not verify.

A checkpoint resumes on any process count: the weights and optimizer state are whole under DDP and resharded by
torch.distributed.checkpoint under FSDP2, the augmentation is keyed by the sample (utils.data.draws.augment_draws), the
position in the epoch is converted through global samples and the global batch is kept (utils.plan.plan_batches).

The run folder's other files (model.safetensors, best.safetensors: `export_weights`; preprocessor_config.json,
summary.json: `write_files`, for utils/export.py) are written here too: atomically, and a failed write names the last
good checkpoint.

Written by hand because Accelerate's save_state/load_state (which this uses for the contents) has no notion
of completeness, and its custom-object checkpointing pickles (`weights_only=False`), which we avoid.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import time
import warnings
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException

from utils import UserError, write_atomically
from utils.cli import write_config_file
from utils.launch import first_error, share_bn_statistics
from utils.output_dir import SUMMARY_FILE, free_space_warning
from utils.plan import BatchPlan, use_plan
from utils.progress import Progress
from utils.scripts import script_record

if TYPE_CHECKING:
    from utils.config_groups import CheckpointConfig

STATE_FILE = "trainer_state.json"
FORMAT = 3  # 3: the best evaluation by any metric, the loss terms' sums (2: by top-1; 1: per-rank augmentation)
NAME = re.compile(r"step-(\d{8})")
# Flags that say how a job runs, how long, or what it reports, not what it trains: a resumed run may give them other
# values (the batch flags: utils.plan keeps the checkpoint's global batch on another process count). Any other
# difference stops the resume, naming the values.
HOW_A_JOB_RUNS = {"resume", "overwrite", "output_dir", "cache_dir", "epochs", "max_steps", "batch_size", "grad_accum",
                  "global_batch_size", "decode", "decode_workers", "data_workers", "read_ahead", "dist_timeout",
                  "deterministic", "compile", "profile", "init_from", "keep_last", "checkpoint_every_steps",
                  "eval_every_steps", "ema_decay", "metric", "tracker", "wandb_project", "run_name", "group", "tags",
                  "wandb_log_model", "log_predictions", "log_every", "progress_every", "push_to_hub"}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(folder: Path) -> dict[str, list]:
    return {p.relative_to(folder).as_posix(): [p.stat().st_size, _sha256(p)]
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != STATE_FILE}


def problem(folder: Path) -> str | None:
    """Why `folder` cannot be trusted as a complete checkpoint, or None if it can."""
    try:
        state = json.loads((folder / STATE_FILE).read_text())
        files = state["files"]
    except FileNotFoundError:
        return f"no {STATE_FILE}: not a checkpoint"
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable {STATE_FILE} ({e})"
    for name, (size, digest) in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is truncated ({path.stat().st_size} of {size} bytes)"
        if _sha256(path) != digest:
            return f"{name} is corrupt (checksum mismatch)"
    return None


def read_state(folder: Path) -> dict:
    return json.loads((Path(folder) / STATE_FILE).read_text())


def step_folders(root: Path) -> list[Path]:
    """Checkpoint folders by step, oldest first (by name only; `problem` says whether each is sound)."""
    return sorted(p for p in Path(root).glob("step-*") if p.is_dir() and NAME.fullmatch(p.name))


def finished(root: Path) -> list[Path]:
    """Checkpoint folders whose save ran to the end (they hold the state file), oldest first; cheap, no hashing."""
    return [p for p in step_folders(root) if (p / STATE_FILE).is_file()]


def newest_sound(root: Path, warn=warnings.warn) -> Path | None:
    """The newest checkpoint whose manifest verifies; each newer one that does not is reported, not deleted."""
    for folder in reversed(step_folders(root)):
        why = problem(folder)
        if why is None:
            return folder
        warn(f"skipping checkpoint {folder}: {why}")
    return None


# What a failed write raises: OSError (Python), SafetensorError (safetensors' Rust writer), RuntimeError (torch.save's
# C++ writer: "basic_ios::clear: iostream error", "PytorchStreamWriter failed writing file ... file write failed"),
# and torch.distributed.checkpoint's CheckpointException, a BaseException that reports every rank's failure.
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError, CheckpointException)
# torch's zip writer (inline_container.cc) may also report the failure as "unexpected pos N vs M", with the
# iostream error as its context.
TORCH_WRITE_FAILURE = re.compile(r"iostream error|file write failed|PytorchStreamWriter|inline_container|No space left",
                                 re.IGNORECASE)


def write_error(error: BaseException) -> BaseException:
    """`error` itself when it is a failed write; any other RuntimeError (a bug, a peer that died) is raised again."""
    chain = f"{error} {error.__context__} {error.__cause__}"
    if isinstance(error, RuntimeError) and not TORCH_WRITE_FAILURE.search(chain):
        raise error
    return error


def save(accelerator, root: Path, step: int, state: dict, extra=()) -> Path:
    """Writes checkpoint `step` (every process must call this); returns its final folder. `extra`: objects whose
    collective `save(folder)` adds files (the EMA). A failed write (a full disk, a quota, an I/O error) on any rank
    raises the same UserError on every rank, after the partial folder is removed: earlier checkpoints are
    untouched."""
    root = Path(root)
    name = f"step-{step:08d}"
    tmp, final = root / f".tmp-{name}", root / name
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover from a crash during an earlier save
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    error = None
    try:  # every rank writes its part (its shards under FSDP, its RNG states)
        accelerator.save_state(str(tmp))
        for obj in extra:
            obj.save(tmp)
    except WRITE_ERRORS as e:
        error = write_error(e)
    raise_if_write_failed(accelerator, error, tmp, root, remove=tmp)
    try:  # the main process completes the checkpoint
        if accelerator.is_main_process:
            state = {**state, "files": _manifest(tmp)}
            with open(tmp / STATE_FILE, "w") as f:
                json.dump(state, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            if final.exists():  # the same step saved before: resume skipped it (unsound) or started earlier; keep it
                final.rename(root / f"{name}.{'unsound' if problem(final) else 'replaced'}-{int(time.time())}")
            os.replace(tmp, final)
    except WRITE_ERRORS as e:
        error = write_error(e)
    raise_if_write_failed(accelerator, error, tmp, root, remove=tmp)
    if accelerator.is_main_process:
        size = sum(size for size, _ in state["files"].values())
        low = free_space_warning(root, size)
        if low:
            print(f"warning: {low}", flush=True)
    return final


def raise_if_write_failed(accelerator, error: BaseException | None, target: Path, root: Path,
                         remove: Path | None = None) -> None:
    """Collective: every rank learns whether any rank failed to write `target`; then all raise one UserError
    (printed once) naming the last good checkpoint, after the main process removed the partial folder `remove`."""
    problem = first_error(_describe(error, target) if error is not None else None)
    if problem is None:
        return
    if accelerator.is_main_process and remove is not None:
        shutil.rmtree(remove, ignore_errors=True)
    last = newest_sound(root, warn=lambda message: None)
    raise UserError(f"{problem}; last good checkpoint: {last or 'none'}")


def _describe(error: BaseException, target: Path) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    free = shutil.disk_usage(target.parent if not target.exists() else target).free
    full = getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error) or free < 16 * 2**20
    if full:
        return f"no space left on device writing {target} ({free / 2**20:,.0f} MiB free; {text})"
    return f"could not write {target} ({text})"


def export_weights(accelerator, model, path: Path) -> None:
    """Full, unwrapped weights (no 'module.' or '_orig_mod.' prefix) as safetensors, written by the main process
    (`write_files`). Collective."""
    state = accelerator.get_state_dict(accelerator.unwrap_model(model, keep_torch_compile=False))
    path, tensors = Path(path), {k: v.contiguous() for k, v in state.items()}
    write_files(accelerator, path.parent, {path.name: partial(save_file, tensors)})


def write_files(accelerator, folder: Path, files: dict[str, object]) -> None:
    """Files of the run folder `folder` (exported weights, its JSON files), each written by the main process as
    write_atomically writes it (`files`: name -> text, or a function that writes the file it is given), so a failed
    write leaves the previous file whole; a failure raises one UserError on every rank naming the last good
    checkpoint in folder/checkpoints. Collective: every rank calls it; the main process's `files` are written."""
    error, target = None, Path(folder)
    if accelerator.is_main_process:
        for name, content in files.items():
            target = Path(folder) / name
            try:
                write_atomically(target, content)
            except WRITE_ERRORS as e:
                error = write_error(e)
                break
    raise_if_write_failed(accelerator, error, target, Path(folder) / "checkpoints")


def load(accelerator, folder: Path) -> dict:
    """Restores what save() wrote into the prepared objects (on this run's process count; Accelerate's RNG states
    of processes the saving run did not have are left as seeded); returns the trainer state."""
    folder = Path(folder)
    state = read_state(folder)
    if state.get("format") != FORMAT:
        raise UserError(f"checkpoint {folder} was written by an earlier version of this template (checkpoint format "
                        f"{state.get('format', 1)}, this one reads {FORMAT}) and cannot be continued exactly; start "
                        f"over with --overwrite.")
    try:
        accelerator.load_state(str(folder))
    except RuntimeError as e:  # e.g. size mismatch: weights of another model
        raise UserError(f"checkpoint {folder} does not fit this model: {str(e).strip().splitlines()[0]}") from None
    return state


def rotate(root: Path, keep_last: int, keep: set[str]) -> None:
    """Deletes finished checkpoints older than the newest `keep_last`, except those named in `keep` (the best)."""
    for folder in finished(root)[:-keep_last]:
        if folder.name not in keep:
            shutil.rmtree(folder)


class Checkpointer:
    """A training script's checkpoint policy: where (<output-dir>/checkpoints), when (`due(step)`: every N optimizer
    steps, and after each evaluation within an epoch; the script also saves at each epoch's end), what
    (`save(progress, ...)`: Accelerate's registered objects, the EMA, the counters, config, batch plan and
    scheduler), how many (the newest `keep_last`, plus the best) and the best evaluation's weights (`save_best`).
    `last` is the newest checkpoint written or resumed from."""

    def __init__(self, accelerator, cfg: CheckpointConfig, tracker=None):
        """cfg: the script's Config; its checkpoint flags set the policy, and the whole of it goes into every
        checkpoint (to compare with on resume). `tracker` (utils.tracking.Tracker) hears of each checkpoint saved
        (--wandb-log-model checkpoints)."""
        self.accelerator, self.script, self.tracker = accelerator, script_record(cfg), tracker
        self.config = json.loads(json.dumps(asdict(cfg)))  # as a checkpoint saves it (tuples as lists): comparable
        self.root = Path(cfg.output_dir) / "checkpoints"
        self.keep_last, self.every_steps = cfg.keep_last, cfg.checkpoint_every_steps
        self.last: Path | None = None
        self.ema = None  # set by start(): the weights' EMA (--ema-decay), saved with every checkpoint
        self.saved_step: int | None = None  # the step this job last saved (a second save of it is skipped)

    def save_best(self, model) -> None:
        """`model`'s full weights (as they are now: the EMA's inside ema.applied()) as <output-dir>/best.safetensors,
        written as export_weights writes (collective): the evaluator calls it for each new best evaluation."""
        export_weights(self.accelerator, model, self.root.parent / "best.safetensors")

    def resume_point(self) -> Path | None:
        """The checkpoint to continue from (--resume auto or a folder), None to start fresh; refuses to start over
        another run's checkpoints unless --overwrite, and to continue a run trained with other values."""
        resume = self.config["resume"]
        if resume is None:
            earlier = finished(self.root)
            if earlier and not self.config["overwrite"]:
                differ = self.differences(read_state(earlier[-1]).get("config", {}))
                advice = ("use another --output-dir, or --overwrite to delete it and start over" if differ else
                          "pass --resume auto to continue it, --overwrite to start over, or another --output-dir")
                raise UserError(f"{self.root.parent} holds checkpoints of an earlier run"
                                f"{f' trained with other values ({differ})' if differ else ''}; {advice}.")
            return None
        if resume == "auto":
            path = newest_sound(self.root, warn=lambda m: self.accelerator.print(f"warning: {m}"))
        else:
            path = Path(resume)
            if not path.is_dir():
                raise UserError(f"--resume {path} does not exist (or is not a folder).")
            why = problem(path)
            if why is not None:
                raise UserError(f"--resume {path} is not a usable checkpoint: {why}.")
        if path is not None and (differ := self.differences(read_state(path).get("config", {}))):
            raise UserError(f"--resume {resume}: {path} was trained with other values ({differ}); give the same "
                            f"values to continue it, or start another run in another --output-dir.")
        self.last = path
        return path

    def differences(self, theirs: dict) -> str:
        """The values, other than HOW_A_JOB_RUNS, in which a checkpoint's config `theirs` differs from this run's
        ('lr 0.1 there, 0.05 here; ...'; empty when none). A key the checkpoint lacks (a field added since) is
        taken as equal."""
        return "; ".join(f"{k} {json.dumps(theirs[k])} there, {json.dumps(v)} here" for k, v in self.config.items()
                         if k not in HOW_A_JOB_RUNS and theirs.get(k, v) != v)

    def finished_run(self, folder: Path | None) -> dict | None:
        """The summary of a finished run when `folder` (the resume point) is its last checkpoint: its epochs done (or
        --max-steps, or an early stop) and its summary.json written. Said aloud; the script then trains nothing and
        rewrites nothing (summary.json, the weights, the tracker's run stay as they are). None otherwise."""
        summary_file = self.root.parent / SUMMARY_FILE
        state = read_state(folder) if folder is not None and summary_file.is_file() else {}
        if state.get("format") != FORMAT:
            return None  # none, or a checkpoint of another format: refused with its reason where it is loaded
        done, epochs, max_steps = state["progress"], self.config["epochs"], self.config.get("max_steps")
        if not (done["epoch"] >= epochs or done["stopped_early"] or (max_steps and done["global_step"] >= max_steps)):
            return None
        try:
            summary = json.loads(summary_file.read_text())
        except (OSError, ValueError) as e:  # damaged after the run wrote it: the run's outputs are written anew
            self.accelerator.print(f"warning: {summary_file} does not read ({type(e).__name__}); the run's outputs "
                                   f"are written again from its last checkpoint")
            return None
        self.accelerator.print(f"the run in {self.root.parent} is finished (epoch {done['epoch']} of {epochs}, step "
                               f"{done['global_step']}): nothing to train; its outputs are left as they are (raise "
                               f"--epochs to train it further)")
        return summary

    @staticmethod
    def saved_plan(folder: Path | None) -> dict | None:
        """The batch plan checkpoint `folder` was saved with (None: a fresh start), for utils.plan.plan_batches."""
        return read_state(folder).get("batch") if folder else None

    def restore(self, folder: Path, scheduler, plan: BatchPlan) -> dict:
        """Loads `folder` into the prepared objects and the scheduler; returns the saved progress counters, the
        position in the epoch converted to this run's micro-batches (through global samples: the same images come
        next on any process count). Warns about config values that differ from the run that saved it."""
        saved = load(self.accelerator, folder)
        if self.ema is not None:
            self.ema.load(folder)
        changed = [k for k, v in self.config.items() if k not in ("resume", "overwrite", "output_dir", "cache_dir")
                   and saved["config"].get(k, v) != v]  # not how it starts, nor where (a run's folder may move)
        if changed:
            self.accelerator.print(f"warning: resuming with a changed config: {', '.join(changed)}")
        scheduler.load_state_dict(saved["scheduler"])
        progress, was, now = saved["progress"], saved["batch"], plan
        samples = progress["batches_in_epoch"] * was["micro"] * was["processes"]
        batches, rest = divmod(samples, now.micro * now.processes)
        if rest:
            raise UserError(f"checkpoint {folder} stopped {samples} images into its epoch, not a whole number of "
                            f"micro-batches of {now.micro} on {now.processes} processes; resume with --batch-size "
                            f"{was['micro']}.")
        progress["batches_in_epoch"] = batches
        # Accelerate's micro-step counter comes from the saving run's rank files (none for a new rank); it counts the
        # epoch's micro-batches: the converted position.
        use_plan(self.accelerator, plan, micro_steps=batches)
        epochs, step = self.config["epochs"], progress["global_step"]
        self.accelerator.print(f"resumed from {folder}: " + (
            f"epoch {progress['epoch'] + 1} after {samples} of its images, step {step}" if progress["epoch"] < epochs
            else f"its {epochs} epochs are trained (step {step}); writing the run's outputs"))
        return progress

    def start(self, folder: Path | None, scheduler, plan: BatchPlan, ema=None) -> Progress:
        """Where the run starts: the progress of checkpoint `folder`, restored with all it holds (`restore`; `ema`,
        utils.ema.WeightEMA or None, too), or a fresh Progress. --overwrite deletes the earlier run's checkpoints only
        here, once every check that could stop the job (flags, data, the launch) has passed with the old run
        intact."""
        self.ema = ema
        if folder:
            return Progress(**self.restore(folder, scheduler, plan))
        if self.config["overwrite"]:
            self.clear()
        return Progress()

    def clear(self) -> None:
        """--overwrite: deletes the earlier run's checkpoints (collective)."""
        if self.accelerator.is_main_process:
            shutil.rmtree(self.root, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def due(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def after_step(self, progress, meter, model, scheduler, plan: BatchPlan, batches_per_epoch: int,
                   evaluated: bool, stopping: bool) -> None:
        """The loop's call after every optimizer step. Saves a mid-epoch checkpoint every --checkpoint-every-steps
        steps and after an evaluation within the epoch (`evaluated`: its best weights then have their checkpoint;
        the epoch's end saves its own, after evaluation), and where a job that is `stopping` (the guard's collective
        decision, so every rank stops at the same step) stops."""
        due = self.due(progress.global_step) or evaluated
        if stopping or (due and progress.batches_in_epoch < batches_per_epoch):
            # the epoch's images so far are counted, so a job resumed from here reports every image it trained
            so_far = progress.with_epoch_so_far(meter.images(), meter.seconds(), meter.so_far(self.accelerator))
            self.save(so_far, model, scheduler, plan)

    def save(self, progress, model, scheduler, plan: BatchPlan) -> Path:
        """Collective: checkpoint at progress.global_step, then drop the old ones (keeping progress.best_checkpoint).
        A step this job saved already (an early stop within the epoch, then the epoch's end) is not saved again."""
        if self.saved_step == progress.global_step:
            return self.last
        share_bn_statistics(self.accelerator, model)  # FSDP would save one arbitrary rank's
        state = {"format": FORMAT, "progress": progress.state(), "config": self.config, "script": self.script,
                 "world_size": self.accelerator.num_processes, "batch": asdict(plan),
                 "scheduler": scheduler.state_dict()}
        extra = [self.ema] if self.ema is not None else []
        self.last = save(self.accelerator, self.root, progress.global_step, state, extra)
        if self.saved_step is None and self.accelerator.is_main_process:  # this job's first checkpoint: its flags
            write_config_file(self.config, self.root.parent)  # beside, as config.yaml (utils.cli.write_config_file)
        self.saved_step = progress.global_step
        if self.tracker is not None:
            self.tracker.log_model("checkpoint", self.last, progress.global_step)
        if self.accelerator.is_main_process:
            rotate(self.root, self.keep_last, keep={progress.best_checkpoint})
        return self.last
