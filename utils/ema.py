"""--ema-decay: an exponential moving average (EMA) of the weights, beside them on every rank, at any process count.

The average lives in tensors shaped like this rank's own parameters (the whole under DDP, its shards under FSDP2),
so averaging needs no communication and no second model. To evaluate, export or checkpoint the EMA, `applied()`
puts it into the model's own tensors for the moment (and the training weights back after): evaluation, the
full-weight export and FSDP's gathering then work on it exactly as on the training weights.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from accelerate.utils import DistributedType
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import get_ema_multi_avg_fn

from utils.launch import share_bn_statistics

CHECKPOINT_FILE = "ema.safetensors"  # in each checkpoint folder: the whole EMA (DDP, one process)
SHARDED_FOLDER = "ema"  # under FSDP2 instead: each rank's shards (torch.distributed.checkpoint)
COUNT_FILE = "ema.json"  # its update count, for the decay's warmup


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t  # FSDP2: this rank's shard, a view of the parameter


class WeightEMA:
    """The EMA of a prepared model's parameters and floating-point buffers; the loop calls `update()` after each
    optimizer step that was taken (not one that fp16's loss scaler skipped).

    Decay: update t (from 1) uses min(decay, (1 + t) / (10 + t)), the warmup of TensorFlow's ExponentialMovingAverage
    with num_updates: early updates follow the weights, so a short run's average is not its initial weights. The
    averaging itself is torch.optim.swa_utils' EMA function (one foreach lerp).

    BatchNorm, deliberately: the running statistics are averaged like the weights (as timm's ModelEmaV3 does), each
    rank its own; as for the training weights, rank 0's are the ones evaluated, exported and saved (DDP broadcasts
    them at each forward, FSDP2 through utils.launch.share_bn_statistics). Integer buffers (BatchNorm's batch
    counter) are not averaged: the model's count serves both."""

    def __init__(self, accelerator, model: torch.nn.Module, decay: float):
        self.accelerator, self.model, self.decay, self.updates = accelerator, model, decay, 0
        self.sharded = accelerator.distributed_type == DistributedType.FSDP
        self.shadow = [t.detach().clone() for t in self._live()]

    def _live(self) -> list[torch.Tensor]:
        """The model's tensors the EMA follows, this rank's part of each; fetched at each use (a resume may give
        FSDP2 new local tensors). FSDP2 leaves the root module's parameters gathered after a forward (an
        evaluation): resharding first makes every parameter this rank's shard again."""
        if self.sharded:
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        buffers = (b for b in self.model.buffers() if b.is_floating_point())
        return [_local(t).detach() for t in (*self.model.parameters(), *buffers)]

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        get_ema_multi_avg_fn(decay)(self.shadow, self._live(), None)

    @contextmanager
    def applied(self):
        """Inside: the model holds the EMA (what changes it there, a broadcast of rank 0's statistics or a load, is
        kept in the EMA); after: the training weights, bitwise as before. Costs one copy of this rank's weights."""
        live = self._live()
        with torch.no_grad():
            training = [t.clone() for t in live]
            torch._foreach_copy_(live, self.shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.shadow, live)
                torch._foreach_copy_(live, training)

    def save(self, folder: Path) -> None:
        """Collective: the EMA into a checkpoint folder, as the model's own weights are saved there. Under FSDP2 each
        rank's shards (torch.distributed.checkpoint, `ema/`: resharded on load, at any process count), after rank 0's
        BatchNorm statistics are shared (the checkpoint keeps one copy of each unsharded tensor, from any rank);
        otherwise the whole, written by the main process (`ema.safetensors`). The update count goes in ema.json."""
        accelerator, folder = self.accelerator, Path(folder)
        with self.applied():  # written inside: without FSDP the state dict holds the model's own tensors
            if self.sharded:
                share_bn_statistics(accelerator, self.model)
                dcp.save({"model": get_model_state_dict(self._inner())}, checkpoint_id=folder / SHARDED_FOLDER)
            else:
                state = accelerator.get_state_dict(self._inner())
                if accelerator.is_main_process:
                    save_file({k: v.contiguous() for k, v in state.items()}, folder / CHECKPOINT_FILE)
        if accelerator.is_main_process:
            (folder / COUNT_FILE).write_text(json.dumps({"updates": self.updates}))

    def load(self, folder: Path) -> None:
        """Restores the EMA a checkpoint saved (on any process count); a checkpoint of a run without --ema-decay has
        none: the EMA then starts from the resumed weights (one line says so)."""
        folder = Path(folder)
        if not (folder / COUNT_FILE).is_file():
            self.accelerator.print(f"note: {folder} holds no EMA (saved without --ema-decay); the EMA starts from "
                                   f"its weights")
            self.shadow, self.updates = [t.clone() for t in self._live()], 0
            return
        self.updates = json.loads((folder / COUNT_FILE).read_text())["updates"]
        with self.applied():
            if self.sharded:
                state = {"model": get_model_state_dict(self._inner())}  # this run's shards, to be filled
                dcp.load(state, checkpoint_id=folder / SHARDED_FOLDER)
                set_model_state_dict(self._inner(), state["model"])
            else:  # on the host, then into the model on its device
                self._inner().load_state_dict(load_file(folder / CHECKPOINT_FILE))

    def _inner(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
