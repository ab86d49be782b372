"""The optimizer's parameter groups, declared in one function that every template's `build_optimizer` calls
(`parameter_groups`): which tensors train at which learning rate and which are decayed.
  lr            a pretrained --model's new tensors (its head, as utils/pretrained.py declares them) at the peak lr,
                its pretrained ones at lr x --backbone-lr-factor; every tensor of any other model at lr.
  weight decay  on weight matrices and convolution kernels; with the exemptions on (the templates' default, as in
                timm, DeiT and ConvNeXt), none on biases, the scales and shifts of normalisation layers (every tensor
                of one dimension or none) and on class, distillation or mask tokens and position embeddings (by the
                names that timm, transformers and torchvision give them: EXEMPT_NAMES).
  layer decay   with --layer-decay F, each tensor's lr also x F^depth, its depth the count of layers between its
                layer and the head's (`depths`): a timm model's layers as timm groups them for its own layer decay
                (param_groups_layer_decay), a transformers model's by layer (the embeddings below the first, the
                final norm and classifier with the head), any other model's as the `layers` its build_optimizer
                passes (utils/models.py's model_layers for the ready models: the ResNets by stage, the ViTs by
                block).
Each group carries a `name` (head / backbone / all, then /depth_D with layer decay, then /no_decay) that
summary.json's optimizer record shows."""

from __future__ import annotations

import math

import torch

from utils import UserError
from utils.pretrained import BuiltFrom, built_from

# the last part of a tensor's name that marks a token or a position embedding: timm's cls_token, dist_token,
# reg_token, pos_embed, absolute_pos_embed, relative_position_bias_table; transformers' cls_token, mask_token,
# position_embeddings; torchvision's (and train_vit.py's) class_token, pos_embedding
EXEMPT_NAMES = ("token", "pos_embed", "pos_embedding", "position_embeddings", "relative_position_bias_table")


def decays(name: str, tensor: torch.Tensor) -> bool:
    """Whether weight decay applies to the parameter `name` when the exemptions are on: not to a tensor of one
    dimension or none (biases, norms' scales and shifts, layer scales), nor to a token or a position embedding."""
    return tensor.ndim > 1 and not name.rsplit(".", 1)[-1].endswith(EXEMPT_NAMES)


def parameter_groups(model: torch.nn.Module, lr: float, weight_decay: float, *, backbone_lr_factor: float = 1.0,
                     exemptions: bool = True, layer_decay: float | None = None,
                     layers: list[tuple[str, ...]] | None = None) -> list[dict]:
    """torch.optim parameter groups for `model` (before prepare(): its own parameter names), in this order, empty
    ones left out: the head's, then the backbone's; within each, from the head's layer down (with `layer_decay`);
    within each, the decayed tensors, then the exempt ones. The first group trains at `lr` (the lr that is logged).
    Frozen tensors (requires_grad False) are left out. `exemptions` False: every tensor decays. `layers`: a model's
    layers from the input to the head, each the name prefixes of its parameters, for `layer_decay` on a model that is
    not timm's or transformers'."""
    built = built_from(model)
    new = set(built.new_tensors) if built else None  # None: all new, as a model trained from scratch
    depth = depths(model, layers, built) if layer_decay is not None else {}
    groups: dict[tuple[bool, int, bool], list[torch.Tensor]] = {}
    for name, tensor in (named for named in model.named_parameters() if named[1].requires_grad):  # not the frozen
        key = (new is not None and name not in new, depth.get(name, 0), exemptions and not decays(name, tensor))
        groups.setdefault(key, []).append(tensor)
    return [{"params": groups[key], "weight_decay": 0.0 if exempt else weight_decay,
             "lr": lr * (backbone_lr_factor if backbone else 1.0) * (layer_decay or 1.0) ** d,
             "name": ("backbone" if backbone else "head" if built else "all")
             + (f"/depth_{d}" if layer_decay is not None else "") + ("/no_decay" if exempt else "")}
            for key in sorted(groups) for backbone, d, exempt in [key]]


def depths(model: torch.nn.Module, layers: list[tuple[str, ...]] | None, built: BuiltFrom | None) -> dict[str, int]:
    """Each parameter's depth below the head's layer (0: in it), for --layer-decay; `built`: the pretrained model's
    declaration (utils.pretrained.built_from), or None."""
    names = [name for name, _ in model.named_parameters()]
    if built is not None and built.library == "timm":
        from timm.optim import param_groups_layer_decay

        # timm's own grouping (its group_matcher, or its fallback), read off the scales it gives at a decay of 1/2
        tensor_names = {id(tensor): name for name, tensor in model.named_parameters()}
        return {tensor_names[id(tensor)]: round(-math.log2(group["lr_scale"]))
                for group in param_groups_layer_decay(model, layer_decay=0.5) for tensor in group["params"]}
    if built is not None:  # transformers
        level = encoder_levels(names)
    elif layers is None:
        raise UserError("--layer-decay needs the model's layers: pass layers=[...] (from the input to the head, the "
                        "name prefixes of each layer's parameters) to parameter_groups in build_optimizer "
                        "(docs/customizing.md).")
    else:
        level = {}
        for name in names:
            found = [k for k, prefixes in enumerate(layers)
                     if any(name == p or name.startswith(p + ".") for p in prefixes)]
            if not found:
                raise UserError(f"--layer-decay: the parameter {name} is in none of the model's layers (the layers "
                                f"passed to parameter_groups: {[list(p) for p in layers]}).")
            level[name] = found[0]
    top = max(level.values())
    return {name: top - k for name, k in level.items()}


def encoder_levels(names: list[str]) -> dict[str, int]:
    """A transformers model's parameters by level: 0 what comes before its first numbered layer (the embeddings),
    then each layer by the first index in the names (an encoder layer; a stage, in Swin- and ConvNeXt-like models),
    in the order they come, and last what follows the last layer (the final norm, the pooler, the classifier)."""
    order: dict[str, int] = {}
    level: dict[str, int | None] = {}
    for name in names:
        index = next((part for part in name.split(".") if part.isdigit()), None)
        if index is not None:
            level[name] = order.setdefault(index, len(order) + 1)
        else:
            level[name] = 0 if not order else None  # after the layers: the head's level, known at the end
    return {name: len(order) + 1 if k is None else k for name, k in level.items()}
