"""Where a training run stands: the counters the scripts' loops advance, saved in every checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, replace


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

    def took_batch(self) -> None:
        self.batches_in_epoch += 1

    def took_step(self) -> None:
        self.global_step += 1

    def trained(self, images: int, seconds: float) -> None:
        self.images_seen += images
        self.train_seconds += seconds

    def with_epoch_so_far(self, images: int, seconds: float) -> Progress:
        """A copy that also counts the current epoch's images and time so far: what a mid-epoch checkpoint stores,
        so a job resumed from it reports every image it trained (this object counts them at the epoch's end)."""
        return replace(self, images_seen=self.images_seen + images, train_seconds=self.train_seconds + seconds)

    def end_epoch(self, images: int, seconds: float, batches_per_epoch: int) -> None:
        """Counts the epoch's training images and time; moves to the next epoch if this one is complete (not after a
        --max-steps stop in its middle)."""
        self.trained(images, seconds)
        if self.batches_in_epoch == batches_per_epoch:
            self.epoch += 1
            self.batches_in_epoch = 0

    def summary(self) -> dict:
        return {"epochs_completed": self.epoch, "global_step": self.global_step, "train_images_seen": self.images_seen,
                "train_images_per_sec": self.images_seen / max(self.train_seconds, 1e-9),
                "best_eval_top1": self.best_top1, "best_checkpoint": self.best_checkpoint}

    def is_best(self, top1: float) -> bool:
        """Records a new best evaluation; the checkpoint of this step is then kept by the rotation."""
        if top1 <= self.best_top1:
            return False
        self.best_top1, self.best_checkpoint = top1, f"step-{self.global_step:08d}"
        return True
