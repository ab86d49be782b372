"""The optimizer's parameter groups, declared in one function that every template's `build_optimizer` calls
(`parameter_groups`): which tensors train at which learning rate and which are decayed.
  lr            a pretrained --model's new tensors (its head, as utils/pretrained.py declares them) at the peak lr,
                its pretrained ones at lr x --backbone-lr-factor; every tensor of any other model at lr.
  weight decay  on weight matrices and convolution kernels; with the exemptions on (the templates' default, as in
                timm, DeiT and ConvNeXt), none on biases, the scales and shifts of normalisation layers (every tensor
                of one dimension or none) and on class, distillation or mask tokens and position embeddings (by the
                names that timm, transformers and torchvision give them: EXEMPT_NAMES).
Each group carries a `name` (head / backbone, and / no_decay) that summary.json's optimizer record shows."""

from __future__ import annotations

import torch

from utils.pretrained import built_from

# the last part of a tensor's name that marks a token or a position embedding: timm's cls_token, dist_token,
# reg_token, pos_embed, absolute_pos_embed, relative_position_bias_table; transformers' cls_token, mask_token,
# position_embeddings; torchvision's (and train_vit.py's) class_token, pos_embedding
EXEMPT_NAMES = ("token", "pos_embed", "pos_embedding", "position_embeddings", "relative_position_bias_table")


def decays(name: str, tensor: torch.Tensor) -> bool:
    """Whether weight decay applies to the parameter `name` when the exemptions are on: not to a tensor of one
    dimension or none (biases, norms' scales and shifts, layer scales), nor to a token or a position embedding."""
    return tensor.ndim > 1 and not name.rsplit(".", 1)[-1].endswith(EXEMPT_NAMES)


def parameter_groups(model: torch.nn.Module, lr: float, weight_decay: float, *, backbone_lr_factor: float = 1.0,
                     exemptions: bool = True) -> list[dict]:
    """torch.optim parameter groups for `model` (before prepare(): its own parameter names), in this order, empty
    ones left out: the head's decayed tensors, the head's exempt ones, then the backbone's the same way. The first
    group trains at `lr` (the lr that is logged). `exemptions` False: every tensor decays."""
    built = built_from(model)
    new = set(built.new_tensors) if built else None  # None: all new, as a model trained from scratch
    groups: dict[tuple[bool, bool], list[torch.Tensor]] = {}
    for name, tensor in model.named_parameters():
        head = new is None or name in new
        groups.setdefault((not head, exemptions and not decays(name, tensor)), []).append(tensor)
    return [{"params": groups[key], "lr": lr * (backbone_lr_factor if key[0] else 1.0),
             "weight_decay": 0.0 if key[1] else weight_decay,
             "name": ("backbone" if key[0] else "head" if built else "all") + ("/no_decay" if key[1] else "")}
            for key in sorted(groups)]
