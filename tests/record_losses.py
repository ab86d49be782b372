"""Runs a training script (its __main__, with its flags) and records every training loss it computes.

    accelerate launch ... tests/record_losses.py SCRIPT.py FLAGS

Every call of torch.nn.functional.cross_entropy with autograd on (a training forward; evaluation runs under
no_grad) is recorded, in order, and written to <--output-dir>/losses-rank<R>.json when the script ends. Changes no
behaviour: the loss tensor is returned as computed."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

losses: list[float] = []
real_cross_entropy = F.cross_entropy


def cross_entropy(*args, **kwargs):
    loss = real_cross_entropy(*args, **kwargs)
    if torch.is_grad_enabled():
        losses.append(loss.item())
    return loss


if __name__ == "__main__":
    script, flags = sys.argv[1], sys.argv[2:]
    output_dir = flags[flags.index("--output-dir") + 1]
    sys.argv = [script, *flags]
    sys.path.insert(0, str(Path(script).resolve().parent))
    F.cross_entropy = cross_entropy
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        rank = os.environ.get("RANK", "0")
        Path(output_dir, f"losses-rank{rank}.json").write_text(json.dumps(losses))
