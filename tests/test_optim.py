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


def lrs(model: torch.nn.Module, groups: list[dict]) -> dict[str, float]:
    names = {id(p): n for n, p in model.named_parameters()}
    found = {names[id(p)]: g["lr"] for g in groups for p in g["params"]}
    assert len(found) == len(names)
    return found


@pytest.mark.parametrize(("name", "level"), [
    ("resnet8", lambda n: 0 if n.startswith(("conv1", "bn1")) else 4 if n.startswith("fc.") else int(n[5])),
    ("resnet18", lambda n: 0 if n.startswith(("conv1", "bn1")) else 5 if n.startswith("fc.") else int(n[5])),
    ("resnet9", lambda n: {0: 0, 1: 0, 3: 1, 5: 1, 7: 1, 8: 2, 10: 2, 12: 3, 14: 3, 16: 3, 19: 4}[int(n.split(".")[0])]
     ),
    ("vit_micro", lambda n: 3 if n.startswith(("encoder.ln", "heads")) else
     int(n.split(".")[2][-1]) + 1 if n.startswith("encoder.layers") else 0),
])
def test_layer_decay_scales_each_ready_models_lr_by_its_stage_or_block_below_the_head(name, level):
    """--layer-decay 0.5 on the ready models: each parameter trains at lr x 0.5^(the head's level - its own), the
    ResNets' levels their stem, stages and classifier, the ViT's its embeddings, blocks and final norm with the head
    (levels written here from the parameter names); without it, every parameter at lr."""
    from utils.models import model_layers

    model = named_model(name, 10)
    top = max(level(n) for n, _ in model.named_parameters())
    got = lrs(model, parameter_groups(model, 0.1, 5e-4, layer_decay=0.5, layers=model_layers(name)))
    assert got == {n: pytest.approx(0.1 * 0.5 ** (top - level(n)), rel=1e-12) for n in got}
    assert set(lrs(model, parameter_groups(model, 0.1, 5e-4, layers=model_layers(name))).values()) == {0.1}


def test_layer_decay_of_a_pretrained_timm_model_is_timms_own_and_composes_with_the_backbone_factor(tmp_path):
    """A pretrained timm ViT folder with a new 3-class head, --layer-decay 0.75 --backbone-lr-factor 0.5: each
    pretrained tensor trains at lr x 0.5 x timm's own layer scale for it (param_groups_layer_decay at 0.75), the new
    head at lr; the groups are named by depth."""
    import timm
    from timm.models import save_for_hf
    from timm.optim import param_groups_layer_decay

    from utils.pretrained import pretrained_model

    save_for_hf(timm.create_model("test_vit", num_classes=8), str(tmp_path / "src"), safe_serialization=True)
    model = pretrained_model(str(tmp_path / "src"), 3)
    groups = parameter_groups(model, 1e-3, 0.05, backbone_lr_factor=0.5, layer_decay=0.75)
    names = {id(p): n for n, p in model.named_parameters()}
    scale = {names[id(p)]: g["lr_scale"] for g in param_groups_layer_decay(model, layer_decay=0.75)
             for p in g["params"]}
    head = {"head.weight", "head.bias"}
    assert lrs(model, groups) == {n: pytest.approx(1e-3 if n in head else 1e-3 * 0.5 * scale[n], rel=1e-12)
                                  for n in names.values()}
    assert min(scale.values()) < 0.75 ** 2 and groups[0]["name"] == "head/depth_0" and groups[0]["lr"] == 1e-3


def test_layer_decay_of_a_transformers_model_goes_by_encoder_layer():
    """A transformers ViT of 2 encoder layers (declared as utils/pretrained.py declares the models it builds): its
    embeddings train at lr x F^3, encoder layer 0 at F^2, layer 1 at F, the final norm and classifier at lr."""
    from transformers import ViTConfig, ViTForImageClassification

    from utils.pretrained import BUILT, BuiltFrom

    model = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                intermediate_size=64, image_size=32, patch_size=8, num_labels=3))
    BUILT[model] = BuiltFrom("transformers", ("classifier.weight", "classifier.bias"))
    got = lrs(model, parameter_groups(model, 1.0, 0.05, layer_decay=0.5))

    def level(n: str) -> int:  # the layer's index in the name (transformers' ViT: vit.encoder.layer.I or vit.layers.I)
        index = [int(part) for part in n.split(".") if part.isdigit()]
        return 0 if ".embeddings." in n else index[0] + 1 if index else 3
    assert got == {n: pytest.approx(0.5 ** (3 - level(n))) for n in got}
    assert sorted({level(n) for n in got}) == [0, 1, 2, 3] and got["vit.embeddings.cls_token"] == 0.125
    assert got["classifier.bias"] == 1.0


def test_layer_decay_on_a_model_that_declares_no_layers_or_misses_one_is_one_line():
    """A copy's own model: --layer-decay without `layers` says how to declare them; layers that leave a parameter out
    name it."""
    from utils import UserError

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(UserError, match=r"^--layer-decay needs the model's layers: pass layers=\[\.\.\.\]"):
        parameter_groups(model, 0.1, 0.0, layer_decay=0.5)
    with pytest.raises(UserError, match=r"^--layer-decay: the parameter 2.weight is in none of the model's layers"):
        parameter_groups(model, 0.1, 0.0, layer_decay=0.5, layers=[("0",)])
    got = lrs(model, parameter_groups(model, 0.1, 0.0, layer_decay=0.5, layers=[("0",), ("2",)]))
    assert got == {"0.weight": 0.05, "0.bias": 0.05, "2.weight": 0.1, "2.bias": 0.1}
