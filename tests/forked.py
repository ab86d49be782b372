"""A fork server for the tests: `python SCRIPT ARGS` and `python -m MODULE ARGS` without paying for the imports.

The suite starts ~90 Python programs, and each spends about 3 s importing torch, torchvision and accelerate. This
server (`python tests/forked.py`, started once by conftest.run_python) imports them once, then for each request
forks a fresh process that runs the script or module as `__main__`, the way the interpreter would: its own process
(and process group), environment, working directory, argv, stdout/stderr files and exit status. Only the imported
libraries are shared; the project's own modules are imported in the child, after its environment is set. Forking
after these imports is safe because the server never runs a torch operation (no thread pool exists yet; checked).

Protocol, one JSON line per request on stdin: {"argv", "env", "cwd", "stdout", "stderr"}; the server answers with
the child's pid, then, when the child has ended, its exit status as subprocess reports it (-N after signal N).

Used for the `accelerate launch` launcher (its training processes are fresh interpreters that it starts) and for
one-process runs whose numbers no test compares bitwise with another process's: bad input, and runs checked against
thresholds or their own files. Bitwise comparisons between processes keep fresh interpreters, because a kernel can
round differently on memory laid out differently.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import threading
import traceback

import accelerate.commands.launch  # noqa: F401  the launcher and, through it, torch and torch.distributed
import safetensors.torch  # noqa: F401
import torch.distributed.tensor  # noqa: F401  what accelerate's prepare imports
import torchvision  # noqa: F401  (it also imports torch._dynamo)


def run(argv: list[str], env: dict, cwd: str, stdout: str, stderr: str) -> int:
    """In the forked child: what `python <argv>` would do, returning its exit status."""
    os.setsid()  # its own process group, so a timeout can stop it and whatever it started
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = argv[1:], cwd
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
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


def serve() -> None:
    assert threading.active_count() == 1, "an import started a thread: forking this process would not be safe"
    requests, answers = sys.stdin, sys.stdout
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os._exit(run(**request))
        answers.write(f"{pid}\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(f"{os.waitstatus_to_exitcode(status)}\n")
        answers.flush()


if __name__ == "__main__":
    serve()
