"""How a training script's processes start and end, with the launcher's quirks handled in one place.

Start: `fsdp_plugin_from_launcher()` before building the Accelerator, `shard_on_cpu_too()` after, then
`check_world()` (processes and wrapper really are what the launcher asked for) and `check_wrapper()` after
prepare(). End: `sys.exit(run(lambda: main(parse_config())))` turns a UserError (exit 2) or a peer that died or hung
(exit 1) into one line, and frees the process group before the interpreter shuts down."""

from __future__ import annotations

import collections
import gc
import json
import os
import re
import sys
import threading
import time
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist
from accelerate import FullyShardedDataParallelPlugin, PartialState
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, DistributedType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

from utils import UserError, process_count_problem


# ----------------------------------------------------------------------------------------------------
# Start
# ----------------------------------------------------------------------------------------------------
def make_deterministic() -> None:
    """Deterministic kernels; on CPU also 1 thread, so 1 process matches N launched processes bitwise."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for reproducible GEMMs
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    if not torch.cuda.is_available():  # kernels (and their rounding) depend on the thread count;
        torch.set_num_threads(1)  # launched processes get OMP_NUM_THREADS=1


def fsdp_plugin_from_launcher(bf16_params: bool = False) -> FullyShardedDataParallelPlugin | None:
    """The launcher's FSDP settings (its FSDP_* variables), None without FSDP. FSDP2 only: its checkpoints and
    full-weight export are what the tests prove.

    What it shards one unit at a time: choose_fsdp_units (the YAMLs name no class; each model declares its own).
    Mixed precision: by default parameters stay fp32 in FSDP and `--mixed_precision bf16` is autocast (as under
    DDP). FSDP's own bf16 policy casts BatchNorm's weights to bf16 while its running statistics stay fp32, a mix
    BatchNorm refuses (on CPU and CUDA alike); the price is fp32 all-gathers, nothing for a ResNet whose activations
    dominate the traffic. bf16_params (a model without BatchNorm, such as a ViT): under `--mixed_precision bf16`,
    FSDP gathers bf16 copies of the fp32 shards for forward and backward (half the bytes) and reduces gradients in
    fp32; the optimizer updates, and checkpoints save, the fp32 shards."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    if os.environ.get("FSDP_VERSION", "1") != "2":
        raise UserError("the launch config asks for FSDP version 1; this script runs FSDP2: set fsdp_version: 2 "
                        "(see accelerate_configs/fsdp_4gpu.yaml).")
    bf16 = bf16_params and os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    return FullyShardedDataParallelPlugin(mixed_precision_policy=policy)


def shard_on_cpu_too(accelerator, plugin: FullyShardedDataParallelPlugin | None) -> None:
    """Runs FSDP2 for real when an FSDP config is launched on CPU (gloo), where Accelerate would fall back
    to DDP silently: it builds MULTI_CPU whenever cpu=True and ignores the FSDP plugin, yet its FSDP2 code
    (fully_shard in prepare, sharded save_state/load_state, full get_state_dict) works on CPU. So set
    distributed_type FSDP and the plugin in Accelerate's shared state, in both PartialState and
    AcceleratorState (they keep separate copies; setting one alone is undone before save_state). This
    touches Accelerate internals: tested with the Accelerate range pinned in requirements.txt, and the
    wrapper is asserted after prepare(). On GPUs Accelerate does all of it itself; this does nothing."""
    if plugin is None or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def optimizer_kernel() -> dict:
    """How torch.optim's SGD and AdamW should update, as their keyword arguments, for the run Accelerate's shared
    state describes (call it once the Accelerator exists, after shard_on_cpu_too): fused, one kernel for the whole
    update on CPU and CUDA (torch's default is a per-tensor loop on CPU, foreach on GPUs; ResNet-18 on 1 CPU thread:
    SGD 24 ms per step with the loop, 10.8 foreach, 3.5 fused; AdamW 35 foreach, 5.3 fused); under FSDP2 foreach,
    as DTensor has no sharding rule for aten._fused_sgd_."""
    return {"foreach": True} if PartialState().distributed_type == DistributedType.FSDP else {"fused": True}


def choose_fsdp_units(accelerator, plugin: FullyShardedDataParallelPlugin | None, model: torch.nn.Module) -> None:
    """Under FSDP, what FSDP2 shards one unit at a time (each unit is gathered, used and freed on its own); the
    model as a whole is the last unit. In order: the block classes the launch config names
    (fsdp_transformer_layer_cls_to_wrap), else those the model declares in `_no_split_modules` (the convention
    Accelerate reads; the ready models in utils/models.py declare theirs), else, for a model that declares none,
    every module holding more than 1/16 of its parameters, innermost first (Accelerate's size-based policy).
    Prints one line that says which rule and the classes it makes units of, with their counts (`fsdp_units`). A
    named class that is not in the model: one line here, instead of Accelerate's traceback on every rank. Without
    FSDP: nothing."""
    if plugin is None:
        return None
    named = plugin.transformer_cls_names_to_wrap
    declared = getattr(model, "_no_split_modules", None)
    if plugin.auto_wrap_policy is transformer_auto_wrap_policy and named is None and not declared:
        plugin.auto_wrap_policy = size_based_auto_wrap_policy
        plugin.min_num_params = max(1, sum(p.numel() for p in model.parameters()) // 16)
        units = fsdp_units(model, lambda m: sum(p.numel() for p in m.parameters()) > plugin.min_num_params)
        accelerator.print(f"FSDP units: {units} (every module of more than {plugin.min_num_params:,} parameters, 1/16 "
                          f"of the model, which declares no _no_split_modules), then the whole model")
        return
    classes = named or declared or []
    present = {type(m).__name__ for m in model.modules()}
    missing = [name for name in classes if name not in present]
    if missing:
        raise UserError(f"the FSDP launch config shards blocks of class {', '.join(missing)}, which this model does "
                        f"not have: delete fsdp_transformer_layer_cls_to_wrap from the YAML (the model's "
                        f"_no_split_modules then decides), or name a class of your model there (docs/customizing.md).")
    where = "the launch config's fsdp_transformer_layer_cls_to_wrap" if named else "the model's _no_split_modules"
    # Accelerate also makes a transformers model's input embeddings (get_input_embeddings()) a unit of their own,
    # after the blocks: a block class that holds them (ViT's ViTEmbeddings) would shard them twice, which torch
    # refuses, so such a class is left to the whole model.
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    holders = {type(m).__name__ for m in model.modules()
               if embeddings is not None and m is not embeddings and any(c is embeddings for c in m.modules())}
    kept = [name for name in classes if name not in holders]
    if len(kept) < len(classes):
        plugin.transformer_cls_names_to_wrap = kept
        where += f"; not {', '.join(sorted(set(classes) - set(kept)))}, which holds the input embeddings"
    units = fsdp_units(model, lambda m: type(m).__name__ in kept)
    extra = (f", then Accelerate's units for a transformers model: its input embeddings ({type(embeddings).__name__}) "
             f"and final norm, if any" if embeddings is not None else "")
    accelerator.print(f"FSDP units: {units} ({where}){extra}, then the whole model")


def fsdp_units(model: torch.nn.Module, policy) -> str:
    """'N ClassName, ...': the modules below the root that Accelerate's FSDP2 preparation shards as units of their own
    (each module for which the auto-wrap policy holds, as its fsdp2_prepare_model walks them), counted by class."""
    counts = collections.Counter(type(m).__name__ for m in list(model.modules())[1:] if policy(m))
    return ", ".join(f"{n} {name}" for name, n in counts.items()) or "no module"


def check_world(accelerator, fsdp_asked: bool, sync_bn: bool = False) -> None:
    """Stops on the launches that otherwise train silently with the wrong setup: processes that each train alone,
    machines launched with different counts, an FSDP config that became DDP; and on SyncBatchNorm without CUDA."""
    problem = process_count_problem(accelerator.num_processes)
    if problem:
        raise UserError(f"{problem} ({accelerator.distributed_type.value}).")
    if fsdp_asked and accelerator.distributed_type != DistributedType.FSDP:
        raise UserError(f"the launch config asks for FSDP but Accelerate set up {accelerator.distributed_type.value}.")
    if sync_bn and accelerator.device.type != "cuda":
        raise UserError("--sync-bn needs CUDA GPUs: torch's SyncBatchNorm does not run on CPU.")
    if accelerator.device.type == "cpu" and accelerator.mixed_precision == "bf16" and cpu_bf16_native() is False:
        accelerator.print("warning: bf16 autocast on this CPU (no AVX512-BF16 or AMX in /proc/cpuinfo) is emulated: "
                          "ResNet-18 steps take 5-11x longer than in fp32; launch with --mixed_precision no")


def cpu_bf16_native(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether the CPU computes in bf16 natively (x86's avx512_bf16 or amx_bf16 flag); None where Linux's cpuinfo
    lists no x86 flags (another OS, an ARM CPU). Without it oneDNN emulates bf16 matmuls and convolutions: on a
    2-core AMD EPYC (Zen 3, AVX2 only) ResNet-18 steps took 11x longer in bf16 than in fp32."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & set(flags))


def print_setup(accelerator, cfg, plan, lr: float) -> None:
    """A run's first two lines, on the main process: the config's values that are not the script's defaults (the whole
    config goes to config.yaml and summary.json), then what it runs on and its batch."""
    world = plan.processes
    given, defaults = (json.loads(json.dumps(asdict(c))) for c in (cfg, type(cfg)()))  # tuples as lists, as given
    changed = {k: v for k, v in given.items() if v != defaults[k]}
    accelerator.print(f"config: {json.dumps(changed)} (the rest at their defaults; config.yaml holds every value)")
    if sweep := os.environ.get("WANDB_SWEEP_ID"):  # utils.config_groups.sweep_trial chose the folder
        accelerator.print(f"W&B sweep {sweep}: trial {os.environ['WANDB_RUN_ID']} trains in {cfg.output_dir} (started "
                          f"again with this run id, it continues there)")
    accelerator.print(f"{world} process(es), {accelerator.distributed_type.value}, mixed precision "
                      f"{accelerator.mixed_precision}, device {accelerator.device}; global batch {plan.global_batch} ("
                      f"{plan.micro} x {world} processes x {plan.accumulation} accumulation), lr {lr:g}")


def check_wrapper(accelerator, model, bf16_grad_sync: bool) -> None:
    """After prepare(): asserts the wrapper the distributed type promises (gradients really are averaged, or
    parameters really are sharded); under DDP with bf16 autocast, all-reduces gradients in bf16 if asked
    (PyTorch's bf16_compress_hook, through Accelerate's handler)."""
    if accelerator.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        ddp = getattr(model, "_orig_mod", model)  # under a dynamo backend, Accelerate compiles the DDP wrapper
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
        if bf16_grad_sync and accelerator.mixed_precision == "bf16":
            DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BF16).register_comm_hook(ddp)
    if accelerator.distributed_type == DistributedType.FSDP:
        assert isinstance(accelerator.unwrap_model(model, keep_torch_compile=False), FSDPModule), type(model)


@torch.no_grad()
def share_bn_statistics(accelerator, model) -> None:
    """Copies rank 0's BatchNorm running statistics (the exported ones) to every rank. They drift apart (each rank
    normalises its own batches). DDP (broadcast_buffers=True) copies rank 0's at a forward only after one with
    gradients: not for an evaluation's second model (the EMA's, put in place after the first evaluation), and FSDP
    never does. Done by hand before each evaluation and checkpoint (no library call does it), so every rank
    evaluates and saves exactly the statistics exported."""
    if accelerator.num_processes > 1:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


# ----------------------------------------------------------------------------------------------------
# End
# ----------------------------------------------------------------------------------------------------
LAUNCHER_GONE = threading.Event()  # set by watch_launcher(): this worker's launcher died
LAUNCHER_WATCH_SECONDS = 1.0


def watch_launcher() -> None:
    """Under torchrun (the launcher of `accelerate launch` for several processes) each worker runs in a session of
    its own, so a kill of the launcher, or of its process group, leaves the workers training with nobody watching.
    A daemon thread notices that the parent process is gone (this process was reparented) and sets LAUNCHER_GONE;
    utils.guard.StopGuard then takes the preemption path at its next collective check: a checkpoint, then exit.
    Started when the process starts (run() below), so a launcher that dies during the first decode is noticed too.
    Written by hand: neither torch nor Accelerate watches the parent (PR_SET_PDEATHSIG would fire when the parent's
    spawning thread ends, not the parent). Under plain `python` the process is in its shell's process group: not
    watched."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(LAUNCHER_WATCH_SECONDS)
        LAUNCHER_GONE.set()

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()




WAIT_TIMEOUT = timedelta(hours=12)  # how long the other processes wait for a machine's first one (decode, download)


def first_error(error: str | None, long_wait: bool = False) -> str | None:
    """Every process calls it at the same point with its own error (None: none) and gets the first one any process
    had (None: none had one): the one primitive behind "one rank tries, every rank stops with the same line". Also
    the barrier for the processes that had nothing to do, within --dist-timeout (the default group's limit: a hung
    peer fails the job). long_wait: for the others to wait on a slow first process (decoding a large dataset,
    downloading, uploading), in a gloo group of its own whose limit is WAIT_TIMEOUT (a dead process still ends the
    job: the launcher sees it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    group = dist.new_group(backend="gloo", timeout=WAIT_TIMEOUT) if long_wait else None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error, group=group)
    if group is not None:
        dist.destroy_process_group(group)
    return next((e for e in gathered if e), None)


def raise_if_any(error: str | None, long_wait: bool = False) -> None:
    """first_error(error, long_wait), raised on every process as a UserError, so all of them exit with the same line
    (instead of the others dying in the next collective with a traceback)."""
    found = first_error(error, long_wait)
    if found:
        raise UserError(found)


def is_main_process() -> bool:
    """Whether this is the global main process, before (or without) Accelerate's state: from torchrun's RANK."""
    return int(os.environ.get("RANK", "0")) == 0


def main_print(*args) -> None:
    """print() on the global main process only (is_main_process)."""
    if is_main_process():
        print(*args)


def first_on_each_machine(job):
    """job() on each machine's first process (a download or a decode into a cache), then on the others, which find it
    cached. A UserError there is raised on every process (raise_if_any); Accelerate's main_process_first would
    leave the others waiting at its barrier for the process that failed. Needs no Accelerator: the launcher's
    LOCAL_RANK says which process is first (none set: one process)."""
    result = error = None
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if first:
        try:
            result = job()
        except UserError as e:
            error = str(e)
    raise_if_any(error, long_wait=True)
    return result if first else job()


def run(job) -> int:
    """Calls job(), then returns the exit status: 0; 2 after a UserError (printed once, by global rank 0: every
    process raises it at the same point; one from a loader worker, such as an undecodable image, by the rank whose
    batch held it); 1 when a peer process died or hung (printed by every process that
    saw it). Other exceptions propagate with their traceback."""
    rank = int(os.environ.get("RANK", "0"))
    watch_launcher()  # a worker whose launcher dies checkpoints and stops (utils.guard.StopGuard)
    try:
        job()
        status = 0
    except UserError as e:
        line, mine = f"error: {e}", False
        if str(e).startswith("Caught UserError in DataLoader worker"):  # PyTorch's wrapper of a worker's error: the
            line, mine = f"error: {str(e).strip().splitlines()[-1].split(': ', 1)[-1]}", True  # line; this rank's
        report_to_launcher(line)
        if mine:  # a bad image in a batch of this rank only: the others, waiting in a collective, see it exit
            _mark_in_store(ERROR_PRINTED)  # and say nothing more (the next branch)
        if rank == 0 or mine:
            print(line, file=sys.stderr, flush=True)
        else:  # exiting first, this rank would have the launcher stop rank 0 (SIGTERM) before it printed the line;
            time.sleep(5)  # rank 0's exit has the launcher stop this one, so the wait costs nothing in the end
        status = 2
    except RuntimeError as e:  # torch.distributed.DistBackendError is one
        hung = re.match(r"DataLoader timed out after ([\d.]+) seconds", str(e))  # PyTorch's, at the loader's timeout
        why = (f"rank {rank} waited {float(hung[1]):g} s (half --dist-timeout) for a batch from its loader's worker "
               f"processes, which hang (a read or a decode that does not return; the worker's stacks are above)"
               ) if hung else peer_failure(str(e))
        if why is None:
            raise
        line = (f"error: {why}; this process (rank {rank}) stopped. Continue with --resume auto: it takes the newest "
                f"complete checkpoint (one being written is never used).")
        report_to_launcher(line)
        if hung:  # the cause: its peers, waiting for it in a collective, see it exit and say nothing more
            _mark_in_store(ERROR_PRINTED)
            print(line, file=sys.stderr, flush=True)
        elif not _marked_in_store(ERROR_PRINTED):  # a peer that stopped on bad input or a hung worker has said why
            print(line, file=sys.stderr, flush=True)
        status = 1
    release_process_group()  # the job's frames (and the traceback's) are gone by now
    # The interpreter's exit collects cycles among every object torch and torchvision created; frozen, they are left
    # to the exit itself: 2.0 s -> 0.6 s per process on a 2-core Zen 3 (`gc.freeze`: objects stay alive, unscanned).
    gc.freeze()
    return status


ERROR_PRINTED = "accelerate-cifar/error-printed"  # a key of torch.distributed's store


def _mark_in_store(key: str) -> None:
    """Sets `key` in the process group's key-value store (under torchrun, the launcher's own, which outlives any
    worker), so the other processes can read it after this one exits. Nothing without a process group."""
    try:
        if torch.distributed.is_initialized():
            torch.distributed.distributed_c10d._get_default_store().set(key, "1")
    except Exception:  # a store that cannot be reached: the others then print their own line
        pass


def _marked_in_store(key: str) -> bool:
    try:
        return torch.distributed.is_initialized() and torch.distributed.distributed_c10d._get_default_store().check(
            [key])
    except Exception:
        return False


def report_to_launcher(line: str) -> None:
    """torchrun's failure report (the launcher's `ChildFailedError`) shows each failed process's error file as its
    message; without one it says "To enable traceback see ...". Our one line goes there instead, so the report's
    "Root Cause" repeats it. Written by hand: torch's ErrorHandler.record_exception would put the Python traceback
    there; a plain string message is the other form torch's reader accepts."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")  # set by torchrun for each worker; absent under plain python
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
        except OSError:
            pass  # the report then says what it says without us: the line is on stderr anyway


def peer_failure(message: str) -> str | None:
    """What a collective's error says about the other processes, in words; None if it is about something else."""
    waited = re.search(r"Timed out waiting (\d+)\s*ms|Timeout\(ms\)=(\d+)", message)  # gloo | NCCL's watchdog
    # gloo's broadcast (DDP's buffer sync) says only "Application timeout caused pair closure": the group's own limit
    if waited or "Application timeout caused pair closure" in message:
        seconds = int(next(g for g in waited.groups() if g)) / 1000 if waited else _group_timeout()
        limit = f" {seconds:g} s" if seconds is not None else ""
        return f"a peer process did not answer within --dist-timeout{limit} (it hangs, or its machine is unreachable)"
    if re.search(r"Connection (closed|reset) by peer|Broken pipe", message, re.IGNORECASE):
        return f"a peer process died ({message.strip().splitlines()[0][-160:]})"
    return None


def _group_timeout() -> float | None:
    """The default process group's collective timeout in seconds, from its CPU backend's options (torch keeps it
    nowhere public); None where that cannot be read."""
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except Exception:
        return None


def release_process_group() -> None:
    """Frees the process group and joins its threads now, while the interpreter is fully alive.

    Why: under FSDP2 the group outlives destroy_process_group() (which `accelerator.end_training()` calls). The
    sharded parameters are DTensors whose DeviceMesh holds the group, and so do the autograd graph of the last
    loss (through FSDP's hooks) and torch's process-wide DTensor caches (redistribution planners, mesh topology).
    The group and its gloo worker threads then died only at interpreter exit, where a thread that
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
