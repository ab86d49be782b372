"""Runs the real train_cifar.main() with instruments attached, and writes what each rank saw.

Launched by the tests exactly like train_cifar.py (`accelerate launch ... tests/probe_train.py FLAGS`); it
changes no behaviour, it only records, per rank, into <output-dir>/probe-rank<R>.json:
  batches      [[dataset number, [sample indices]], ...] for every batch fetched (dataset 0 = training)
  allreduce_at number of training forwards done when each DDP gradient bucket was all-reduced
  synced_in_bf16 per all-reduced bucket: whether every averaged gradient is a bf16 number (low 16 bits zero)
  comm_hook    name of the DDP communication hook the script registered (None: DDP's fp32 all-reduce)
  compiled     whether prepare() returned a torch.compile'd module (a dynamo backend from the launcher)
  fc_dtypes    dtypes of the classifier's output during training forwards (what autocast really ran)
  init_digest  sha256 of the model's parameters as built by the script, before prepare() (before DDP's broadcast)
  eval_buffer_digest  sha256 of the BatchNorm buffers when each evaluation is called (as training left them)
  eval_param_digest   sha256 of the parameters when each evaluation is called (DDP: equal on all ranks; FSDP2: the
               shards)
  eval_forward_digest sha256 of the BatchNorm buffers at the first forward of each evaluation (what it uses)
  draws        per training batch: [epoch, sample indices, positions mirrored, crop offsets] as the loader drew them
  param_types  class names of the prepared model's parameters (DTensor under FSDP2)
  local_numel  parameter elements this rank stores (its shards under FSDP2)
  fsdp_units   class names of the modules FSDP2 wrapped (each gathers its parameters as one unit)
  logs         every accelerator.log(values, step) call (also appended, as it happens, to probe-logs-rank<R>.jsonl,
               which survives a kill)
  writes       files this rank wrote under the output dir
  dataset_devices  where each dataset's images are held (training first): cuda with --data-on-device on a GPU
  norm_types   class names of the normalisation layers in the prepared model (SyncBatchNorm with --sync-bn)
  eval_outputs per evaluation, the (logits, labels) gather_for_metrics returned: every test image once, as
               the metrics see them
  grad_norms   at each optimizer step, the global norm of the gradients the optimizer applies, in float64 from the
               gradients themselves (under FSDP2 the shards made whole): with --grad-clip 0, the unclipped norm
  bytes_written bytes this process sent to storage (/proc/self/io write_bytes: files on a disk filesystem,
               not sockets), whatever wrote them: Python, C++ (torch.save) or Rust (safetensors)
  gloo_threads_at_exit  gloo's native threads still running when the process is about to exit (a process group
               that outlived the run; none expected)
  hub_calls    with PROBE_FAKE_HUB=DIR: huggingface_hub's HfApi.whoami, create_repo and upload_folder calls (the
               network's edge, answered here: upload_folder copies the folder to DIR/rank<R>/<repo id>)
Streamed shards (--decode stream) are read and fetched in the loader's worker processes, which append, as it
happens, to <output-dir>/probe-stream-rank<R>-<pid>.jsonl one line per call: {"read": split, "rows": [...]} for
each window a worker reads from the shards, {"fetch": split, "epoch": E, "rows": [...]} for each batch it decodes;
and each process one line {"index": url} for each shard whose index it reads.
With PROBE_RECORD_WEIGHTS=NAME,NAME,... those tensors of the model's state (this rank's view: whole under DDP) as
prepare() returned it and after every optimizer step go to <output-dir>/probe-weights-rank<R>.safetensors, keyed
NAME@STEP (STEP 0: before the first step): what --ema-decay's average is checked against.
With PROBE_SAVE_INIT=1 the model's state as the script built it, before prepare(), goes to
<output-dir>/probe-init-rank<R>.safetensors (--init-from's weights, as every rank holds them).
With PROBE_SCRIPT=PATH it runs that copy of train_cifar.py (its main(), Config and edit points) instead.
With PROBE_ACCELERATOR_CPU=0 it builds the script's Accelerator with cpu=False, the classic mistake that
leaves N launched CPU processes training alone (used to test the script's world-size guard).
With PROBE_NAN_AT_FORWARD=K the loss of the K-th training forward on every rank is NaN (a diverging run).
With PROBE_OOM_ABOVE=N a training forward of more than N images raises torch.OutOfMemoryError on every rank before
the model computes anything, as a GPU does when a micro-batch does not fit; with PROBE_OOM_AT_FORWARD=K the K-th
training forward (counting those that raised) does.
With PROBE_HOLD_AT_STEP=K every rank waits at its K-th optimizer step until its parent process (the launcher) is
gone, then goes on: a job that cannot end before the launcher is killed, however busy the machine. With
PROBE_HOLD_AT_EVAL=K every rank waits so at the start of its K-th call of the script's evaluate().
With PROBE_HANG_SAMPLE=EPOCH:INDEX the loader worker that decodes training sample INDEX in epoch EPOCH (from 0) sleeps
for good instead (--decode workers or stream): a hung worker.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import accelerate.utils.other as accelerate_other  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from utils.data import images as image_kinds  # noqa: E402
from utils.data import stream  # noqa: E402
from utils.launch import run  # noqa: E402
from utils.scripts import import_script  # noqa: E402

if os.environ.get("PROBE_SCRIPT"):  # a copy of train_cifar.py, instrumented the same way
    train_cifar = import_script(Path(os.environ["PROBE_SCRIPT"]))
else:
    import train_cifar  # noqa: E402

rec = {"batches": [], "allreduce_at": [], "synced_in_bf16": [], "comm_hook": None, "compiled": None, "fc_dtypes": [],
       "init_digest": None, "eval_buffer_digest": [], "eval_param_digest": [], "eval_forward_digest": [],
       "draws": [], "param_types": [], "local_numel": 0, "fsdp_units": [], "logs": [], "writes": [],
       "eval_outputs": [], "dataset_devices": [], "norm_types": [], "grad_norms": [], "hub_calls": []}
datasets_seen: list[int] = []
# the run's folder; also in a loader worker started by a forkserver, which runs this file as __mp_main__, without its
# __main__ block, with the job's argv
output_dir = str(Path(sys.argv[sys.argv.index("--output-dir") + 1]).resolve()) if "--output-dir" in sys.argv else None
recorded: dict[str, torch.Tensor] = {}  # PROBE_RECORD_WEIGHTS: NAME@STEP -> tensor
RECORD = [n for n in os.environ.get("PROBE_RECORD_WEIGHTS", "").split(",") if n]


def record_weights(step: int) -> None:
    state = forwards["model"]().state_dict()
    for name in RECORD:
        recorded[f"{name}@{step}"] = state[name].detach().clone().contiguous()
forwards = {"train": 0, "eval_started": False}


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t  # FSDP2: this rank's shard
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


real_getitems = image_kinds.LoaderDataset.__getitems__


def getitems(self, indices):
    if isinstance(self.images, image_kinds.EncodedImages):  # in a loader worker: to the stream record, as it happens
        return decoding_getitems(self, indices)
    if id(self) not in datasets_seen:
        datasets_seen.append(id(self))
        rec["dataset_devices"].append(self.images.tensor.device.type)
    rec["batches"].append([datasets_seen.index(id(self)), [int(i) for i in indices]])
    batch = real_getitems(self, indices)
    if len(batch) == 3 and batch[2] is not None and batch[2].flip_crop is not None:  # a training batch, augmented
        mirrored, crop = batch[2].flip_crop
        rec["draws"].append([self.epoch, [int(i) for i in indices], mirrored.tolist(), crop.tolist()])
    return batch


def stream_record(line: dict) -> None:
    with open(Path(output_dir, f"probe-stream-rank{os.environ.get('RANK', '0')}-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


real_index_shard = stream.index_shard
real_stream_read = stream.StreamRows.read


def index_shard(url, columns, cache=None):
    stream_record({"index": url})
    return real_index_shard(url, columns, cache)


def stream_read(self, rows):
    stream_record({"read": self.split, "rows": [int(r) for r in rows]})
    return real_stream_read(self, rows)


def decoding_getitems(self, indices):
    stream_record({"fetch": self.images.rows.split, "epoch": self.epoch, "rows": [int(i) for i in indices]})
    return real_getitems(self, indices)


real_encoded_read = image_kinds.EncodedImages.read


def hanging_read(self, indices, key):
    """EncodedImages.read, which never returns a training batch that holds PROBE_HANG_SAMPLE's sample in its epoch."""
    hang = os.environ.get("PROBE_HANG_SAMPLE")  # EPOCH:INDEX
    if hang and key is not None and key[1] == int(hang.split(":")[0]) and int(hang.split(":")[1]) in indices:
        time.sleep(10 ** 6)
    return real_encoded_read(self, indices, key)


real_prepare = Accelerator.prepare


def prepare(self, *objects, **kwargs):
    if not isinstance(objects[0], torch.nn.Module):
        return real_prepare(self, *objects, **kwargs)
    rec["init_digest"] = digest(objects[0].parameters())
    if os.environ.get("PROBE_SAVE_INIT") == "1":
        state = {k: v.detach().contiguous() for k, v in objects[0].state_dict().items()}
        save_file(state, Path(output_dir, f"probe-init-rank{os.environ.get('RANK', '0')}.safetensors"))
    out = real_prepare(self, *objects, **kwargs)
    wrapped = out[0]
    # keep_torch_compile=False: with the default, Accelerate 1.15's unwrap of a compiled DDP model sets the compiled
    # module's _orig_mod to the bare model, so DDP silently drops out of every later forward and backward.
    inner = self.unwrap_model(wrapped, keep_torch_compile=False)
    rec["param_types"] = sorted({type(q).__name__ for q in wrapped.parameters()})
    rec["local_numel"] = sum((q.to_local() if isinstance(q, DTensor) else q).numel() for q in wrapped.parameters())
    rec["fsdp_units"] = [type(m).__name__ for m in wrapped.modules() if isinstance(m, FSDPModule)]
    rec["norm_types"] = sorted({type(m).__name__ for m in inner.modules() if "Norm" in type(m).__name__})
    forwards["model"], forwards["steps"] = weakref.ref(inner), 0  # a strong reference would keep the process group
    if RECORD:
        record_weights(0)

    def count_forward(module, args):
        if module.training:
            forwards["tried"] = forwards.get("tried", 0) + 1
            if len(args[0]) > int(os.environ.get("PROBE_OOM_ABOVE", sys.maxsize)) or \
                    forwards["tried"] == int(os.environ.get("PROBE_OOM_AT_FORWARD", 0)):
                raise torch.OutOfMemoryError(f"probe: {len(args[0])} images do not fit")
            forwards["train"] += 1
            forwards["poison"] = forwards["train"] == int(os.environ.get("PROBE_NAN_AT_FORWARD", "0"))
        elif forwards["eval_started"]:
            rec["eval_forward_digest"].append(digest(module.buffers()))
            forwards["eval_started"] = False

    inner.register_forward_pre_hook(count_forward)
    classifier = [m for m in inner.modules() if isinstance(m, torch.nn.Linear)][-1]  # fc of the ResNets
    classifier.register_forward_hook(lambda m, a, o: rec["fc_dtypes"].append(str(o.dtype)) if m.training else None)
    ddp = getattr(wrapped, "_orig_mod", wrapped)  # Accelerate compiles the DDP wrapper under a dynamo backend
    rec["compiled"] = ddp is not wrapped
    if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        # DDP takes one hook: ours counts, then runs the one the script registers (see register_comm_hook below).
        def counting_hook(state, bucket):
            rec["allreduce_at"].append(forwards["train"])

            def note(fut):
                value = fut.value()
                synced = value[0] if isinstance(value, list) else value
                rec["synced_in_bf16"].append(bool((synced.float().view(torch.int32) & 0xFFFF).eq(0).all()))
                return synced

            return script_hook["hook"](script_hook["state"], bucket).then(note)

        real_register_comm_hook(ddp, None, counting_hook)
    return out


script_hook = {"state": None, "hook": allreduce_hook}
real_register_comm_hook = torch.nn.parallel.DistributedDataParallel.register_comm_hook


def register_comm_hook(self, state, hook):
    script_hook.update(state=state, hook=hook)
    rec["comm_hook"] = hook.__name__


real_evaluate = train_cifar.evaluate


def evaluate(model, loader, transform, accelerator, *args, **kwargs):
    inner = accelerator.unwrap_model(model, keep_torch_compile=False)
    rec["eval_buffer_digest"].append(digest(inner.buffers()))
    rec["eval_param_digest"].append(digest(inner.parameters()))
    forwards["eval_started"] = True
    rec["eval_outputs"].append({"logits": [], "labels": []})
    hold_at("PROBE_HOLD_AT_EVAL", len(rec["eval_outputs"]))
    return real_evaluate(model, loader, transform, accelerator, *args, **kwargs)


real_gather_for_metrics = Accelerator.gather_for_metrics


def gather_for_metrics(self, data, *args, **kwargs):
    out = real_gather_for_metrics(self, data, *args, **kwargs)
    if rec["eval_outputs"] and isinstance(out, tuple) and len(out) == 2:  # evaluate()'s (logits, labels)
        rec["eval_outputs"][-1]["logits"] += out[0].tolist()
        rec["eval_outputs"][-1]["labels"] += out[1].tolist()
    return out


real_init = Accelerator.__init__


def init(self, *args, **kwargs):
    if os.environ.get("PROBE_ACCELERATOR_CPU") == "0":
        kwargs["cpu"] = False
    real_init(self, *args, **kwargs)


real_cross_entropy = torch.nn.functional.cross_entropy


def cross_entropy(*args, **kwargs):
    loss = real_cross_entropy(*args, **kwargs)
    return loss * float("nan") if forwards.get("poison") else loss


real_log = Accelerator.log


def log(self, values, step=None, **kwargs):
    rec["logs"].append([step, {k: v for k, v in values.items() if isinstance(v, int | float)}])
    with open(Path(output_dir, f"probe-logs-rank{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
        f.write(json.dumps(rec["logs"][-1]) + "\n")
    return real_log(self, values, step=step, **kwargs)


real_optimizer_step = AcceleratedOptimizer.step


def optimizer_step(self, *args, **kwargs):
    if self.gradient_state.sync_gradients:
        forwards["step_calls"] = forwards.get("step_calls", 0) + 1
        hold_at("PROBE_HOLD_AT_STEP", forwards["step_calls"])
        grads = [q.grad for group in self.optimizer.param_groups for q in group["params"] if q.grad is not None]
        whole = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]  # collective: every rank calls it
        rec["grad_norms"].append(torch.stack([g.double().pow(2).sum() for g in whole]).sum().sqrt().item())
    out = real_optimizer_step(self, *args, **kwargs)
    if self.gradient_state.sync_gradients and RECORD:
        forwards["steps"] += 1
        record_weights(forwards["steps"])
    return out


LAUNCHER = os.getppid()  # this process's parent as it starts: PROBE_HOLD_AT_* waits until it is gone


def hold_at(variable: str, count: int) -> None:
    """Waits until the launcher is gone when `count` is the environment `variable`'s number."""
    if count == int(os.environ.get(variable, 0)):
        while os.getppid() == LAUNCHER:
            time.sleep(0.05)
real_safe_save = accelerate_other.safe_save_file


def safe_save(obj, path, *args, **kwargs):
    rec["writes"].append(str(path))
    return real_safe_save(obj, path, *args, **kwargs)


def audit(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].startswith(output_dir) and "/probe-" not in args[0]:
        mode = args[1] or "r"
        if any(c in mode for c in "wax+"):
            rec["writes"].append(args[0])


def fake_hub(folder: str) -> None:
    """HfApi's network calls answered locally: each recorded, upload_folder's folder copied to folder/rank<R>/."""
    import huggingface_hub

    def record(name, answer):
        def call(self, *args, **kwargs):
            rec["hub_calls"].append([name, [str(a) for a in args], {k: str(v) for k, v in kwargs.items()}])
            return answer(*args, **kwargs)
        return call

    def upload(repo_id, folder_path, **kwargs):
        shutil.copytree(folder_path, Path(folder, f"rank{os.environ.get('RANK', '0')}", repo_id))
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0")

    huggingface_hub.HfApi.whoami = record("whoami", lambda *a, **k: {"name": "tester"})
    huggingface_hub.HfApi.create_repo = record("create_repo", lambda *a, **k: None)
    huggingface_hub.HfApi.upload_folder = record("upload_folder", lambda **k: upload(**k))


if os.environ.get("PROBE_FAKE_HUB"):
    fake_hub(os.environ["PROBE_FAKE_HUB"])
image_kinds.LoaderDataset.__getitems__ = getitems
image_kinds.EncodedImages.read = hanging_read
stream.StreamRows.read = stream_read
stream.index_shard = index_shard
Accelerator.prepare = prepare
torch.nn.parallel.DistributedDataParallel.register_comm_hook = register_comm_hook
train_cifar.evaluate = evaluate
Accelerator.log = log
AcceleratedOptimizer.step = optimizer_step
Accelerator.gather_for_metrics = gather_for_metrics
Accelerator.__init__ = init
torch.nn.functional.cross_entropy = cross_entropy
accelerate_other.safe_save_file = safe_save


def gloo_threads() -> list[str]:
    """Names of this process's native threads that belong to gloo (a live process group's workers)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            pass  # the thread ended meanwhile
    return sorted(name for name in names if "gloo" in name)


if __name__ == "__main__":
    cfg = train_cifar.parse_config()
    output_dir = str(Path(cfg.output_dir).resolve())
    cfg.output_dir = output_dir
    recording = True
    sys.addaudithook(lambda e, a: audit(e, a) if recording else None)
    status = run(lambda: train_cifar.main(cfg))  # as train_cifar.py's own __main__
    recording = False
    rec["gloo_threads_at_exit"] = gloo_threads()
    io_counters = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    rec["bytes_written"] = int(io_counters["write_bytes"])
    rank = int(os.environ.get("RANK", "0"))
    Path(output_dir).mkdir(parents=True, exist_ok=True)  # a job that failed before writing removed its new folder
    Path(output_dir, f"probe-rank{rank}.json").write_text(json.dumps(rec))
    if recorded:
        save_file(recorded, Path(output_dir, f"probe-weights-rank{rank}.safetensors"))
    sys.exit(status)
