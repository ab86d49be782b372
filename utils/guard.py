"""Guards around a run: a writable output folder that one job owns, enough disk for the next checkpoint, and
`StopGuard`: preemption signals and a non-finite loss, checked on every rank at the same steps."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref
from dataclasses import replace
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list

from utils import UserError
from utils.batches import rebatched

LOCK_FILE = ".lock"


LAUNCHER_GONE = threading.Event()  # set by watch_launcher(): this worker's launcher died
LAUNCHER_WATCH_SECONDS = 1.0


def watch_launcher() -> None:
    """Under torchrun (the launcher of `accelerate launch` for several processes) each worker runs in a session of
    its own, so a kill of the launcher, or of its process group, leaves the workers training with nobody watching.
    A daemon thread notices that the parent process is gone (this process was reparented) and sets LAUNCHER_GONE;
    StopGuard then takes the preemption path at its next collective check: a checkpoint, then exit. Started when the
    process starts (utils.launch.run), so a launcher that dies during the first decode is noticed too. Written by
    hand: neither torch nor Accelerate watches the parent (PR_SET_PDEATHSIG would fire when the parent's spawning
    thread ends, not the parent). Under plain `python` the process is in its shell's process group: not watched."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(LAUNCHER_WATCH_SECONDS)
        LAUNCHER_GONE.set()

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


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

    def __init__(self, accelerator, checkpointer, fsdp: bool, loader):
        """loader: the training DataLoader before prepare(), whose dataset and sampler the smaller batches reuse."""
        self.accelerator, self.checkpointer, self.fsdp, self.loader = accelerator, checkpointer, fsdp, loader
        self.hit = self.shrunk = False  # shrunk: since the last micro-step, the epoch loop is to start over

    @contextlib.contextmanager
    def micro_step(self):
        self.shrunk = False
        try:
            yield
        except torch.OutOfMemoryError:
            self.hit = True

    def shrink(self, progress, optimizer):
        """After `hit`, on every rank: returns (the prepared training loader of the new micro-batches, the new plan).
        The position goes back to the start of the interrupted optimizer step (the epoch loop skips to it)."""
        acc, old = self.accelerator, self.checkpointer.plan
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
        new = replace(old, micro=old.micro // 2, accumulation=old.accumulation * 2, halvings=old.halvings + 1)
        self.checkpointer.plan = new
        acc.gradient_accumulation_steps = new.accumulation
        progress.batches_in_epoch = progress.batches_in_epoch // old.accumulation * new.accumulation
        acc.step = progress.batches_in_epoch  # Accelerate's micro-step counter, as after a resume
        acc.print(f"{where}: redoing it with {new.micro} x {new.processes} processes x {new.accumulation} "
                  f"accumulation, the same global batch of {new.global_batch}")
        self.shrunk = True
        return acc.prepare(rebatched(self.loader, new.micro)), new


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

    def observe(self, loss: torch.Tensor, step: int) -> None:
        bad = (self.first_bad_step < 0) & ~torch.isfinite(loss.detach())
        self.first_bad_step = torch.where(bad, step, self.first_bad_step)

    def should_stop(self, step: int, now: bool = False) -> bool:
        """Collective every `every` steps (or `now`); True once any rank got a preemption signal (`preempted`)."""
        self.preempted = (step % self.every == 0 or now) and self.check()
        return self.preempted

    def check(self) -> bool:
        signalled = torch.tensor(len(self.signals) + LAUNCHER_GONE.is_set(), device=self.accelerator.device)
        seen = self.accelerator.gather(torch.stack([self.first_bad_step, signalled]))
        bad, signalled = seen.view(-1, 2).unbind(1)
        if (bad >= 0).any():
            raise UserError(f"the loss is not finite (nan or inf) at optimizer step {bad[bad >= 0].min().item()}; "
                            f"stopped. Last good checkpoint: {self.checkpoints.last or 'none'}.")
        return bool(signalled.any())

    def reason(self) -> str:
        if self.signals:
            return f"signal {self.signals[0]}"
        return "the launcher is gone" if LAUNCHER_GONE.is_set() else "signal on another rank"

    def stop_early(self, progress, patience: int | None) -> bool:
        """--early-stop-patience: True on every rank once `patience` evaluations in a row brought no top-1 gain
        (Progress counts them). Decided together through Accelerate's trigger (set where the count says so, then an
        all-reduce), so no rank trains on alone; prints one line."""
        if patience is None:
            return False
        if progress.evals_without_gain >= patience:
            self.accelerator.set_trigger()
        if not self.accelerator.check_trigger():
            return False
        where = f"{'in' if progress.batches_in_epoch else 'after'} epoch {progress.epoch_number()}"
        self.accelerator.print(f"early stop at step {progress.global_step} ({where}): {progress.evals_without_gain} "
                               f"evaluations in a row without a top-1 gain (best {progress.best_top1:.2f}%)")
        return True


def check_output_dir(path: str) -> None:
    """Creates the output folder; one clear error if it cannot be written."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise UserError(f"--output-dir {path} cannot be written ({e.strerror or e}).") from None


class OutputDirLock:
    """One job per output folder. The global main process holds an exclusive flock on <output_dir>/.lock for the
    job's life; the file names the holder (host, pid, start) for the error a second job prints. The kernel drops
    the lock when its process dies, kill -9 included, so a lock file left by a dead job is simply taken over.
    Written by hand: neither Accelerate nor torch guards an output folder. On NFS, Linux maps flock to a POSIX
    lock held on the server, so this also works across nodes on shared storage."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOCK_FILE
        self.taken_over: dict | None = None  # the holder recorded by a job that died without releasing

    def acquire(self) -> None:
        """Takes the lock or raises UserError naming the job that holds it."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if not isinstance(e, BlockingIOError):  # a filesystem without locks (some FUSE mounts): go unguarded
                    os.close(fd)
                    print(f"warning: cannot lock {self.path} ({e.strerror}); two jobs in this folder would not be "
                          f"stopped", flush=True)
                    return
                holder = self._read(fd)  # another live process holds the lock
                os.close(fd)
                raise UserError(f"--output-dir {self.path.parent} is in use by another job ({describe(holder)}); "
                                f"wait for it to end or use another --output-dir.") from None
            try:
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:  # its holder released (removed) it between our open and flock
                same_file = False
            if same_file:
                break
            os.close(fd)  # locked a file that is no longer the lock file: try the new one
        self.taken_over = self._read(fd) or None
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        weakref.finalize(self, _release, fd, str(self.path))  # when the job's objects go, or at exit

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            return {}


def lock_output_dir(accelerator, output_dir: str | Path) -> OutputDirLock | None:
    """Collective: the main process takes the output folder's lock (keep the returned object for the job's life);
    if another live job holds it, every process raises the same UserError."""
    lock, problem = None, None
    if accelerator.is_main_process:
        lock = OutputDirLock(output_dir)
        try:
            lock.acquire()
        except UserError as e:
            problem = str(e)
        if lock.taken_over:
            print(f"note: took over the lock of a job that is gone ({describe(lock.taken_over)})", flush=True)
    problem = broadcast_object_list([problem])[0]
    if problem:
        raise UserError(problem)
    return lock


def describe(holder: dict) -> str:
    """'host H, pid P, started T' from a lock file's record (question marks for what it lacks)."""
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {holder.get('started', '?')}"


def _release(fd: int, path: str) -> None:
    try:
        os.unlink(path)  # before closing: a job waiting on this file then sees that it was replaced
    except FileNotFoundError:
        pass
    os.close(fd)


def free_space_warning(folder: Path, needed: int) -> str | None:
    """A warning when the filesystem of `folder` has less free space than `needed` bytes (one more checkpoint)."""
    free = shutil.disk_usage(folder).free
    if free >= needed:
        return None
    return (f"only {free / 2**20:,.0f} MiB free on the filesystem of {folder}, less than one checkpoint "
            f"({needed / 2**20:,.0f} MiB): the next save may fail")
