"""Runs a training script (its __main__, with its flags) and records every training loss it computes.

    accelerate launch ... tests/record_losses.py SCRIPT.py FLAGS

Every call of torch.nn.functional.cross_entropy with autograd on (a training forward; evaluation runs under
no_grad) is recorded, in order, and written to <--output-dir>/losses-rank<R>.json when the script ends. Changes no
behaviour: the loss tensor is returned as computed. Also written, to <--output-dir>/record-rank<R>.json:
  param_types    class names of the prepared model's parameters (DTensor under FSDP2)
  local_numel    parameter elements this rank stores (its shards under FSDP2)
  fsdp_units     class names of the modules FSDP2 sharded as one unit each
  linear_weight_dtypes  dtypes of the weights nn.Linear layers computed with in training forwards and recomputations
  linear_calls   number of those F.linear calls (activation checkpointing adds the recomputed blocks' calls)
  optimizer_dtypes      dtypes of the parameters the optimizer updates, at the end"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

losses: list[float] = []
record = {"param_types": [], "local_numel": 0, "fsdp_units": [], "linear_weight_dtypes": [], "linear_calls": 0,
          "optimizer_dtypes": []}
prepared = {}
real_cross_entropy, real_linear, real_prepare = F.cross_entropy, F.linear, Accelerator.prepare


def cross_entropy(*args, **kwargs):
    loss = real_cross_entropy(*args, **kwargs)
    if torch.is_grad_enabled():
        losses.append(loss.item())
    return loss


def linear(x, weight, *args, **kwargs):
    if torch.is_grad_enabled():
        record["linear_calls"] += 1
        if str(weight.dtype) not in record["linear_weight_dtypes"]:
            record["linear_weight_dtypes"].append(str(weight.dtype))
    return real_linear(x, weight, *args, **kwargs)


def prepare(self, *objects, **kwargs):
    result = real_prepare(self, *objects, **kwargs)
    for obj in result:
        if isinstance(obj, torch.nn.Module):
            prepared["model"] = obj
            record["param_types"] = sorted({type(q).__name__ for q in obj.parameters()})
            local = [q.to_local() if isinstance(q, DTensor) else q for q in obj.parameters()]
            record["local_numel"] = sum(q.numel() for q in local)
            record["fsdp_units"] = [type(m).__name__ for m in obj.modules() if isinstance(m, FSDPModule)]
        elif isinstance(obj, torch.optim.Optimizer):
            prepared["optimizer"] = obj
    return result


if __name__ == "__main__":
    script, flags = sys.argv[1], sys.argv[2:]
    output_dir = flags[flags.index("--output-dir") + 1]
    sys.argv = [script, *flags]
    sys.path.insert(0, str(Path(script).resolve().parent))
    F.cross_entropy, F.linear, Accelerator.prepare = cross_entropy, linear, prepare
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        rank = os.environ.get("RANK", "0")
        Path(output_dir, f"losses-rank{rank}.json").write_text(json.dumps(losses))
        if "optimizer" in prepared:
            record["optimizer_dtypes"] = sorted({str(q.dtype) for group in prepared["optimizer"].param_groups
                                                 for q in group["params"]})
        Path(output_dir, f"record-rank{rank}.json").write_text(json.dumps(record))
