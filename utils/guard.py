"""Guards around a run: a writable output folder that one job owns, enough memory to decode the data, enough disk
for the next checkpoint, and `StopGuard`: preemption signals and a non-finite loss, checked on every rank at the
same steps."""

from __future__ import annotations

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
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list

from utils import UserError

LOCK_FILE = ".lock"


def available_memory() -> int | None:
    """Bytes of memory available now (Linux's MemAvailable); None where the kernel does not say."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def check_memory(images: int, size: int) -> None:
    """Stops before decoding if the uint8 tensors would not fit in the memory available now (no check where that is
    unknown). The cache write needs a second copy of each split for a moment, so twice the tensors' size counts."""
    needed, available = 2 * images * 3 * size * size, available_memory()
    if available is not None and needed > available:
        raise UserError(f"decoding {images:,} images at {size}x{size} needs about {needed / 2**30:,.1f} GiB of memory "
                        f"(the uint8 tensors and a copy for the cache), more than the {available / 2**30:,.1f} GiB "
                        f"available; use a smaller --image-size or fewer images.")


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
