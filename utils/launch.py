"""How a training script's process ends: `sys.exit(run(lambda: main(parse_config())))` turns a UserError (exit 2)
or a peer that died or hung (exit 1) into one line, and frees the process group before the interpreter shuts down."""

from __future__ import annotations

import gc
import os
import re
import sys

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from utils import UserError


def run(job) -> int:
    """Calls job(), then returns the exit status: 0; 2 after a UserError (printed once, by global rank 0: every
    process raises it at the same point); 1 when a peer process died or hung (printed by every process that
    saw it). Other exceptions propagate with their traceback."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        job()
        status = 0
    except UserError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        status = 2
    except RuntimeError as e:  # torch.distributed.DistBackendError is one
        why = peer_failure(str(e))
        if why is None:
            raise
        print(f"error: {why}; this process (rank {rank}) stopped. Continue with --resume auto: it takes the newest "
              f"complete checkpoint (one being written is never used).", file=sys.stderr, flush=True)
        status = 1
    release_process_group()  # the job's frames (and the traceback's) are gone by now
    return status


def peer_failure(message: str) -> str | None:
    """What a collective's error says about the other processes, in words; None if it is about something else."""
    waited = re.search(r"Timed out waiting (\d+)\s*ms|Timeout\(ms\)=(\d+)", message)  # gloo | NCCL's watchdog
    if waited:
        seconds = int(next(g for g in waited.groups() if g)) / 1000
        return (f"a peer process did not answer within --dist-timeout {seconds:g} s (it hangs, or its machine is "
                f"unreachable)")
    if re.search(r"Connection (closed|reset) by peer|Broken pipe", message, re.IGNORECASE):
        return f"a peer process died ({message.strip().splitlines()[0][-160:]})"
    return None


def release_process_group() -> None:
    """Frees the process group and joins its threads now, while the interpreter is fully alive.

    Why: under FSDP2 the group outlives destroy_process_group() (which `accelerator.end_training()` calls). The
    sharded parameters are DTensors whose DeviceMesh holds the group, and so do the autograd graph of the last
    loss (through FSDP's hooks) and torch's process-wide DTensor caches (redistribution planners, mesh topology). The group and its gloo worker threads then died only at interpreter exit, where a thread that
    needs the finalizing interpreter is ended by pthread_exit inside C++ code: 'terminate called without an
    active exception', SIGABRT, and a finished job reported failed (about 1 FSDP job in 6-10 on CPU). So after
    main() returns: collect its freed objects (module hooks form reference cycles), drop the cached meshes'
    references to their groups (the meshes are unusable once the group is destroyed), and destroy the group
    if main() did not. tests/test_fsdp.py checks that no gloo thread is left afterwards."""
    gc.collect()
    for obj in gc.get_objects():
        if type(obj) is DeviceMesh:  # not isinstance: some torch objects warn when asked
            obj._pg_registry.clear()  # torch keeps no other reference to the group here (checked: torch 2.14)
    if dist.is_available() and dist.is_initialized():  # main() stopped before accelerator.end_training()
        dist.destroy_process_group()
    gc.collect()
