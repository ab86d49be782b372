"""Check a distributed setup before training: launch it exactly like train_cifar.py (same YAML, same flags).

    accelerate launch --config_file accelerate_configs/cpu.yaml doctor.py
    accelerate launch --config_file accelerate_configs/2node_16gpu.yaml --machine_rank R --main_process_ip HEAD \
        doctor.py

Every process prints what it sees (versions, rank, world size, device, backend); the main process checks
that all agree, times an all-reduce (bus bandwidth) and a barrier, and prints OK or, for each problem, what
is wrong and the fix. Everything waits at most --timeout seconds, so a missing process, an unreachable or
busy port or a world-size mismatch is reported instead of hanging; a torchvision that does not import beside this
torch (a build for another torch or CUDA) is named with its fix. Exit status 0 when healthy, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from utils import first_line, process_count_problem
from utils.launch import cpu_bf16_native

FIXES = {  # a phrase of the error (lower case) -> the fix
    "joined": "a process is missing: every machine must run the launch command, with the same --num_machines and "
              "--num_processes, its own --machine_rank, and the head node's --main_process_ip/--main_process_port",
    "address already in use": "the port is busy (an earlier job still running?): pick another --main_process_port",
    "trying to connect": "this process cannot reach the head node: check that it started, that --main_process_ip is "
                         "its "
                         "address as seen from here and --main_process_port its port, and that no firewall blocks it",
    "connection refused": "nothing listens at the head node's address yet or a firewall blocks it: check "
                          "--main_process_ip is the head node's address reachable from here, and that it started",
    "timed out": "a process did not answer in time: check that all machines started, reach each other, and use the "
                 "same config (num_processes, num_machines)",
}


def torchvision_check() -> tuple[str | None, str | None]:
    """(torchvision's version, None) when it imports beside this torch, else (None, why): a torchvision built for
    another torch or CUDA (a CPU torch beside PyPI's CUDA torchvision) fails at import with words that do not say so
    ("operator torchvision::nms does not exist"), in every script."""
    try:
        import torchvision
    except Exception as e:  # noqa: BLE001 - any failure to import is the problem reported
        return None, first_line(e)
    return torchvision.__version__, None


def facts(accelerator) -> dict:
    import accelerate

    cuda = torch.cuda.is_available()
    torchvision, torchvision_problem = torchvision_check()
    return {"rank": accelerator.process_index, "local_rank": accelerator.local_process_index,
            "host": socket.gethostname(),
            "world_size": accelerator.num_processes, "count_problem": process_count_problem(accelerator.num_processes),
            "distributed_type": accelerator.distributed_type.value, "mixed_precision": accelerator.mixed_precision,
            "device": str(accelerator.device), "backend": dist.get_backend() if dist.is_initialized() else "none",
            "torch": torch.__version__, "torchvision": torchvision, "torchvision_problem": torchvision_problem,
            "accelerate": accelerate.__version__,
            "cuda": torch.version.cuda if cuda else None, "cpu_bf16_native": cpu_bf16_native(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}


def diagnose(error: Exception) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    fix = next((f for key, f in FIXES.items() if key in str(error).lower()),
               "see the message above; rerun with the same "
               "command on every machine")
    return f"{text}\n  fix: {fix}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=60, help="seconds any step may wait for the other processes")
    parser.add_argument("--size-mb", type=float, default=64, help="all-reduce payload per process")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    say(f"doctor: launcher says world size {os.environ.get('WORLD_SIZE', '1')}, head "
        f"{os.environ.get('MASTER_ADDR', '-')}:{os.environ.get('MASTER_PORT', '-')}; waiting at most "
        f"{args.timeout:g} s")

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, gather_object

    try:
        accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                                  kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.timeout))])
        everyone = gather_object([facts(accelerator)])
    except Exception as e:  # the process group could not form
        print(f"doctor: PROBLEM on rank {rank}: {diagnose(e)}", file=sys.stderr, flush=True)
        return 1

    problems = []
    bf16_words = {True: "native", False: "emulated (use fp32)", None: "unknown"}
    for f in everyone:
        say(f"  rank {f['rank']} (local {f['local_rank']}) on {f['host']}: {f['device']}, {f['backend']}, "
            f"{f['distributed_type']}, mixed precision {f['mixed_precision']}, torch {f['torch']}, torchvision "
            f"{f['torchvision'] or 'broken'}, accelerate {f['accelerate']}, CUDA {f['cuda']}, NCCL {f['nccl']}, "
            f"CPU bf16 {bf16_words[f['cpu_bf16_native']]}")
    # each problem once, in rank order
    for problem in dict.fromkeys(f["count_problem"] for f in everyone if f["count_problem"]):
        ranks = [f["rank"] for f in everyone if f["count_problem"] == problem]
        problems.append(f"world-size mismatch on rank(s) {', '.join(map(str, ranks))}: {problem}")
    for problem in dict.fromkeys(f["torchvision_problem"] for f in everyone if f["torchvision_problem"]):
        ranks = [f["rank"] for f in everyone if f["torchvision_problem"] == problem]
        problems.append(f"torchvision does not import beside torch {torch.__version__} on rank(s) "
                        f"{', '.join(map(str, ranks))} ({problem}): a build for another torch or CUDA\n  fix: install "
                        f"the two as a pair from one index: pip install --force-reinstall torch torchvision (for the "
                        f"CPU build, with --index-url https://download.pytorch.org/whl/cpu)")
    for key in ("world_size", "distributed_type", "mixed_precision", "torch", "torchvision", "accelerate", "cuda",
                "nccl"):
        values = {str(f[key]) for f in everyone}
        if len(values) > 1:
            problems.append(f"ranks disagree on {key}: {sorted(values)}\n  fix: same environment and config everywhere")

    if accelerator.num_processes > 1:
        try:
            payload = torch.ones(int(args.size_mb * 2**20 / 4), device=accelerator.device)
            dist.all_reduce(payload)  # warm-up, and a correctness check below
            ok = bool((payload == accelerator.num_processes).all())
            start = time.perf_counter()
            for _ in range(3):
                dist.all_reduce(payload)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds = (time.perf_counter() - start) / 3
            n = accelerator.num_processes
            bus = 2 * (n - 1) / n * payload.numel() * 4 / seconds / 1e9
            start = time.perf_counter()
            dist.barrier()
            say(f"  all-reduce of {args.size_mb:g} MB: {seconds * 1e3:.1f} ms, bus bandwidth {bus:.2f} GB/s; "
                f"barrier {1e3 * (time.perf_counter() - start):.2f} ms")
            if not ok:
                problems.append("all-reduce returned a wrong sum\n  fix: check the backend (NCCL/gloo) installation")
        except Exception as e:
            problems.append(f"collective failed: {diagnose(e)}")

    for p in problems:
        say(f"doctor: PROBLEM: {p}")
    if not problems:
        say(f"doctor: OK ({accelerator.num_processes} processes, {accelerator.distributed_type.value})")
    accelerator.wait_for_everyone()  # then tear the group down together: a peer exiting first makes gloo abort
    accelerator.end_training()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
