"""A fork server for the tests: `python SCRIPT ARGS`, `python -m MODULE ARGS` and `python -c CODE ARGS` without paying
for the imports.

A full run of the suite starts about 200 Python processes, and on a slow 2-core CPU each spends about 8 s importing
torch, torchvision and accelerate. This server (`python tests/forked.py`, started once by conftest's Forked) imports
them once, then for each request forks a fresh process that runs the script or module as `__main__`, the way the
interpreter would: its own process (and process group), environment, working directory, argv, stdout/stderr files,
thread count (OMP_NUM_THREADS) and exit status. Only the imported libraries are shared; the project's own modules are
imported in the child, after its environment is set (as are datasets and huggingface_hub, which read HF_* variables at
import; the server imports only their dependencies that read none). Forking after these imports is safe because the
server never runs a torch operation (no thread pool exists yet; checked); the imported objects are frozen out of the
children's garbage collections (gc.freeze), which would otherwise scan them all at every full collection. Several
children may run at once: a test's background job (conftest.start) while the test runs another command.

With fork_workers, the child is the `accelerate launch` launcher and torchrun forks its workers from it as well, instead
of starting `python -u SCRIPT` (fork_torchrun_workers; docs/performance.md has what it saves). The workers are real
processes of torchrun's, in sessions of their own, with torchrun's environment, running the real script; what differs is
what /proc shows of them: the server's command line and initial environment, and the name `rankN` (comm), by which
conftest.workers finds them for the tests that signal or kill one. Bitwise comparisons between a forked 2-rank job and a
fresh one-process run hold (tests/test_distributed.py's ddp_jobs). Not used on a machine with CUDA, whose
driver must not be initialised before a fork.

Protocol, one JSON line per request on stdin: {"argv", "env", "cwd", "stdout", "stderr", "fork_workers"}; the server
answers `started PID` at once and `ended PID STATUS` when the child has ended (STATUS as subprocess reports it: -N
after signal N).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings

import accelerate.commands.launch  # noqa: F401  the launcher and, through it, torch and torch.distributed
import safetensors.torch  # noqa: F401
import torch
import torch.distributed.tensor  # noqa: F401  what accelerate's prepare imports
import torchvision  # noqa: F401  (it also imports torch._dynamo)

# What `datasets` imports that reads no environment variable at import (datasets and huggingface_hub themselves read
# HF_HOME, HF_HUB_OFFLINE and others then, which tests set per run: the child imports those two)
for _name in ("pandas", "pyarrow.parquet", "fsspec", "httpx2", "trio", "anyio", "filelock", "multiprocess", "xxhash",
              "cloudpickle"):
    with contextlib.suppress(ImportError):  # a version of datasets that needs fewer of them
        importlib.import_module(_name)

# The server's sys.path after its own folder, less what its own $PYTHONPATH put there
BASE_PATH = [p for p in sys.path[1:]
             if p not in {os.path.abspath(q) for q in os.environ.get("PYTHONPATH", "").split(os.pathsep) if q}]
POLL = 0.02  # seconds between the server's checks for ended children
# The signal handlers a fresh interpreter starts with (what a forked worker restores; the rest SIG_DFL)
PYTHON_SIGNALS = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN}


def run(argv: list[str], env: dict, cwd: str, stdout: str, stderr: str, fork_workers: bool = False) -> int:
    """In the forked child: what `python <argv>` would do, returning its exit status. fork_workers: argv is the
    `accelerate launch` launcher, and torchrun forks its workers from it too (fork_torchrun_workers)."""
    os.setsid()  # its own process group, so a timeout can stop it and whatever it started
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    if fork_workers:
        fork_torchrun_workers()
    return become(argv, env, cwd)


def become(argv: list[str], env: dict, cwd: str, unbuffered: bool = False) -> int:
    """Run `python <argv>` in this process, its stdio set already: the exit status the interpreter would give.
    unbuffered: as `python -u` (as PYTHONUNBUFFERED in env, without setting it for the processes this one starts)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS"):  # a fresh interpreter's OpenMP reads it as torch loads; here torch is loaded
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    reopen_stdio(unbuffered=unbuffered or bool(env.get("PYTHONUNBUFFERED")))
    # sys.path as the interpreter builds it: the script's folder (-m, -c: the working directory), $PYTHONPATH, the rest
    first = cwd if argv[0] in ("-m", "-c") else os.path.dirname(os.path.abspath(argv[0]))
    sys.path[:] = [first, *(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p), *BASE_PATH]
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        status = 1
    threading._shutdown()  # as the interpreter does at exit: wait for non-daemon threads, then the atexit functions
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return status


def reopen_stdio(unbuffered: bool) -> None:
    """sys.stdout and sys.stderr on file descriptors 1 and 2 as the interpreter opens them: stderr line-buffered,
    both unbuffered under `python -u` or PYTHONUNBUFFERED (what a test reading a killed process's output needs)."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        raw = open(fd, "wb", buffering=0, closefd=False)  # noqa: SIM115  the interpreter's own streams, never closed
        setattr(sys, name, io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=old.encoding,
                                            errors=old.errors, line_buffering=name == "stderr" and not unbuffered,
                                            write_through=unbuffered))


def name_process(name: str) -> None:
    """Sets what /proc/PID/comm (psutil's name(), `ps -o comm`) shows for this process: a forked worker's command
    line and initial environment are the server's, so conftest.workers finds it and its rank by this name."""
    ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME (Linux)


class ForkedWorker:
    """What torchrun's agent uses of a worker's subprocess.Popen (pid, poll, wait), for a worker forked from it."""

    def __init__(self, pid: int, args):
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode


def fork_torchrun_workers() -> None:
    """torchrun starts each worker as `python -u SCRIPT ARGS` (subprocess.Popen, new session); here it forks this
    launcher instead, and the child runs the script as that command would: its own session, torchrun's environment
    and stdio, Python's default signal handlers, no file descriptor of the launcher beyond stdio."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    def popen(handler, args: tuple, env: dict) -> ForkedWorker:
        argv = [a for a in args[1:] if a != "-u"]  # args[0] is the interpreter; -u: become(unbuffered=True)
        sys.stdout.flush()
        sys.stderr.flush()
        with warnings.catch_warnings():  # Python 3.12+ warns of forking a process with threads (torchrun's store)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid:
            return ForkedWorker(pid, args)
        status = 1
        try:
            os.setsid()
            name_process(f"rank{env.get('RANK', '')}")
            for number in set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}:
                with contextlib.suppress(OSError, ValueError):
                    signal.signal(number, PYTHON_SIGNALS.get(number, signal.SIG_DFL))
            for fd, file in ((1, handler._stdout), (2, handler._stderr)):
                if file is not None:
                    os.dup2(file.fileno(), fd)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            status = become(argv, env, os.getcwd(), unbuffered=True)
        finally:
            os._exit(status)

    SubprocessHandler._popen = popen


def serve() -> None:
    """Requests on stdin, answers on stdout, until stdin closes; many children may run at once (a test's background
    job while it runs another). A child that ends is reaped within POLL seconds."""
    assert threading.active_count() == 1, "an import started a thread: forking this process would not be safe"
    gc.freeze()  # the imports' objects live as long as the server: a child's collections need not scan them
    pending, running = b"", set()

    def answer(line: str) -> None:
        os.write(1, f"{line}\n".encode())

    while True:
        if select.select([0], [], [], POLL)[0]:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return  # the tests have ended; a child still running is on its own, as after subprocess.Popen
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    os._exit(run(**json.loads(line)))
                running.add(pid)
                answer(f"started {pid}")
        for pid in list(running):
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended:
                running.discard(pid)
                answer(f"ended {pid} {os.waitstatus_to_exitcode(status)}")


if __name__ == "__main__":
    serve()
