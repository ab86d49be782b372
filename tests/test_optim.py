"""utils/optim.py: the parameter groups every template's build_optimizer takes, checked against each library's own
rule for which tensors weight decay spares (timm's param_groups_weight_decay, the ViT/DeiT rule train_vit.py
states, transformers' embeddings by name) and against the tensors' shapes."""

from __future__ import annotations

import pytest
import torch

from utils.models import named_model
from utils.optim import parameter_groups


def exempt_names(model: torch.nn.Module, exemptions: bool = True) -> set[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    groups = parameter_groups(model, 0.1, 5e-4, exemptions=exemptions)
    assert sum(len(g["params"]) for g in groups) == len(names)  # every parameter, once
    assert all(g["lr"] == 0.1 for g in groups)  # a model trained from scratch: all at lr
    return {names[id(p)] for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}


@pytest.mark.parametrize("name", ["test_vit", "test_vit_relpos", "test_convnext", "test_efficientnet", "test_maxvit"])
def test_weight_decay_spares_what_timms_own_rule_spares_on_timm_models(name):
    """On timm's test models (a ViT with class token and position embedding, one with relative position biases, a
    ConvNeXt with layer scales, an EfficientNet, a MaxViT), the exempt tensors are exactly those of timm's
    param_groups_weight_decay with the model's own no_weight_decay() list (none where it declares none), as timm's
    optimizer factory calls it."""
    import timm
    from timm.optim import param_groups_weight_decay

    model = timm.create_model(name, num_classes=3)
    names = {id(p): n for n, p in model.named_parameters()}
    declared = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()  # as timm's optimizer factory
    reference = param_groups_weight_decay(model, 5e-4, no_weight_decay_list=declared)
    spared = {names[id(p)] for g in reference if g["weight_decay"] == 0.0 for p in g["params"]}
    assert exempt_names(model) == spared
    assert len(spared) < len(names)


def test_weight_decay_spares_biases_norms_and_the_vits_class_token_and_position_embedding():
    """The ready models: resnet8's decayed tensors are its convolution kernels and fc.weight, every BatchNorm tensor
    and bias is spared; train_vit.py's vit_micro spares every tensor of one dimension, class_token and
    encoder.pos_embedding (the ViT/DeiT rule); --no-decay-exemptions spares none."""
    resnet = named_model("resnet8", 10)
    norms = {f"{m}.{t}" for m, module in resnet.named_modules() if isinstance(module, torch.nn.BatchNorm2d)
             for t in ("weight", "bias")}
    assert exempt_names(resnet) == norms | {"fc.bias"}
    vit = named_model("vit_micro", 10)
    assert exempt_names(vit) == {n for n, p in vit.named_parameters()
                                 if p.ndim <= 1 or n in ("class_token", "encoder.pos_embedding")}
    assert exempt_names(resnet, exemptions=False) == exempt_names(vit, exemptions=False) == set()
    [group] = parameter_groups(resnet, 0.1, 5e-4, exemptions=False)
    assert (group["name"], group["weight_decay"]) == ("all", 5e-4)


def test_weight_decay_spares_a_transformers_vits_embeddings_tokens_norms_and_biases():
    """A transformers ViT (built from a small config): its cls_token, position_embeddings, every LayerNorm tensor
    and every bias are spared; its weight matrices and patch-embedding kernel decay."""
    from transformers import ViTConfig, ViTForImageClassification

    model = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                intermediate_size=64, image_size=32, patch_size=8, num_labels=3))
    norms = {f"{m}.{t}" for m, module in model.named_modules() if isinstance(module, torch.nn.LayerNorm)
             for t in ("weight", "bias")}
    biases = {n for n, _ in model.named_parameters() if n.endswith(".bias")}
    tokens = {"vit.embeddings.cls_token", "vit.embeddings.position_embeddings"}
    assert exempt_names(model) == norms | biases | tokens
