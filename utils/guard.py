"""Guards around the training loop: `MemoryGuard` (an out-of-memory step redone with half the micro-batch) and
`StopGuard` (preemption signals, a dead launcher, a non-finite loss and early stopping, decided on every rank at the
same steps)."""

from __future__ import annotations

import contextlib
import signal

import torch

from utils import UserError
from utils.data.loaders import rebatched
from utils.launch import LAUNCHER_GONE
from utils.plan import BatchPlan, use_plan


class MemoryGuard:
    """An out-of-memory error in a training step (torch.OutOfMemoryError) that changes neither the run nor its
    trajectory: the micro-batch halves and the accumulation doubles, so every optimizer step still trains the same
    global batch, and the step is redone from its start, from the same weights and optimizer state.

    Each micro-step runs in `micro_step()`, which swallows the error and sets `hit`; the loop then leaves the epoch's
    batches and calls `shrink()`: every rank meets in an all-gather of the step it stands at, so all agree before
    anything changes (all ranks of a data-parallel job run the same shapes, so they run out together; a rank that
    did not would be waiting in another collective, and --dist-timeout then ends the job with one line). The new plan
    is printed, kept in every checkpoint (a resume keeps the smaller micro-batch) and in summary.json. BatchNorm
    layers that ran before the error have seen that micro-batch's statistics once more. Under FSDP2 an error inside
    its forward or backward leaves parameters gathered and hooks half-run, so there it stops with one line. Written
    by hand: Accelerate's find_executable_batch_size halves the batch itself, which changes the trajectory."""

    def __init__(self, accelerator, fsdp: bool, loader):
        """loader: the training DataLoader before prepare(), whose dataset and sampler the smaller batches reuse."""
        self.accelerator, self.fsdp, self.loader = accelerator, fsdp, loader
        self.hit = self.shrunk = False  # shrunk: since the last micro-step, the epoch loop is to start over

    @contextlib.contextmanager
    def micro_step(self):
        self.shrunk = False
        try:
            yield
        except torch.OutOfMemoryError:
            self.hit = True

    def shrink(self, progress, optimizer, old: BatchPlan) -> tuple:
        """After `hit`, on every rank: returns (the prepared training loader of the new micro-batches, the new plan:
        `old` halved). The position goes back to the start of the interrupted optimizer step (the epoch loop skips
        to it)."""
        acc = self.accelerator
        steps = acc.gather(torch.tensor([progress.global_step], device=acc.device))  # all ranks meet here
        self.hit = False
        optimizer.zero_grad(set_to_none=True)  # the interrupted step's partial gradients
        if acc.device.type == "cuda":
            torch.cuda.empty_cache()
        where = f"out of memory in training step {progress.global_step + 1} at a micro-batch of {old.micro}"
        if len(set(steps.tolist())) > 1:
            raise UserError(f"{where}, with the ranks at different steps ({steps.tolist()}).")
        if old.micro % 2:
            raise UserError(f"{where}, which cannot be halved: use a smaller --batch-size (the global batch stays with "
                            f"--global-batch-size {old.global_batch}) or a smaller model or image size.")
        if self.fsdp:
            raise UserError(f"{where}; under FSDP2 the step cannot be redone (an error inside its forward or backward "
                            f"leaves its parameters in an unknown state): launch again with --batch-size "
                            f"{old.micro // 2} --global-batch-size {old.global_batch} (the same optimizer steps; "
                            f"--resume auto continues from the last checkpoint).")
        new = old.halved()
        progress.batches_in_epoch = progress.batches_in_epoch // old.accumulation * new.accumulation
        use_plan(acc, new, micro_steps=progress.batches_in_epoch)  # Accelerate's counter, as after a resume
        acc.print(f"{where}: redoing it with {new.micro} x {new.processes} processes x {new.accumulation} "
                  f"accumulation, the same global batch of {new.global_batch}")
        self.shrunk = True
        return acc.prepare(rebatched(self.loader, new.micro)), new


LAUNCHER_GONE_CODE = -1  # in check()'s exchange: this rank's launcher died (a signal is its number; nothing is 0)


class StopGuard:
    """Preemption (SLURM sends SIGTERM, or SIGUSR1 with --signal) and divergence (a nan or inf loss).

    `observe(loss, step)` every micro-step keeps the first bad optimizer step in a device tensor: no host sync.
    `should_stop(step)` is collective: every `every` optimizer steps (or when `now` is set, as before a periodic
    checkpoint) all ranks exchange what they saw, so every rank stops at the same step boundary; it returns True
    when any rank got a signal and raises UserError when any rank saw a non-finite loss. Call `check()` directly
    where a step count does not matter (the end of an epoch, before anything is saved)."""

    def __init__(self, accelerator, every: int, checkpoints):
        self.accelerator, self.every = accelerator, every
        self.checkpoints = checkpoints  # its `.last` (the newest good checkpoint) goes into the divergence error
        self.signals: list[int] = []
        signals = self.signals  # the handlers outlive main(): they must not hold the accelerator and its model (FSDP's
        for sig in (signal.SIGTERM, signal.SIGUSR1):  # hold the process group, which must go before interpreter exit)
            signal.signal(sig, lambda signum, frame: signals.append(signum))
        self.first_bad_step = torch.full((), -1, dtype=torch.long, device=accelerator.device)
        self.preempted = False  # set by should_stop(): the loop then ends, and the script saves no outputs
        self.cause: tuple[int, int] | None = None  # set by check(): (rank, signal number or LAUNCHER_GONE_CODE)

    def observe(self, loss: torch.Tensor, step: int) -> None:
        bad = (self.first_bad_step < 0) & ~torch.isfinite(loss.detach())
        self.first_bad_step = torch.where(bad, step, self.first_bad_step)

    def should_stop(self, step: int, now: bool = False) -> bool:
        """Collective every `every` steps (or `now`); True once any rank got a preemption signal (`preempted`)."""
        self.preempted = (step % self.every == 0 or now) and self.check()
        return self.preempted

    def check(self) -> bool:
        """Collective: raises on any rank's non-finite loss; True when any rank got a signal or lost its launcher,
        and then `cause` holds the first such rank's (rank, signal number, or LAUNCHER_GONE_CODE)."""
        code = self.signals[0] if self.signals else LAUNCHER_GONE_CODE if LAUNCHER_GONE.is_set() else 0
        code = torch.tensor(code, device=self.first_bad_step.device)
        seen = self.accelerator.gather(torch.stack([self.first_bad_step, code]))
        bad, codes = seen.view(-1, 2).unbind(1)
        if (bad >= 0).any():
            raise UserError(f"the loss is not finite (nan or inf) at optimizer step {bad[bad >= 0].min().item()}; "
                            f"stopped. Last good checkpoint: {self.checkpoints.last or 'none'}.")
        stopped = codes.nonzero().flatten().tolist()
        if stopped:
            self.cause = (stopped[0], int(codes[stopped[0]]))
        return bool(stopped)

    def reason(self) -> str:
        """Why the job stopped, the same words on every rank: what the first rank that saw a cause saw (each rank
        watches its own signals and its own launcher, each noticing in its own time)."""
        rank, code = self.cause
        return f"{'the launcher is gone' if code == LAUNCHER_GONE_CODE else f'signal {code}'}, seen by rank {rank}"

    def stop_early(self, progress, patience: int | None) -> bool:
        """--early-stop-patience: True on every rank once `patience` evaluations in a row brought no --best-metric gain
        (Progress counts them). Decided together through Accelerate's trigger (set where the count says so, then an
        all-reduce), so no rank trains on alone; prints one line."""
        if patience is None:
            return False
        if progress.evals_without_gain >= patience:
            self.accelerator.set_trigger()
        if not self.accelerator.check_trigger():
            return False
        where = f"{'in' if progress.batches_in_epoch else 'after'} epoch {progress.epoch_number()}"
        best = "none" if progress.best_value is None else f"{progress.best_value:.6g}"  # None: every value was NaN
        self.accelerator.print(f"early stop at step {progress.global_step} ({where}): {progress.evals_without_gain} "
                               f"evaluations in a row without a gain in {progress.best_metric} (best {best})")
        return True
