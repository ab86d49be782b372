"""The output folder a run owns: writable (`check_output_dir`), one job at a time (`lock_output_dir`, a `with` block
around the job) and room for the next checkpoint (`free_space_warning`)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

from utils import UserError
from utils.launch import raise_if_any

LOCK_FILE = ".lock"
PREPROCESSOR_FILE = "preprocessor_config.json"  # how to feed the weights (utils/export.py)
LIBRARY_CONFIG = "config.json"  # a timm or transformers model's own config (none for the ready models)
SUMMARY_FILE = "summary.json"  # every number of a finished run, written last (utils/export.py)


def check_output_dir(path: str) -> None:
    """One clear error if the output folder cannot be written (it, or the nearest folder above it that exists);
    creates nothing: lock_output_dir makes the folder, and takes it away again if the job fails before writing."""
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise UserError(f"--output-dir {path} cannot be written ({e.strerror or e}).") from None


def make_folder(path: str | Path) -> Path | None:
    """Creates the folder and those above it that are missing; returns the topmost one it created (None: it
    existed). Another process creating the same folder at the same time is not an error."""
    path, made = Path(path), None
    for folder in reversed([path, *path.parents]):
        if not folder.exists():
            try:
                folder.mkdir()
                made = made or folder
            except FileExistsError:
                pass
    return made


def remove_empty(folder: Path) -> None:
    """Removes folder and the folders under it that hold no file, deepest first (rmdir only: nothing written is
    lost)."""
    for here, _, _ in os.walk(folder, topdown=False):
        try:
            os.rmdir(here)
        except OSError:
            pass


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
        self._release = weakref.finalize(self, _release, fd, str(self.path))  # release() or at exit

    def release(self) -> None:
        if getattr(self, "_release", None) is not None:
            self._release()

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            return {}


@contextmanager
def lock_output_dir(accelerator, output_dir: str | Path):
    """`with lock_output_dir(accelerator, cfg.output_dir):` around a job. Collective: the main process makes the
    output folder, takes its lock and holds it until the block ends (or the process dies); if another live job holds
    it, every process raises the same UserError. A job that fails inside the block leaves no folder it made that
    holds no file (a bad input found before training writes nothing)."""
    lock, problem, made = None, None, None
    if accelerator.is_main_process:
        try:
            made = make_folder(output_dir)
            lock = OutputDirLock(output_dir)
            lock.acquire()
        except UserError as e:
            problem = str(e)
        except OSError as e:
            problem = f"--output-dir {output_dir} cannot be written ({e.strerror or e})."
        if lock is not None and lock.taken_over:
            print(f"note: took over the lock of a job that is gone ({describe(lock.taken_over)})", flush=True)
    try:
        raise_if_any(problem)
        yield lock
    except BaseException:
        if lock is not None:
            lock.release()
        if made is not None:
            remove_empty(made)
        raise
    finally:
        if lock is not None:
            lock.release()


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
