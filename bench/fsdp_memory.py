"""Memory per process of train_vit.py's model under DDP and FSDP2, with and without activation checkpointing.

    python bench/fsdp_memory.py                                   # CPU: 2 gloo processes, vit_s and vit_b
    python bench/fsdp_memory.py --gpus 2                          # 2 GPUs (NCCL): 2gpu-shaped launches
    python bench/fsdp_memory.py --gpus 1 --mixed-precision bf16   # 1 GPU, 1 process: what fits (no sharding ratio)
    python bench/fsdp_memory.py --models vit_s --batch-size 64

For each model and setting it launches 2 processes (`accelerate launch`, the repo's cpu.yaml / fsdp_cpu.yaml, or
one per GPU with --multi_gpu / FSDP2 flags with --gpus N) that build the model, the AdamW optimizer and the wrapper
exactly as train_vit.py does, then train a few steps on random 32 x 32 images. Each process reports:
  model state  bytes of the parameters, gradients and AdamW state it holds (FSDP2: its shards), counted tensor by
               tensor: what sharding divides;
  activations  the memory the forward pass leaves for backward: bytes in use at the loss minus before the forward
               (CUDA: the caching allocator's count; CPU: glibc's mallinfo2, which counts what torch allocates on
               the CPU): what activation checkpointing cuts;
  peak         the process's peak: the CUDA allocator's peak on GPUs, the peak resident set (getrusage) on CPU,
               which also holds freed memory the C library keeps, so it falls less than the activations do.
Prints a table and the ratios FSDP / DDP (model state) and checkpointed / plain (activations), all from this run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


def cpu_bytes_in_use() -> int:
    """Bytes the process has allocated through malloc and not freed (glibc; small blocks and mmap'd large ones).
    Measured by hand: torch keeps no count of its CPU allocations."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def worker(args) -> None:
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor

    import train_vit
    from utils.launch import check_world, fsdp_plugin_from_launcher, shard_on_cpu_too
    from utils.models import checkpoint_blocks, named_model

    fsdp = fsdp_plugin_from_launcher(bf16_params=True)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), fsdp_plugin=fsdp)
    shard_on_cpu_too(accelerator, fsdp)
    check_world(accelerator, fsdp_asked=fsdp is not None)
    torch.manual_seed(0)
    model = named_model(args.model)
    if args.activation_checkpointing:
        checkpoint_blocks(model)
    model, optimizer = accelerator.prepare(model, train_vit.build_optimizer(train_vit.Config(), model, 1e-4))
    device = accelerator.device

    def in_use() -> int:
        return torch.cuda.memory_allocated(device) if device.type == "cuda" else cpu_bytes_in_use()

    def step(model, optimizer, batch: int) -> int:
        """One training step; returns the bytes its forward left for backward."""
        images = torch.randn(batch, 3, 32, 32, device=device)
        labels = torch.randint(0, 10, (batch,), device=device)
        before = in_use()
        loss = F.cross_entropy(model(images), labels)
        kept = in_use() - before
        accelerator.backward(loss)
        optimizer.step()  # gradients stay allocated (no zero_grad): they count in the model state
        return kept

    def peak() -> int:
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    step(model, optimizer, 1)  # gradients and optimizer state now exist
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    activations = max(step(model, optimizer, args.batch_size) for _ in range(args.steps))
    if device.type == "cuda":
        torch.cuda.synchronize()

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def nbytes(tensors) -> int:
        return sum(local(t).numel() * local(t).element_size() for t in tensors if t is not None)

    params = list(model.parameters())
    states = [v for s in optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    result = {"rank": accelerator.process_index, "params": nbytes(params), "grads": nbytes(q.grad for q in params),
              "optimizer": nbytes(states), "peak": peak(), "activations": activations,
              "distributed_type": accelerator.distributed_type.value, "world": accelerator.num_processes}
    Path(args.out, f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
    accelerator.end_training()


def launch(args, model: str, wrapper: str, checkpointed: bool) -> dict:
    processes = args.gpus or 2
    if args.gpus:
        config = [*(["--multi_gpu"] if args.gpus > 1 else []), "--num_processes", str(args.gpus), "--mixed_precision",
                  args.mixed_precision]
        if wrapper == "fsdp":
            config = ["--use_fsdp", "--fsdp_version", "2", "--num_processes", str(args.gpus), "--mixed_precision",
                      args.mixed_precision, "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
                      "--fsdp_reshard_after_forward", "true"]  # the blocks: the ViT's _no_split_modules
    else:
        yaml = "fsdp_cpu.yaml" if wrapper == "fsdp" else "cpu.yaml"
        config = ["--config_file", str(REPO / "accelerate_configs" / yaml), "--mixed_precision", args.mixed_precision]
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *config, "--main_process_port", "0", __file__,
               "--worker", "--out", out, "--model", model, "--batch-size", str(args.batch_size), "--steps",
               str(args.steps), *(["--activation-checkpointing"] if checkpointed else [])]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"error: the {wrapper} launch for {model} failed:\n{done.stderr[-3000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    assert len(ranks) == processes and {r["world"] for r in ranks} == {processes}, ranks
    want = "FSDP" if wrapper == "fsdp" else {0: "MULTI_CPU", 1: "NO"}.get(args.gpus, "MULTI_GPU")
    assert {r["distributed_type"] for r in ranks} == {want}, ranks
    worst = max(ranks, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
    return {**worst, "state": worst["params"] + worst["grads"] + worst["optimizer"],
            "activations": max(r["activations"] for r in ranks), "peak": max(r["peak"] for r in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["vit_s", "vit_b"])
    parser.add_argument("--batch-size", type=int, default=16, help="images per process per step")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--mixed-precision", default="no", choices=("no", "bf16"))
    parser.add_argument("--gpus", type=int, default=0, help="N CUDA GPUs, one process each, instead of 2 CPU "
                        "processes")
    parser.add_argument("--results", help="also write the numbers (MiB) and ratios to this JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--activation-checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from utils.launch import release_process_group

        worker(args)
        return release_process_group()  # the worker's frame is gone: FSDP2's process group can go (utils/launch.py)

    from bench.common import header

    processes = args.gpus or 2
    where = f"{args.gpus} GPU(s)" if args.gpus else "2 CPU processes"
    header(f"FSDP2 vs DDP memory per process, train_vit.py's model and optimizer, {where}")
    print(f"batch {args.batch_size} per process, {args.steps} steps, mixed precision {args.mixed_precision}; MiB per "
          f"process (the largest of the {processes})")
    print(f"{'model':<7} {'wrapper':<5} {'act. ckpt':<9} {'params':>8} {'grads':>8} {'AdamW':>8} {'state':>8} "
          f"{'activations':>11} {'peak':>8}")
    mib, numbers = 2 ** 20, {}
    for model in args.models:
        got = {}
        for wrapper in ("ddp", "fsdp"):
            for checkpointed in (False, True):
                r = got[wrapper, checkpointed] = launch(args, model, wrapper, checkpointed)
                print(f"{model:<7} {wrapper:<5} {'yes' if checkpointed else 'no':<9} {r['params'] / mib:>8,.0f} "
                      f"{r['grads'] / mib:>8,.0f} {r['optimizer'] / mib:>8,.0f} {r['state'] / mib:>8,.0f} "
                      f"{r['activations'] / mib:>11,.0f} {r['peak'] / mib:>8,.0f}", flush=True)
                numbers[f"{model} {wrapper}{' ac' if checkpointed else ''} MiB"] = {
                    k: round(r[k] / mib) for k in ("state", "activations", "peak")}
        state = got["fsdp", False]["state"] / got["ddp", False]["state"]
        acts = [got[w, False]["activations"] / max(got[w, True]["activations"], 1) for w in ("ddp", "fsdp")]
        print(f"{model}: model state FSDP / DDP {state:.2f}x; activations plain / checkpointed: DDP {acts[0]:.1f}x, "
              f"FSDP {acts[1]:.1f}x")
        numbers[f"{model} ratios"] = {"state_fsdp_over_ddp": round(state, 3), "activations_ddp_plain_over_ac":
                                      round(acts[0], 2), "activations_fsdp_plain_over_ac": round(acts[1], 2)}
        if args.results:  # after each model: a later one that fails or runs out of time leaves these
            Path(args.results).write_text(json.dumps(numbers, indent=2))

if __name__ == "__main__":
    main()
