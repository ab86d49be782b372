"""--ema-decay: an exponential moving average (EMA) of the weights, beside them on every rank, at any process count.

The average lives in tensors shaped like this rank's own parameters (the whole under DDP, its shards under FSDP2),
so averaging needs no communication and no second model. To evaluate, export or checkpoint the EMA, `applied()`
puts it into the model's own tensors for the moment (and the training weights back after): evaluation, the
full-weight export and FSDP's gathering then work on it exactly as on the training weights.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import get_ema_multi_avg_fn

from utils.checkpoint import export_weights

CHECKPOINT_FILE = "ema.safetensors"  # in each checkpoint folder: the full EMA weights (gathered under FSDP2)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t  # FSDP2: this rank's shard, a view of the parameter


class WeightEMA:
    """The EMA of a prepared model's parameters and floating-point buffers, updated after each optimizer step by a
    post-step hook on the optimizer (so a step that fp16's loss scaler skips is not averaged either).

    Decay: update t (from 1) uses min(decay, (1 + t) / (10 + t)), the warmup of TensorFlow's ExponentialMovingAverage
    with num_updates: early updates follow the weights, so a short run's average is not its initial weights. The
    averaging itself is torch.optim.swa_utils' EMA function (one foreach lerp).

    BatchNorm, deliberately: the running statistics are averaged like the weights (as timm's ModelEmaV3 does), each
    rank its own; as for the training weights, rank 0's are the ones evaluated, exported and saved (DDP broadcasts
    them at each forward, FSDP2 through utils.launch.share_bn_statistics). Integer buffers (BatchNorm's batch
    counter) are not averaged: the model's count serves both."""

    def __init__(self, accelerator, model: torch.nn.Module, optimizer, decay: float):
        self.accelerator, self.model, self.decay, self.updates = accelerator, model, decay, 0
        self.shadow = [t.detach().clone() for t in self._live()]
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper steps the torch optimizer inside
        inner.register_step_post_hook(lambda *_: self.update())

    def _live(self) -> list[torch.Tensor]:
        """The model's tensors the EMA follows, this rank's part of each; fetched at each use (a resume may give
        FSDP2 new local tensors). FSDP2 leaves the root module's parameters gathered after a forward (an
        evaluation): resharding first makes every parameter this rank's shard again."""
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

    def export(self, path: Path) -> None:
        """Collective: the EMA as full, unwrapped safetensors weights, written as the training weights are."""
        with self.applied():
            export_weights(self.accelerator, self.model, path)

    def save(self, folder: Path) -> None:
        """Collective: the full EMA into a checkpoint folder (the main process writes it), with its update count."""
        accelerator = self.accelerator
        with self.applied():  # written inside: without FSDP the state dict holds the model's own tensors
            state = accelerator.get_state_dict(accelerator.unwrap_model(self.model, keep_torch_compile=False))
            if accelerator.is_main_process:
                save_file({k: v.contiguous() for k, v in state.items()}, Path(folder) / CHECKPOINT_FILE,
                          metadata={"updates": str(self.updates)})

    def load(self, folder: Path) -> None:
        """Restores the EMA a checkpoint saved (every rank reads the full file and keeps its part); a checkpoint of a
        run without --ema-decay has none: the EMA then starts from the resumed weights (one line says so)."""
        path = Path(folder) / CHECKPOINT_FILE
        if not path.is_file():
            self.accelerator.print(f"note: {folder} holds no EMA (saved without --ema-decay); the EMA starts from "
                                   f"its weights")
            self.shadow, self.updates = [t.clone() for t in self._live()], 0
            return
        with safe_open(path, "pt") as f:
            self.updates = int(f.metadata()["updates"])
        state = load_file(path)  # on the host; set_model_state_dict copies each rank's part to its device
        inner = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        with self.applied():
            set_model_state_dict(inner, state, options=StateDictOptions(full_state_dict=True))
