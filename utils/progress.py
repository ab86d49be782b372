"""Where a training run stands: the counters the scripts' loops advance, saved in every checkpoint."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint, restored on resume."""
    epoch: int = 0  # current epoch, from 0
    batches_in_epoch: int = 0  # micro-batches each process has taken from the current epoch
    global_step: int = 0  # optimizer steps done
    images_seen: int = 0  # training images, all processes
    train_seconds: float = 0.0  # training time without evaluation
    best_metric: str | None = None  # the metric (--best-metric) that best_value, gains and best_checkpoint follow
    best_mode: str = "max"  # max: higher is better; min: lower
    best_value: float | None = None  # the best evaluation's value of best_metric
    best_checkpoint: str | None = None  # kept by the rotation
    tracker_run_id: str | None = None  # the W&B run a resumed job continues
    evals_without_gain: int = 0  # evaluations in a row that did not beat gain_value by --early-stop-min-delta
    gain_value: float | None = None  # best_metric's value at the last evaluation that did (a gain)
    stopped_early: bool = False  # --early-stop-patience ended the run
    train_loss: float = math.nan  # the mean training loss of the last epoch trained (or its part before a stop)
    train_loss_terms: dict = field(default_factory=dict)  # the means of compute_loss's named terms, likewise
    wall_seconds: float = 0.0  # wall time of the run's earlier jobs, from their start of training to their last save
    loss_so_far: dict | None = None  # a mid-epoch checkpoint's: the loss and terms' sums so far (TrainMeter.so_far)

    def __post_init__(self):
        self._clock = time.monotonic()  # this job's share of the wall time counts from here (not a field: not saved)

    def wall(self) -> float:
        """The run's wall time so far, over all its jobs: the earlier ones' (to their last checkpoint) and this one's
        (from its start of training: after its data and model are ready)."""
        return self.wall_seconds + time.monotonic() - self._clock

    def state(self) -> dict:
        """What a checkpoint saves: the fields, with the wall time up to now."""
        return {**asdict(self), "wall_seconds": self.wall()}

    def epoch_number(self) -> int:
        """The epoch (from 1) the run is in, or has just completed at an epoch's end."""
        return self.epoch + (self.batches_in_epoch > 0)

    def took_batch(self) -> None:
        self.batches_in_epoch += 1

    def took_step(self) -> None:
        self.global_step += 1

    def trained(self, images: int, seconds: float) -> None:
        self.images_seen += images
        self.train_seconds += seconds

    def with_epoch_so_far(self, images: int, seconds: float, losses: dict) -> Progress:
        """A copy that also counts the current epoch's images, time and loss sums so far: what a mid-epoch checkpoint
        stores, so a job resumed from it reports every image it trained (this object counts them at the epoch's
        end) and logs the losses the uninterrupted epoch logs."""
        return replace(self, images_seen=self.images_seen + images, train_seconds=self.train_seconds + seconds,
                       wall_seconds=self.wall(), loss_so_far=losses)

    def resumed_losses(self) -> dict | None:
        """The loss sums a mid-epoch checkpoint carried into this epoch, handed over once (to the epoch's meter)."""
        losses, self.loss_so_far = self.loss_so_far, None
        return losses

    def end_epoch(self, losses: dict, images: int, seconds: float, batches_per_epoch: int) -> None:
        """Counts the epoch's mean loss and loss terms (TrainMeter.end_epoch), training images and time; moves to the
        next epoch if this one is complete (not after a --max-steps stop in its middle)."""
        self.trained(images, seconds)
        self.train_loss = losses["loss"]
        self.train_loss_terms = {name: value for name, value in losses.items() if name != "loss"}
        if self.batches_in_epoch == batches_per_epoch:
            self.epoch += 1
            self.batches_in_epoch = 0

    def summary(self) -> dict:
        return {"epochs_completed": self.epoch, "global_step": self.global_step, "train_loss": self.train_loss,
                "train_loss_terms": self.train_loss_terms, "train_images_seen": self.images_seen,
                "train_images_per_sec": self.images_seen / max(self.train_seconds, 1e-9), "wall_seconds": self.wall(),
                **self.best()}

    def best(self) -> dict:
        """The best evaluation, for summary.json: best_metric, its mode, best_eval_<metric> (after an evaluation)."""
        value = {f"best_eval_{self.best_metric}": self.best_value} if self.best_metric else {}
        return {"best_metric": self.best_metric, "best_metric_mode": self.best_mode, **value,
                "best_checkpoint": self.best_checkpoint, "evals_without_gain": self.evals_without_gain,
                "stopped_early": self.stopped_early}

    def is_best(self, metric: str, mode: str, value: float, min_delta: float = 0.0) -> bool:
        """Records an evaluation's `value` of `metric` (mode max: higher is better, min: lower); True when it is the
        best so far (the checkpoint of this step is then kept by the rotation). Counts the evaluations in a row
        without a gain (--early-stop-patience): a gain beats the last gain's value by more than `min_delta`; the first
        evaluation is one. A NaN is neither. Another metric than the recorded one (a resume with another
        --best-metric) starts the record afresh."""
        if (metric, mode) != (self.best_metric, self.best_mode):
            self.best_metric, self.best_mode, self.best_value, self.gain_value = metric, mode, None, None
            self.evals_without_gain = 0
        sign = 1.0 if mode == "max" else -1.0
        if not math.isnan(value) and (self.gain_value is None or sign * (value - self.gain_value) > min_delta):
            self.gain_value, self.evals_without_gain = value, 0
        else:
            self.evals_without_gain += 1
        if math.isnan(value) or (self.best_value is not None and sign * (value - self.best_value) <= 0):
            return False
        self.best_value, self.best_checkpoint = value, f"step-{self.global_step:08d}"
        return True
